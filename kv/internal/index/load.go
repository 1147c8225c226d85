package index

import (
	"bufio"
	"cmp"
	"encoding/binary"
	"errors"
	"fmt"
	"hash/crc32"
	"io"
	"os"
	"slices"

	"golang.org/x/sys/unix"

	"github.com/cudapool/cudapool/kv"
)

// Shape is what an index may hold, and so how large its file may grow: the geometry
// and the devices it is of, the host pages of each device's host tier (0: none) and
// the most replica records a snapshot holds (attached connections, and those waited
// for after a restart).
type Shape struct {
	Geometry  kv.Geometry
	Devices   []int
	HostPages int
	Replicas  int
	// ReadPages is the most pages of read leases live at once, all devices together:
	// each takes a LeasePage and a LeaseHash record, and at most one grant.
	ReadPages int
}

// maxBatch is the most records the writer writes at once: a file grows past its
// compaction limit by at most that many.
const maxBatch = 4096

// pages is the most page records a snapshot of s holds: each slab page visible, or
// in a write lease (its GrantPage, and at most one Grant a page), and each host page.
func (s Shape) pages() int { return len(s.Devices) * (3*s.Geometry.Pages + s.HostPages) }

// limit bounds the records past which the writer compacts a file of shape s: twice
// the largest snapshot (every page, and the replicas) and 1,024, so that a
// compaction's cost is spread over as many changes. The writer compacts sooner, past
// twice its latest snapshot (and twice the pages, and 1,024).
func (s Shape) limit() int { return 2*(s.pages()+s.Replicas+3*s.ReadPages) + 1024 }

// MaxRecords is the most records a file of shape s holds, its header included: a
// snapshot grows to the compaction limit, and by one batch past it. Load refuses a
// longer file.
func (s Shape) MaxRecords() int { return 1 + s.limit() + maxBatch }

// maxBytes is the most bytes a file of shape s holds.
func (s Shape) maxBytes() int64 {
	return int64(frame+maxPayload) + int64(s.MaxRecords()-1)*int64(frame+pagePayload)
}

// Page is a visible page, or a sealed host page, of an index.
type Page struct {
	Page uint32
	Hash kv.Hash
}

// State is what an index file held: its header, each device's visible pages and
// sealed host pages, least recent first, the replicas attached and not gone, one per
// connection (a process may hold several), and the write leases granted and not
// ended, by lease.
type State struct {
	Header   Header
	Sealed   map[int][]Page
	Host     map[int][]Page
	Attached []Proc
	Grants   []Grant
}

// openRegular opens path for reading if it is a regular file: without following a
// symbolic link, and without blocking on a named pipe or a device (O_NONBLOCK), both
// refused with an error wrapping ErrNotRegular that says what is there. No file is
// an error wrapping ErrNoIndex.
func openRegular(path string) (*os.File, int64, error) {
	fd, err := unix.Open(path, unix.O_RDONLY|unix.O_NOFOLLOW|unix.O_NONBLOCK|unix.O_CLOEXEC, 0)
	switch {
	case errors.Is(err, unix.ENOENT):
		return nil, 0, fmt.Errorf("%w at %s", ErrNoIndex, path)
	case errors.Is(err, unix.ELOOP):
		return nil, 0, fmt.Errorf("%w: %s is a symbolic link; remove it", ErrNotRegular, path)
	case err != nil:
		return nil, 0, fmt.Errorf("kv/internal/index: opening %s: %w", path, err)
	}
	var st unix.Stat_t
	if err := unix.Fstat(fd, &st); err != nil {
		_ = unix.Close(fd) // cleanup: the stat's error is the one returned
		return nil, 0, fmt.Errorf("kv/internal/index: %s: %w", path, err)
	}
	if st.Mode&unix.S_IFMT != unix.S_IFREG {
		_ = unix.Close(fd) // cleanup: refused
		return nil, 0, fmt.Errorf("%w: %s is %s; remove it", ErrNotRegular, path, fileType(st.Mode))
	}
	return os.NewFile(uintptr(fd), path), st.Size, nil
}

