package owner

import (
	"bytes"
	"cmp"
	"encoding/binary"
	"errors"
	"fmt"
	"hash/crc32"
	"io"
	"log/slog"
	"os"
	"slices"
	"strconv"
	"strings"

	"github.com/cudapool/cudapool/kv"
	"github.com/cudapool/cudapool/kv/internal/kvwire"
)

// The index file (WithIndex) is what a restarted owner needs to serve the pages
// its predecessor made visible: an append-only journal of records, each u32 length |
// payload | u32 CRC-32C of the payload, little-endian. The first record is the header:
// the magic, the version, the epoch (one more at each start), the keeper of the slabs
// (its pid and start time: a slab made by another process is another slab), the
// geometry and the devices. Then one record per change:
//
//	seal   dev, page, hash   page became visible under hash
//	free   dev, page         visible page evicted (written before the page is reused)
//	attach pid, start        a replica was admitted
//	detach pid, start        a replica's connection ended
//	hostseal dev, hpage, hash  host page hpage holds hash, its spill copy completed
//	hostfree dev, hpage        sealed host page evicted (written before it is refilled)
//	grant  lease, dev, pid, start, pages  a write lease was granted to a process
//	       (written before the grant is answered)
//	end    lease                 a write lease's pages are visible or free again
//
// Only visible pages are ever written, so a page whose writer had not finished never
// becomes visible, also across a restart. Once the journal holds more records than
// twice the pages (and 1,024), it is rewritten as a snapshot: the header with the next
// epoch and one record per visible page and per sealed host page, least recent
// first, and the replicas attached.
// A record whose checksum or length is wrong, anywhere, drops the whole index: the
// owner starts empty and says why, rather than serve a page it cannot vouch for.

const (
	indexMagic   = "CPKVIDX1"
	indexVersion = 1
)

// The record types after the header.
const (
	recSeal   byte = 1
	recFree   byte = 2
	recAttach byte = 3
	recDetach byte = 4
	// The host tier's (hosttier.go): a host page sealed under a hash once its spill
	// copy has completed, and one evicted (written before the page is filled again).
	recHostSeal byte = 5
	recHostFree byte = 6
	// A write lease's grant, and its end (restart.go): the pages a restarted owner
	// keeps for the writer while its process lives.
	recGrant byte = 7
	recEnd   byte = 8
)

var castagnoli = crc32.MakeTable(crc32.Castagnoli)

// procID names a process across pid reuse: its pid and its start time in clock ticks
// since boot (/proc/PID/stat, field 22).
type procID struct {
	PID   uint32
	Start uint64
}

func (p procID) String() string { return fmt.Sprintf("pid %d (start %d)", p.PID, p.Start) }

// procStart is pid's start time, or an error if it has no live process.
func procStart(pid int) (uint64, error) {
	b, err := os.ReadFile("/proc/" + strconv.Itoa(pid) + "/stat")
	if err != nil {
		return 0, err
	}
	// The command name, field 2, is in parentheses and may hold spaces: count after it.
	i := bytes.LastIndexByte(b, ')')
	if i < 0 {
		return 0, fmt.Errorf("kv/owner: /proc/%d/stat: no command name", pid)
	}
	fields := strings.Fields(string(b[i+1:]))
	if len(fields) < 20 {
		return 0, fmt.Errorf("kv/owner: /proc/%d/stat: %d fields", pid, len(fields)+2)
	}
	if fields[0] == "Z" || fields[0] == "X" { // exited, not reaped yet
		return 0, fmt.Errorf("kv/owner: pid %d has exited", pid)
	}
	return strconv.ParseUint(fields[19], 10, 64) // field 22
}

// procOf is the procID of the live process pid.
func procOf(pid int) (procID, error) {
	st, err := procStart(pid)
	return procID{PID: uint32(pid), Start: st}, err
}

// indexHeader is what an index is of.
type indexHeader struct {
	Epoch    uint64
	Keeper   procID
	Geometry kv.Geometry
	Devices  []int
}

