package index

import (
	"encoding/binary"
	"fmt"
	"hash/crc32"

	"github.com/cudapool/cudapool/kv"
	"github.com/cudapool/cudapool/kv/internal/kvwire"
)

// The file is an append-only journal of records, each u32 length | payload | u32
// CRC-32C of the payload, little-endian. The first record is the header (magic,
// version, epoch, keeper, geometry, devices); each later one a change, its first
// payload byte its Kind.
const (
	magic   = "CPKVIDX1"
	version = 1
	// MaxDevices bounds the devices a header may list.
	MaxDevices = 1024
)

// Kind is what a record after the header says.
type Kind byte

// The kinds of record.
const (
	Seal     Kind = 1 // dev, page, hash: the page became visible under hash
	Free     Kind = 2 // dev, page: a visible page was evicted
	Attach   Kind = 3 // pid, start: a replica was admitted
	Detach   Kind = 4 // pid, start: a replica's connection ended
	HostSeal Kind = 5 // dev, host page, hash: the host page holds hash, its copy completed
	HostFree Kind = 6 // dev, host page: a sealed host page was evicted
	// A lease, from its grant until its end (a write lease's: its pages visible or
	// free again): its grant, then one record per page (a read lease's each followed
	// by the page's hash), appended together, and its end.
	Lease     Kind = 7  // lease, dev, pid, start: a write lease was granted to a process
	LeasePage Kind = 8  // lease, page: a page of that lease
	LeaseEnd  Kind = 9  // lease: the lease ended
	ReadLease Kind = 10 // lease, dev, pid, start: a read lease was granted to a process
	LeaseHash Kind = 11 // lease, hash: the hash of a read lease's page, after its LeasePage
)

// Byte sizes of the records, framing included.
const (
	pagePayload  = 1 + 4 + 4 + len(kv.Hash{}) // a Free's is shorter by the hash
	procPayload  = 1 + 4 + 8
	grantPayload = 1 + 8 + 4 + 4 + 8 // no more than a page record's: the reader's bound
	leasePayload = 1 + 8             // an End's; a LeasePage's has the page too, a LeaseHash's the hash
	headerFixed  = len(magic) + 4 + 8 + 4 + 8 + kvwire.GeometryLen + 4
	maxPayload   = headerFixed + 4*MaxDevices
	frame        = 8 // the length and the checksum
)

var castagnoli = crc32.MakeTable(crc32.Castagnoli)

// Proc names a process across pid reuse: its pid and its start time in clock ticks
// since boot.
type Proc struct {
	PID   uint32
	Start uint64
}

func (p Proc) String() string { return fmt.Sprintf("pid %d (start %d)", p.PID, p.Start) }

// Header is what an index is of: its epoch (one more at each start), the keeper of
// the slabs, their geometry and the devices.
type Header struct {
	Epoch    uint64
	Keeper   Proc
	Geometry kv.Geometry
	Devices  []int
}

// appendRecord appends one record whose payload fill appends.
func appendRecord(b []byte, fill func([]byte) []byte) []byte {
	start := len(b)
	b = fill(append(b, 0, 0, 0, 0))
	p := b[start+4:]
	binary.LittleEndian.PutUint32(b[start:], uint32(len(p)))
	return binary.LittleEndian.AppendUint32(b, crc32.Checksum(p, castagnoli))
}

// AppendHeader appends h's header record to b.
func AppendHeader(b []byte, h Header) []byte {
	return appendRecord(b, func(b []byte) []byte {
		b = append(b, magic...)
		b = binary.LittleEndian.AppendUint32(b, version)
		b = binary.LittleEndian.AppendUint64(b, h.Epoch)
		b = binary.LittleEndian.AppendUint32(b, h.Keeper.PID)
		b = binary.LittleEndian.AppendUint64(b, h.Keeper.Start)
		b = kvwire.AppendGeometry(b, h.Geometry)
		b = binary.LittleEndian.AppendUint32(b, uint32(len(h.Devices)))
		for _, d := range h.Devices {
			b = binary.LittleEndian.AppendUint32(b, uint32(d))
		}
		return b
	})
}