// fileType names what a mode's type is.
func fileType(mode uint32) string {
	switch mode & unix.S_IFMT {
	case unix.S_IFIFO:
		return "a named pipe"
	case unix.S_IFCHR:
		return "a character device"
	case unix.S_IFBLK:
		return "a block device"
	case unix.S_IFSOCK:
		return "a socket"
	case unix.S_IFDIR:
		return "a directory"
	case unix.S_IFLNK:
		return "a symbolic link"
	}
	return fmt.Sprintf("of type %#o", mode&unix.S_IFMT)
}

// Load reads the index at path, as a stream: it holds the live pages, never the file.
//
// On success the State holds what the records say. On failure nothing is taken back,
// and the error says why (a fault of the file's own, without its path): one wrapping ErrNoIndex if there is no file; ErrNotRegular
// if something else than a regular file is at path (never opened for reading, so a
// named pipe never blocks); ErrOtherShape if the header is of another geometry or
// other devices than shape's; ErrCorrupt if a record does not check, the file holds
// more records or bytes than shape bounds (Shape.MaxRecords; refused before it is
// read where its size shows it), or the records make no sense (a device not listed,
// a page out of the slab, two pages under one hash). Where the header was read, the
// State returned with the error holds it (an owner starts past its epoch). A host
// page record of a page beyond shape's host tier is skipped: such a tier is of
// another size, and its pages are dropped with it.
func Load(path string, shape Shape) (*State, error) {
	f, size, err := openRegular(path)
	if err != nil {
		return nil, err
	}
	defer func() { _ = f.Close() }() // cleanup: read only
	if max := shape.maxBytes(); size > max {
		return nil, fmt.Errorf("%w: %d bytes, over the %d an index of %d pages on %d devices (and %d host pages each) may hold", ErrCorrupt, size, max, shape.Geometry.Pages, len(shape.Devices), shape.HostPages)
	}
	r := &reader{br: bufio.NewReaderSize(f, 64<<10)}
	return r.load(shape)
}

// reader reads records from a stream.
type reader struct {
	br  *bufio.Reader
	buf []byte
	n   int // records read
}

// next is the next record's payload, valid until the next call; io.EOF at the end.
func (r *reader) next(max int) ([]byte, error) {
	var l [4]byte
	if _, err := io.ReadFull(r.br, l[:]); err != nil {
		if errors.Is(err, io.EOF) {
			return nil, io.EOF
		}
		return nil, fmt.Errorf("%w: truncated where record %d's length is", ErrCorrupt, r.n)
	}
	n := binary.LittleEndian.Uint32(l[:])
	if uint64(n) > uint64(max) {
		return nil, fmt.Errorf("%w: record %d is of %d bytes, at most %d", ErrCorrupt, r.n, n, max)
	}
	if cap(r.buf) < int(n)+4 {
		r.buf = make([]byte, int(n)+4)
	}
	b := r.buf[:n+4]
	if _, err := io.ReadFull(r.br, b); err != nil {
		return nil, fmt.Errorf("%w: truncated: record %d of %d bytes", ErrCorrupt, r.n, n)
	}
	p := b[:n]
	if binary.LittleEndian.Uint32(b[n:]) != crc32.Checksum(p, castagnoli) {
		return nil, fmt.Errorf("%w: record %d's checksum is wrong", ErrCorrupt, r.n)
	}
	r.n++
	return p, nil
}

// live is a page a record made visible, as of the seq'th record.
type live struct {
	hash kv.Hash
	seq  int
}