// sealedPage is a visible page of the index.
type sealedPage struct {
	page uint32
	hash kv.Hash
}

// grantRec is a write lease of the index: granted, and not ended.
type grantRec struct {
	lease  uint64
	dev    int
	holder procID
	pages  []uint32
}

// recovered is what an index file held.
type recovered struct {
	hdr      indexHeader
	sealed   map[int][]sealedPage // by device, least recent first
	host     map[int][]sealedPage // the host tiers' sealed pages, likewise
	attached []procID             // replicas admitted and not gone, one per connection
	grants   []grantRec           // write leases not ended, by lease id
}

// errNoIndex says there is no index file: a first start.
var errNoIndex = errors.New("no index")

// loadIndex reads the index at path. Any fault in it is an error saying what: the
// caller drops the index (with the error, the header, if it was read).
func loadIndex(path string) (*recovered, error) {
	b, err := os.ReadFile(path)
	if errors.Is(err, os.ErrNotExist) {
		return nil, errNoIndex
	}
	if err != nil {
		return nil, err
	}
	next := func() ([]byte, error) {
		if len(b) < 4 {
			return nil, fmt.Errorf("truncated: %d bytes where a record's length is", len(b))
		}
		n := binary.LittleEndian.Uint32(b)
		if uint64(n)+8 > uint64(len(b)) {
			return nil, fmt.Errorf("truncated: a record of %d bytes, %d left", n, len(b)-4)
		}
		p := b[4 : 4+n]
		if sum := binary.LittleEndian.Uint32(b[4+n:]); sum != crc32.Checksum(p, castagnoli) {
			return nil, errors.New("a record's checksum is wrong")
		}
		b = b[8+n:]
		return p, nil
	}
	hp, err := next()
	if err != nil {
		return nil, fmt.Errorf("the header: %w", err)
	}
	hdr, err := parseHeader(hp)
	if err != nil {
		return nil, err
	}
	rec := &recovered{hdr: hdr, sealed: map[int][]sealedPage{}}
	type live struct {
		hash kv.Hash
		seq  int
	}
	pages, host := map[int]map[uint32]live{}, map[int]map[uint32]live{}
	for _, d := range hdr.Devices {
		pages[d], host[d] = map[uint32]live{}, map[uint32]live{}
	}
	attached := map[procID]int{}
	grants := map[uint64]grantRec{}
	for seq := 0; len(b) > 0; seq++ {
		p, err := next()
		if err != nil {
			return &recovered{hdr: hdr}, fmt.Errorf("record %d: %w", seq+1, err)
		}
		if len(p) == 0 {
			return &recovered{hdr: hdr}, fmt.Errorf("record %d is empty", seq+1)
		}
		typ, p := p[0], p[1:]
		switch typ {
		case recSeal, recFree, recHostSeal, recHostFree:
			want := 8
			if typ == recSeal || typ == recHostSeal {
				want += len(kv.Hash{})
			}
			if len(p) != want {
				return &recovered{hdr: hdr}, fmt.Errorf("record %d: %d bytes for a page record", seq+1, len(p))
			}
			dev, pg := int(binary.LittleEndian.Uint32(p)), binary.LittleEndian.Uint32(p[4:])
			of := pages
			if typ == recHostSeal || typ == recHostFree {
				of = host // host pages are bounded by the tier, checked as it is restored
			}
			m, ok := of[dev]
			switch {
			case !ok:
				return &recovered{hdr: hdr}, fmt.Errorf("record %d: device %d is not one of %v", seq+1, dev, hdr.Devices)
			case typ <= recFree && int(pg) >= hdr.Geometry.Pages:
				return &recovered{hdr: hdr}, fmt.Errorf("record %d: page %d of %d", seq+1, pg, hdr.Geometry.Pages)
			}
			if typ == recFree || typ == recHostFree {
				delete(m, pg)
				continue
			}
			m[pg] = live{hash: kv.Hash(p[8:]), seq: seq}
		case recAttach, recDetach:
			if len(p) != 12 {
				return &recovered{hdr: hdr}, fmt.Errorf("record %d: %d bytes for a replica record", seq+1, len(p))
			}
			id := procID{PID: binary.LittleEndian.Uint32(p), Start: binary.LittleEndian.Uint64(p[4:])}
			if typ == recAttach {
				attached[id]++
			} else if attached[id]--; attached[id] <= 0 {
				delete(attached, id)
			}
		case recGrant:
			const fixed = 8 + 4 + 4 + 8
			if len(p) < fixed+4 || (len(p)-fixed)%4 != 0 {
				return &recovered{hdr: hdr}, fmt.Errorf("record %d: %d bytes for a grant record", seq+1, len(p))
			}
			g := grantRec{lease: binary.LittleEndian.Uint64(p), dev: int(binary.LittleEndian.Uint32(p[8:])),
				holder: procID{PID: binary.LittleEndian.Uint32(p[12:]), Start: binary.LittleEndian.Uint64(p[16:])}}
			if !slices.Contains(hdr.Devices, g.dev) {
				return &recovered{hdr: hdr}, fmt.Errorf("record %d: device %d is not one of %v", seq+1, g.dev, hdr.Devices)
			}
			for q := p[fixed:]; len(q) > 0; q = q[4:] {
				pg := binary.LittleEndian.Uint32(q)
				if int(pg) >= hdr.Geometry.Pages {
					return &recovered{hdr: hdr}, fmt.Errorf("record %d: page %d of %d", seq+1, pg, hdr.Geometry.Pages)
				}
				g.pages = append(g.pages, pg)
			}
			grants[g.lease] = g
		case recEnd:
			if len(p) != 8 {
				return &recovered{hdr: hdr}, fmt.Errorf("record %d: %d bytes for an end record", seq+1, len(p))
			}
			delete(grants, binary.LittleEndian.Uint64(p))
		default:
			return &recovered{hdr: hdr}, fmt.Errorf("record %d has unknown type %d", seq+1, typ)
		}
	}
	for _, g := range grants {
		rec.grants = append(rec.grants, g)
	}
	slices.SortFunc(rec.grants, func(a, b grantRec) int { return cmp.Compare(a.lease, b.lease) })
	rec.host = map[int][]sealedPage{}
	for _, tier := range []struct {
		of   map[int]map[uint32]live
		to   map[int][]sealedPage
		what string
	}{{pages, rec.sealed, "pages %d and %d are visible"}, {host, rec.host, "host pages %d and %d are sealed"}} {
		for dev, m := range tier.of {
			seen := make(map[kv.Hash]uint32, len(m))
			type ordered struct {
				sealedPage
				seq int
			}
			all := make([]ordered, 0, len(m))
			for pg, l := range m {
				if other, dup := seen[l.hash]; dup {
					return &recovered{hdr: hdr}, fmt.Errorf("device %d: "+tier.what+" under one hash", dev, other, pg)
				}
				seen[l.hash] = pg
				all = append(all, ordered{sealedPage{pg, l.hash}, l.seq})
			}
			slices.SortFunc(all, func(a, b ordered) int { return a.seq - b.seq })
			for _, o := range all {
				tier.to[dev] = append(tier.to[dev], o.sealedPage)
			}
		}
	}
	for id, n := range attached {
		for range n { // one per connection: a process may hold several replicas
			rec.attached = append(rec.attached, id)
		}
	}
	slices.SortFunc(rec.attached, func(a, b procID) int { return int(a.PID) - int(b.PID) })
	return rec, nil
}