// AppendPage appends a page record of kind k (Seal, Free, HostSeal, HostFree; h is
// ignored for a Free and a HostFree).
func AppendPage(b []byte, k Kind, dev int, page uint32, h kv.Hash) []byte {
	return appendRecord(b, func(b []byte) []byte {
		b = binary.LittleEndian.AppendUint32(binary.LittleEndian.AppendUint32(append(b, byte(k)), uint32(dev)), page)
		if k == Seal || k == HostSeal {
			b = append(b, h[:]...)
		}
		return b
	})
}

// AppendProc appends a replica record of kind k (Attach, Detach).
func AppendProc(b []byte, k Kind, p Proc) []byte {
	return appendRecord(b, func(b []byte) []byte {
		return binary.LittleEndian.AppendUint64(binary.LittleEndian.AppendUint32(append(b, byte(k)), p.PID), p.Start)
	})
}

// Grant is a lease as the index journals it: granted to Holder on device Dev, of
// Pages, until its End; a read lease (Read) with the Hashes its pages were visible
// under.
type Grant struct {
	Lease  uint64
	Dev    int
	Holder Proc
	Pages  []uint32
	Read   bool
	Hashes []kv.Hash
}

// records is how many records g takes: its grant and one per page (a read lease's
// two).
func (g *Grant) records() int {
	if g.Read {
		return 1 + 2*len(g.Pages)
	}
	return 1 + len(g.Pages)
}

// AppendGrant appends g's records: its grant, then one per page (a read lease's
// each followed by its hash).
func AppendGrant(b []byte, g *Grant) []byte {
	k := Lease
	if g.Read {
		k = ReadLease
	}
	b = appendRecord(b, func(b []byte) []byte {
		b = binary.LittleEndian.AppendUint32(binary.LittleEndian.AppendUint64(append(b, byte(k)), g.Lease), uint32(g.Dev))
		return binary.LittleEndian.AppendUint64(binary.LittleEndian.AppendUint32(b, g.Holder.PID), g.Holder.Start)
	})
	for i, pg := range g.Pages {
		b = appendRecord(b, func(b []byte) []byte {
			return binary.LittleEndian.AppendUint32(binary.LittleEndian.AppendUint64(append(b, byte(LeasePage)), g.Lease), pg)
		})
		if g.Read {
			b = appendRecord(b, func(b []byte) []byte {
				return append(binary.LittleEndian.AppendUint64(append(b, byte(LeaseHash)), g.Lease), g.Hashes[i][:]...)
			})
		}
	}
	return b
}

// AppendEnd appends the end of write lease id.
func AppendEnd(b []byte, id uint64) []byte {
	return appendRecord(b, func(b []byte) []byte { return binary.LittleEndian.AppendUint64(append(b, byte(LeaseEnd)), id) })
}

// parseHeader reads a header record's payload.
func parseHeader(p []byte) (Header, error) {
	var h Header
	if len(p) < len(magic) || string(p[:len(magic)]) != magic {
		return h, fmt.Errorf("%w: not an index file (bad magic)", ErrCorrupt)
	}
	if len(p) < headerFixed {
		return h, fmt.Errorf("%w: a header of %d bytes", ErrCorrupt, len(p))
	}
	p = p[len(magic):]
	if v := binary.LittleEndian.Uint32(p); v != version {
		return h, fmt.Errorf("%w: index version %d; this owner reads %d", ErrCorrupt, v, version)
	}
	h.Epoch = binary.LittleEndian.Uint64(p[4:])
	h.Keeper = Proc{PID: binary.LittleEndian.Uint32(p[12:]), Start: binary.LittleEndian.Uint64(p[16:])}
	g, err := kvwire.ParseGeometry(p[24 : 24+kvwire.GeometryLen])
	if err != nil {
		return h, fmt.Errorf("%w: the header's geometry: %w", ErrCorrupt, err)
	}
	h.Geometry = g
	p = p[24+kvwire.GeometryLen:]
	n := binary.LittleEndian.Uint32(p)
	p = p[4:]
	if uint64(len(p)) != 4*uint64(n) {
		return h, fmt.Errorf("%w: the header lists %d devices in %d bytes", ErrCorrupt, n, len(p))
	}
	for i := range n {
		h.Devices = append(h.Devices, int(binary.LittleEndian.Uint32(p[4*i:])))
	}
	return h, nil
}