func (r *reader) load(shape Shape) (*State, error) {
	hp, err := r.next(maxPayload)
	if errors.Is(err, io.EOF) {
		return nil, fmt.Errorf("%w: empty: the header is missing", ErrCorrupt)
	}
	if err != nil {
		return nil, fmt.Errorf("the header: %w", err)
	}
	hdr, err := parseHeader(hp)
	if err != nil {
		return nil, err
	}
	st := &State{Header: hdr}
	switch {
	case hdr.Geometry != shape.Geometry:
		return st, fmt.Errorf("%w: the index is of %v, not %v", ErrOtherShape, hdr.Geometry, shape.Geometry)
	case !slices.Equal(hdr.Devices, shape.Devices):
		return st, fmt.Errorf("%w: the index is of devices %v, not %v", ErrOtherShape, hdr.Devices, shape.Devices)
	}
	l := newLoader(shape, hdr.Devices)
	maxRecords := shape.MaxRecords()
	for {
		p, err := r.next(pagePayload)
		if errors.Is(err, io.EOF) {
			break
		}
		if err != nil {
			return st, err
		}
		seq := r.n - 1
		if r.n > maxRecords {
			return st, fmt.Errorf("%w: over %d records, the most an index of %d pages on %d devices (and %d host pages each) holds", ErrCorrupt, maxRecords, shape.Geometry.Pages, len(shape.Devices), shape.HostPages)
		}
		if len(p) == 0 {
			return st, fmt.Errorf("%w: record %d is empty", ErrCorrupt, seq)
		}
		if err := l.record(seq, Kind(p[0]), p[1:]); err != nil {
			return st, fmt.Errorf("%w: record %d: %s", ErrCorrupt, seq, err)
		}
	}
	return st, l.finish(st)
}

// loader is what the records read so far say: each device's live pages of both
// tiers, the replicas attached and the grants not ended.
type loader struct {
	shape       Shape
	devices     []int
	pages, host map[int]map[uint32]live
	attached    map[Proc]int
	grants      map[uint64]*Grant
}

func newLoader(shape Shape, devices []int) *loader {
	l := &loader{shape: shape, devices: devices, pages: map[int]map[uint32]live{}, host: map[int]map[uint32]live{},
		attached: map[Proc]int{}, grants: map[uint64]*Grant{}}
	for _, d := range devices {
		l.pages[d], l.host[d] = map[uint32]live{}, map[uint32]live{}
	}
	return l
}

// record applies the seq'th record, of kind k and payload p (after its kind); an
// error says what is wrong with it (the caller names the record and ErrCorrupt).
func (l *loader) record(seq int, k Kind, p []byte) error {
	switch k {
	case Seal, Free, HostSeal, HostFree:
		return l.page(seq, k, p)
	case Attach, Detach:
		if len(p) != procPayload-1 {
			return fmt.Errorf("%d bytes for a replica record", len(p))
		}
		id := Proc{PID: binary.LittleEndian.Uint32(p), Start: binary.LittleEndian.Uint64(p[4:])}
		if k == Attach {
			l.attached[id]++
		} else if l.attached[id]--; l.attached[id] <= 0 {
			delete(l.attached, id)
		}
	case Lease, ReadLease:
		if len(p) != grantPayload-1 {
			return fmt.Errorf("%d bytes for a grant record", len(p))
		}
		g := &Grant{Lease: binary.LittleEndian.Uint64(p), Dev: int(binary.LittleEndian.Uint32(p[8:])),
			Holder: Proc{PID: binary.LittleEndian.Uint32(p[12:]), Start: binary.LittleEndian.Uint64(p[16:])}, Read: k == ReadLease}
		if _, ok := l.pages[g.Dev]; !ok {
			return fmt.Errorf("device %d is not one of %v", g.Dev, l.devices)
		}
		l.grants[g.Lease] = g
	case LeasePage, LeaseHash:
		return l.grantPart(k, p)
	case LeaseEnd:
		if len(p) != leasePayload-1 {
			return fmt.Errorf("%d bytes for an end record", len(p))
		}
		delete(l.grants, binary.LittleEndian.Uint64(p))
	default:
		return fmt.Errorf("unknown type %d", k)
	}
	return nil
}