func parseHeader(p []byte) (indexHeader, error) {
	var h indexHeader
	if len(p) < len(indexMagic) || string(p[:len(indexMagic)]) != indexMagic {
		return h, errors.New("not an index file (bad magic)")
	}
	p = p[len(indexMagic):]
	const fixed = 4 + 8 + 4 + 8 + kvwire.GeometryLen + 4
	if len(p) < fixed {
		return h, fmt.Errorf("a header of %d bytes", len(p)+len(indexMagic))
	}
	if v := binary.LittleEndian.Uint32(p); v != indexVersion {
		return h, fmt.Errorf("index version %d; this owner reads %d", v, indexVersion)
	}
	h.Epoch = binary.LittleEndian.Uint64(p[4:])
	h.Keeper = procID{PID: binary.LittleEndian.Uint32(p[12:]), Start: binary.LittleEndian.Uint64(p[16:])}
	g, err := kvwire.ParseGeometry(p[24 : 24+kvwire.GeometryLen])
	if err != nil {
		return h, fmt.Errorf("the header's geometry: %w", err)
	}
	h.Geometry = g
	p = p[24+kvwire.GeometryLen:]
	n := binary.LittleEndian.Uint32(p)
	p = p[4:]
	if uint64(len(p)) != 4*uint64(n) {
		return h, fmt.Errorf("the header lists %d devices in %d bytes", n, len(p))
	}
	for i := range n {
		h.Devices = append(h.Devices, int(binary.LittleEndian.Uint32(p[4*i:])))
	}
	return h, nil
}

// appendRecord appends one record whose payload fill appends.
func appendRecord(b []byte, fill func([]byte) []byte) []byte {
	start := len(b)
	b = fill(append(b, 0, 0, 0, 0))
	p := b[start+4:]
	binary.LittleEndian.PutUint32(b[start:], uint32(len(p)))
	return binary.LittleEndian.AppendUint32(b, crc32.Checksum(p, castagnoli))
}

func appendHeader(b []byte, h indexHeader) []byte {
	return appendRecord(b, func(b []byte) []byte {
		b = append(b, indexMagic...)
		b = binary.LittleEndian.AppendUint32(b, indexVersion)
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

func appendPageRecord(b []byte, typ byte, dev int, page uint32, h *kv.Hash) []byte {
	return appendRecord(b, func(b []byte) []byte {
		b = binary.LittleEndian.AppendUint32(binary.LittleEndian.AppendUint32(append(b, typ), uint32(dev)), page)
		if h != nil {
			b = append(b, h[:]...)
		}
		return b
	})
}

func appendProcRecord(b []byte, typ byte, id procID) []byte {
	return appendRecord(b, func(b []byte) []byte {
		return binary.LittleEndian.AppendUint64(binary.LittleEndian.AppendUint32(append(b, typ), id.PID), id.Start)
	})
}

func appendGrantRecord(b []byte, g *grantRec) []byte {
	return appendRecord(b, func(b []byte) []byte {
		b = binary.LittleEndian.AppendUint64(append(b, recGrant), g.lease)
		b = binary.LittleEndian.AppendUint32(b, uint32(g.dev))
		b = binary.LittleEndian.AppendUint64(binary.LittleEndian.AppendUint32(b, g.holder.PID), g.holder.Start)
		for _, pg := range g.pages {
			b = binary.LittleEndian.AppendUint32(b, pg)
		}
		return b
	})
}

// journal appends the owner's changes to its index file. Its methods are called with
// the Owner's mu held.
type journal struct {
	path    string
	log     *slog.Logger
	hdr     indexHeader
	f       *os.File // nil once broken
	buf     []byte   // records not yet written
	records int      // records in the file
	limit   int      // records past which flush compacts
	// snapshot appends the records of the owner's present state (visible pages least
	// recent first, replicas attached).
	snapshot func([]byte) []byte
}

// newJournal writes a fresh index at path (the header with hdr and what snapshot
// appends) and opens it for appending.
func newJournal(path string, hdr indexHeader, log *slog.Logger, snapshot func([]byte) []byte) (*journal, error) {
	j := &journal{path: path, log: log, hdr: hdr, snapshot: snapshot, limit: 2*hdr.Geometry.Pages*len(hdr.Devices) + 1024}
	if err := j.compact(); err != nil {
		return nil, err
	}
	return j, nil
}

func (j *journal) seal(dev int, page uint32, h kv.Hash) { j.page(recSeal, dev, page, &h) }

func (j *journal) free(dev int, page uint32) { j.page(recFree, dev, page, nil) }

func (j *journal) hostSeal(dev int, page uint32, h kv.Hash) { j.page(recHostSeal, dev, page, &h) }

func (j *journal) hostFree(dev int, page uint32) { j.page(recHostFree, dev, page, nil) }

// page buffers a page record of typ (h nil for a free).
func (j *journal) page(typ byte, dev int, page uint32, h *kv.Hash) {
	if j != nil && j.f != nil {
		j.buf = appendPageRecord(j.buf, typ, dev, page, h)
	}
}

// grant writes write lease g's grant: it is on disk when grant returns (or the
// journal is broken), so that no restart frees its pages while its writer lives.
func (j *journal) grant(g *grantRec) {
	if j != nil && j.f != nil {
		j.buf = appendGrantRecord(j.buf, g)
		j.flush()
	}
}

// end buffers the end of write lease id: its pages are visible or free.
func (j *journal) end(id uint64) {
	if j != nil && j.f != nil {
		j.buf = appendRecord(j.buf, func(b []byte) []byte { return binary.LittleEndian.AppendUint64(append(b, recEnd), id) })
	}
}

func (j *journal) replica(typ byte, id procID) {
	if j != nil && j.f != nil {
		j.buf = appendProcRecord(j.buf, typ, id)
		j.flush()
	}
}

// flush writes the records buffered, and compacts the file once it holds over limit
// records. A write that fails breaks the journal: the file is removed, so that no
// restart serves from an index that missed a change.
func (j *journal) flush() {
	if j == nil || j.f == nil || len(j.buf) == 0 {
		return
	}
	n := countRecords(j.buf)
	if _, err := j.f.Write(j.buf); err != nil {
		j.fail(err)
		return
	}
	j.buf = j.buf[:0]
	if j.records += n; j.records > j.limit {
		if err := j.compact(); err != nil {
			j.fail(err)
		}
	}
}

func countRecords(b []byte) (n int) {
	for len(b) >= 4 {
		b = b[8+binary.LittleEndian.Uint32(b):]
		n++
	}
	return n
}

// compact rewrites the file as the header and a snapshot, through a new file renamed
// over it.
func (j *journal) compact() error {
	b := appendHeader(nil, j.hdr)
	b = j.snapshot(b)
	tmp := j.path + ".new"
	if err := os.WriteFile(tmp, b, 0o600); err != nil {
		return fmt.Errorf("kv/owner: writing the index: %w", err)
	}
	if err := os.Rename(tmp, j.path); err != nil {
		_ = os.Remove(tmp) // best effort: the rename's error is the one returned
		return fmt.Errorf("kv/owner: writing the index: %w", err)
	}
	f, err := os.OpenFile(j.path, os.O_WRONLY|os.O_APPEND, 0)
	if err != nil {
		return fmt.Errorf("kv/owner: opening the index: %w", err)
	}
	if j.f != nil {
		_ = j.f.Close() // cleanup: the file was replaced; nothing is buffered in it
	}
	j.f, j.buf, j.records = f, j.buf[:0], countRecords(b)-1
	return nil
}

// fail stops the journal after err and removes its file.
func (j *journal) fail(err error) {
	j.log.Error("kv: the index cannot be written; it is removed, and a restart starts with no pages", "path", j.path, "err", err)
	if j.f != nil {
		_ = j.f.Close() // cleanup: the journal is broken already
		j.f = nil
	}
	if rerr := os.Remove(j.path); rerr != nil && !errors.Is(rerr, os.ErrNotExist) {
		if terr := os.Truncate(j.path, 0); terr != nil {
			j.log.Error("kv: the broken index cannot be removed: remove it before the next start", "path", j.path, "err", rerr)
		}
	}
}

// close writes what is buffered and closes the file.
func (j *journal) close() error {
	if j == nil || j.f == nil {
		return nil
	}
	j.flush()
	if j.f == nil {
		return nil
	}
	err := j.f.Close()
	j.f = nil
	if err != nil && !errors.Is(err, io.EOF) {
		return fmt.Errorf("kv/owner: closing the index: %w", err)
	}
	return nil
}