// page applies a page record (Seal, Free, HostSeal, HostFree).
func (l *loader) page(seq int, k Kind, p []byte) error {
	want := 8
	if k == Seal || k == HostSeal {
		want += len(kv.Hash{})
	}
	if len(p) != want {
		return fmt.Errorf("%d bytes for a page record", len(p))
	}
	dev, pg := int(binary.LittleEndian.Uint32(p)), binary.LittleEndian.Uint32(p[4:])
	onHost := k == HostSeal || k == HostFree
	of, bound := l.pages, l.shape.Geometry.Pages
	if onHost {
		of, bound = l.host, l.shape.HostPages
	}
	m, ok := of[dev]
	switch {
	case !ok:
		return fmt.Errorf("device %d is not one of %v", dev, l.devices)
	case int64(pg) >= int64(bound) && onHost:
		return nil // a tier of another size: dropped with its pages
	case int64(pg) >= int64(bound):
		return fmt.Errorf("page %d of %d", pg, bound)
	}
	if k == Free || k == HostFree {
		delete(m, pg)
		return nil
	}
	m[pg] = live{hash: kv.Hash(p[8:]), seq: seq}
	return nil
}

// grantPart applies a record of a grant's page (LeasePage) or of a read lease's
// hash (LeaseHash).
func (l *loader) grantPart(k Kind, p []byte) error {
	want := leasePayload - 1 + 4
	if k == LeaseHash {
		want = leasePayload - 1 + len(kv.Hash{})
	}
	if len(p) != want {
		if k == LeaseHash {
			return fmt.Errorf("%d bytes for a read lease's hash record", len(p))
		}
		return fmt.Errorf("%d bytes for a grant's page record", len(p))
	}
	id := binary.LittleEndian.Uint64(p)
	g := l.grants[id]
	if k == LeaseHash {
		if g == nil || !g.Read || len(g.Hashes) != len(g.Pages)-1 {
			return fmt.Errorf("a hash of lease %d, which no read lease's page before names", id)
		}
		g.Hashes = append(g.Hashes, kv.Hash(p[8:]))
		return nil
	}
	pg := binary.LittleEndian.Uint32(p[8:])
	switch {
	case g == nil:
		return fmt.Errorf("a page of lease %d, which no grant before names", id)
	case int64(pg) >= int64(l.shape.Geometry.Pages):
		return fmt.Errorf("page %d of %d", pg, l.shape.Geometry.Pages)
	case g.Read && len(g.Hashes) != len(g.Pages):
		return fmt.Errorf("a page of read lease %d before the hash of its last", id)
	}
	g.Pages = append(g.Pages, pg)
	return nil
}

// finish fills st with what the records said: the grants answered, each tier's live
// pages least recent first, the replicas attached.
func (l *loader) finish(st *State) error {
	for _, g := range l.grants {
		if len(g.Pages) > 0 && (!g.Read || len(g.Hashes) == len(g.Pages)) { // a grant cut short by a crash was never answered
			st.Grants = append(st.Grants, *g)
		}
	}
	slices.SortFunc(st.Grants, func(a, b Grant) int { return cmp.Compare(a.Lease, b.Lease) })
	sealed, err := ordered(l.pages, "pages %d and %d are visible")
	if err != nil {
		return err
	}
	hosted, err := ordered(l.host, "host pages %d and %d are sealed")
	if err != nil {
		return err
	}
	st.Sealed, st.Host = sealed, hosted
	for id, n := range l.attached {
		for range n {
			st.Attached = append(st.Attached, id)
		}
	}
	slices.SortFunc(st.Attached, func(a, b Proc) int { return int(a.PID) - int(b.PID) })
	return nil
}

// ordered lists each device's live pages least recent first, refusing two under one
// hash (what says which).
func ordered(of map[int]map[uint32]live, what string) (map[int][]Page, error) {
	out := map[int][]Page{}
	for dev, m := range of {
		seen := make(map[kv.Hash]uint32, len(m))
		type rec struct {
			Page
			seq int
		}
		all := make([]rec, 0, len(m))
		for pg, l := range m {
			if other, dup := seen[l.hash]; dup {
				return nil, fmt.Errorf("%w: device %d: "+what+" under one hash", ErrCorrupt, dev, other, pg)
			}
			seen[l.hash] = pg
			all = append(all, rec{Page{pg, l.hash}, l.seq})
		}
		slices.SortFunc(all, func(a, b rec) int { return a.seq - b.seq })
		for _, r := range all {
			out[dev] = append(out[dev], r.Page)
		}
	}
	return out, nil
}
