package cudarttest

import (
	"crypto/rand"
	"errors"
	"fmt"
	"os"
	"runtime"
	"strings"
	"sync/atomic"
	"unsafe"

	"golang.org/x/sys/unix"
)

// region is a mapped memfd shared between Devices, possibly in different processes.
// Fields that another Device reads are 64-bit words accessed only with sync/atomic;
// the layouts (pool header, event arena) are fixed per version below.
type region struct {
	mem []byte
	fd  int // kept open by the owner so the region can be re-exported; -1 otherwise
}

// newRegion creates a memfd of size bytes (sparse: only touched pages cost memory)
// and maps it. On failure nothing is left open.
func newRegion(name string, size uint64) (*region, error) {
	fd, err := memfdCreate(name)
	if err != nil {
		return nil, err
	}
	if err := unix.Ftruncate(fd, int64(size)); err != nil {
		_ = unix.Close(fd) // cleanup: the descriptor is ours and unused
		return nil, fmt.Errorf("ftruncate memfd to %d: %w", size, err)
	}
	mem, err := unix.Mmap(fd, 0, int(size), unix.PROT_READ|unix.PROT_WRITE, unix.MAP_SHARED)
	if err != nil {
		_ = unix.Close(fd) // cleanup: the descriptor is ours and unused
		return nil, fmt.Errorf("mmap memfd of %d bytes: %w", size, err)
	}
	return &region{mem: mem, fd: fd}, nil
}

// mapRegion maps all of the file open as fd, which must be a memfd created by this
// package under name and at least minSize bytes long. The caller keeps fd.
func mapRegion(fd int, name string, minSize uint64) (*region, error) {
	if fd < 0 {
		return nil, errors.New("negative file descriptor")
	}
	if link, err := os.Readlink(fmt.Sprintf("/proc/self/fd/%d", fd)); err != nil || !isOurMemfd(link, name) {
		return nil, fmt.Errorf("descriptor %d is not a %s memfd (%q, %v)", fd, name, link, err)
	}
	var st unix.Stat_t
	if err := unix.Fstat(fd, &st); err != nil {
		return nil, fmt.Errorf("fstat: %w", err)
	}
	if st.Size < int64(minSize) || st.Size > 1<<50 {
		return nil, fmt.Errorf("memfd of %d bytes, need at least %d", st.Size, minSize)
	}
	mem, err := unix.Mmap(fd, 0, int(st.Size), unix.PROT_READ|unix.PROT_WRITE, unix.MAP_SHARED)
	if err != nil {
		return nil, fmt.Errorf("mmap: %w", err)
	}
	return &region{mem: mem, fd: -1}, nil
}

func isOurMemfd(link, name string) bool {
	return strings.HasPrefix(link, "/memfd:"+name+" ") || link == "/memfd:"+name
}

// openProcFD opens another process's (or this one's) descriptor through /proc, the way
// a FABRIC handle or an IPC event handle names shared memory, after checking that it
// is one of this package's memfds: a stale or forged handle must not open, say, a
// terminal. The caller closes the result.
func openProcFD(pid, fd int, name string) (int, error) {
	path := fmt.Sprintf("/proc/%d/fd/%d", pid, fd)
	link, err := os.Readlink(path)
	if err != nil {
		return -1, err
	}
	if !isOurMemfd(link, name) {
		return -1, fmt.Errorf("%s is %q, not a %s memfd", path, link, name)
	}
	nfd, err := unix.Open(path, unix.O_RDWR|unix.O_CLOEXEC, 0)
	if err != nil {
		return -1, fmt.Errorf("open %s: %w", path, err)
	}
	return nfd, nil
}

// mapProcRegion maps the memfd that process pid holds open as fd, if its header
// carries want at uidOff: a handle naming a descriptor since closed and reused must
// not map someone else's memory.
func mapProcRegion(pid, fd int, name string, minSize, uidOff uint64, want uid) (*region, error) {
	nfd, err := openProcFD(pid, fd, name)
	if err != nil {
		return nil, err
	}
	defer func() { _ = unix.Close(nfd) }() // cleanup: the descriptor is ours and unused
	reg, err := mapRegion(nfd, name, minSize)
	if err != nil {
		return nil, err
	}
	if reg.loadUID(uidOff) != want {
		reg.release()
		return nil, errors.New("the handle names a descriptor that now holds something else")
	}
	return reg, nil
}

// release unmaps the region and closes its descriptor, if kept.
func (r *region) release() {
	if r.mem != nil {
		_ = unix.Munmap(r.mem) // cleanup: nothing is left to use the mapping
		r.mem = nil
	}
	if r.fd >= 0 {
		_ = unix.Close(r.fd) // cleanup: the descriptor is ours and unused
		r.fd = -1
	}
}

func (r *region) word(off uint64) *uint64 { return (*uint64)(unsafe.Pointer(&r.mem[off])) }

func (r *region) load(off uint64) uint64     { return atomic.LoadUint64(r.word(off)) }
func (r *region) store(off uint64, v uint64) { atomic.StoreUint64(r.word(off), v) }
func (r *region) cas(off uint64, old, v uint64) bool {
	return atomic.CompareAndSwapUint64(r.word(off), old, v)
}

// storeMax raises the word at off to v unless it is already higher.
func (r *region) storeMax(off uint64, v uint64) {
	for {
		cur := r.load(off)
		if cur >= v || r.cas(off, cur, v) {
			return
		}
	}
}

// uid is a random 128-bit identity of a pool or event arena: handles carry it, and a
// mapping is only trusted when its header carries the same one.
type uid [2]uint64

func newUID() uid {
	var b [16]byte
	if _, err := rand.Read(b[:]); err != nil {
		panic("cudarttest: crypto/rand: " + err.Error()) // rand.Read does not fail on Linux
	}
	return uid{le64(b[0:8]), le64(b[8:16])}
}

func (r *region) loadUID(off uint64) uid     { return uid{r.load(off), r.load(off + 8)} }
func (r *region) storeUID(off uint64, u uid) { r.store(off, u[0]); r.store(off+8, u[1]) }

func le64(b []byte) uint64 {
	return uint64(b[0]) | uint64(b[1])<<8 | uint64(b[2])<<16 | uint64(b[3])<<24 |
		uint64(b[4])<<32 | uint64(b[5])<<40 | uint64(b[6])<<48 | uint64(b[7])<<56
}

func put64(b []byte, v uint64) {
	for i := range 8 {
		b[i] = byte(v >> (8 * i))
	}
}

// checksum is FNV-1a over b: it tells junk handle bytes from ours.
func checksum(b []byte) uint64 {
	h := uint64(14695981039346656037)
	for _, c := range b {
		h ^= uint64(c)
		h *= 1099511628211
	}
	return h
}

func roundUp(n, m uint64) uint64 { return (n + m - 1) / m * m }

// The pool memfd: [header][entry table][data area]. The exporting Device alone
// allocates; importers read entries to validate records and register themselves.
const (
	poolMemfdName = "cudarttest-pool"
	poolMagic     = 0x335f4c4f4f504443 // "CDPOOL_3"

	hMagic        = 0   // poolMagic
	hUID          = 8   // 2 words
	hBase         = 24  // device address of data offset 0
	hSize         = 32  // bytes in the data area
	hGranularity  = 40  //
	hReserved     = 48  // current reserved bytes
	hReservedHigh = 56  //
	hUsed         = 64  // bytes in live allocations
	hUsedHigh     = 72  //
	hExporter     = 80  // ident of the exporting Device
	hExporterGone = 88  // 1 once the exporting Device closed
	hDevice       = 96  // resident device ordinal
	hHandleTypes  = 104 // cudart.HandleType bits
	hEntries      = 112 // entries in the table (maxEntries)
	headerBytes   = 128

	maxEntries   = 8192
	maxImporters = 32

	// An entry: one allocation slot. eState is gen<<2 | state; offset and size are
	// written before it, so a reader that sees the same eState before and after
	// reading them has a consistent triple. Its marks (marks) say who last wrote
	// (or allocated) and read which bytes of the memory, on which stream and when the
	// work ran.
	eState     = 0
	eOffset    = 8
	eSize      = 16
	eReleased  = 48  // epoch of the latest importer's free of this generation
	eMarksLock = 56  // ident of the Device reading or updating the marks, 0 if none
	eSlots     = 160 // maxImporters × (ident, gen): importers holding this allocation
	slotBytes  = 16
	entryBytes = eSlots + maxImporters*slotBytes

	// The marks of each entry (marks) follow the entry table.
	poolDataOffset = (headerBytes + maxEntries*entryBytes + maxEntries*maxMarks*markBytes + 4095) / 4096 * 4096
)

const (
	stateUnused = 0
	stateLive   = 1
	stateFreed  = 2
)

func entryOff(i uint32) uint64           { return headerBytes + uint64(i)*entryBytes }
func slotOff(i uint32, s int) uint64     { return entryOff(i) + eSlots + uint64(s)*slotBytes }
func packState(gen, state uint64) uint64 { return gen<<2 | state }

// marks are the access marks of one allocation's entry, shared by every Device that
// maps the pool, in this process and others; me is the Device using them. A mark says
// which stream of which Device last wrote (or allocated) or read a byte range of the
// allocation, and when that work ran: accesses to different ranges of one allocation
// (two replicas' pages of one slab) are not ordered against each other. An entry holds
// maxMarks of them; a write replaces the marks of the bytes it covers (they were
// checked to be ordered before it), a read those of its own stream's earlier reads,
// and where the table is full the oldest mark is forgotten. A mark is six words that
// each Device updates under its own lock only, so every reading and update of them
// holds the entry's marks lock: a mark read half updated (one Device's ident with the
// stream and epoch of another Device's later read) misnames an access and makes a
// violation of an ordered one.
type marks struct {
	r  *region
	eo uint64 // the entry's offset, for its lock
	mo uint64 // the entry's marks
	me ident
}

func (p *pool) marks(entry uint32, me ident) marks {
	return marks{p.reg, entryOff(entry), marksOff(entry), me}
}

// The range marks: maxMarks per entry of (ident, stream, epoch, lo, hi, write), in the
// area after the entry table; ident 0 is an empty slot. lo and hi are offsets in the
// pool's data area.
const (
	maxMarks  = 32
	markBytes = 48

	mIdent, mStream, mEpoch, mLo, mHi, mWrite = 0, 8, 16, 24, 32, 40
)

func marksOff(entry uint32) uint64 {
	return headerBytes + maxEntries*entryBytes + uint64(entry)*maxMarks*markBytes
}

// locked runs f with the marks lock held. It is held for a few loads and stores,
// never across a wait, so it is spun on; a holder whose process died holding it (a
// child killed mid-update) is taken over.
func (m marks) locked(f func()) {
	off := m.eo + eMarksLock
	for spins := 1; !m.r.cas(off, 0, uint64(m.me)); spins++ {
		if spins%1024 == 0 {
			if h := m.r.load(off); h != 0 && !ident(h).alive() && m.r.cas(off, h, uint64(m.me)) {
				break
			}
		}
		runtime.Gosched()
	}
	defer m.r.store(off, 0)
	f()
}

// An accessor is a stream of a Device and when its access ran.
type accessor struct {
	id     ident
	stream uint64
	epoch  uint64
}

func (a accessor) is(id ident, st *stream) bool { return a.id == id && a.stream == st.id }

func (a accessor) String() string { return fmt.Sprintf("stream %#x of %v", a.stream, a.id) }

// A mark is an accessor's write or read of the bytes [lo, hi).
type mark struct {
	accessor
	lo, hi uint64
	write  bool
}

func (m marks) at(i uint64) uint64 { return m.mo + i*markBytes }

func (m marks) load(i uint64) mark {
	o := m.at(i)
	return mark{accessor{ident(m.r.load(o + mIdent)), m.r.load(o + mStream), m.r.load(o + mEpoch)},
		m.r.load(o + mLo), m.r.load(o + mHi), m.r.load(o+mWrite) != 0}
}

func (m marks) put(i uint64, k mark) {
	o := m.at(i)
	w := uint64(0)
	if k.write {
		w = 1
	}
	m.r.store(o+mStream, k.stream)
	m.r.store(o+mEpoch, k.epoch)
	m.r.store(o+mLo, k.lo)
	m.r.store(o+mHi, k.hi)
	m.r.store(o+mWrite, w)
	m.r.store(o+mIdent, uint64(k.id))
}

func (m marks) clear(i uint64) { m.r.store(m.at(i)+mIdent, 0) }

// overlapping lists the marks of bytes in [lo, hi); all of them for lo 0, hi ^0.
func (m marks) overlapping(lo, hi uint64) (ks []mark) {
	m.locked(func() {
		for i := range uint64(maxMarks) {
			if k := m.load(i); k.id != 0 && k.lo < hi && lo < k.hi {
				ks = append(ks, k)
			}
		}
	})
	return ks
}

// slot is an empty slot, else the one of the oldest mark (forgotten). The lock is held.
func (m marks) slot() uint64 {
	at, oldest := uint64(0), ^uint64(0)
	for i := range uint64(maxMarks) {
		k := m.load(i)
		if k.id == 0 {
			return i
		}
		if k.epoch < oldest {
			at, oldest = i, k.epoch
		}
	}
	return at
}

// cut takes [lo, hi) out of the marks that replaced says it replaces, splitting one
// that covers both sides. The lock is held.
func (m marks) cut(lo, hi uint64, replaced func(mark) bool) {
	for i := range uint64(maxMarks) {
		k := m.load(i)
		if k.id == 0 || k.hi <= lo || hi <= k.lo || !replaced(k) {
			continue
		}
		switch {
		case lo <= k.lo && k.hi <= hi:
			m.clear(i)
		case k.lo < lo && hi < k.hi:
			j := m.slot()
			if j == i { // the table is full and k is the oldest: forget it
				m.clear(i)
				continue
			}
			right := k
			right.lo = hi
			k.hi = lo
			m.put(i, k)
			m.put(j, right)
		case k.lo < lo:
			k.hi = lo
			m.put(i, k)
		default:
			k.lo = hi
			m.put(i, k)
		}
	}
}

// wrote marks a write (or allocation) of [lo, hi) by stream st of Device m.me at epoch
// t; the marks of those bytes before it are forgotten, as they were checked to be
// ordered before it.
func (m marks) wrote(st *stream, t, lo, hi uint64) {
	m.locked(func() {
		m.cut(lo, hi, func(mark) bool { return true })
		m.put(m.slot(), mark{accessor{m.me, st.id, t}, lo, hi, true})
	})
}

// read marks a read of [lo, hi) by stream st of Device m.me at epoch t: it replaces the
// marks of that stream's earlier reads of those bytes (what is ordered after it is
// ordered after them).
func (m marks) read(st *stream, t, lo, hi uint64) {
	m.locked(func() {
		m.cut(lo, hi, func(k mark) bool { return !k.write && k.id == m.me && k.stream == st.id })
		m.put(m.slot(), mark{accessor{m.me, st.id, t}, lo, hi, false})
	})
}

// reset forgets every mark and marks the allocation [lo, hi) as written by st at t.
func (m marks) reset(st *stream, t, lo, hi uint64) {
	m.locked(func() {
		for i := range uint64(maxMarks) {
			m.clear(i)
		}
		m.put(0, mark{accessor{m.me, st.id, t}, lo, hi, true})
	})
}

// ran marks the allocation whose mark is at pendingEpoch as written at t, when it
// runs: as a write, it replaces the marks of the accesses before it.
func (m marks) ran(t uint64) {
	m.locked(func() {
		for i := range uint64(maxMarks) {
			if k := m.load(i); k.id != 0 && k.epoch == pendingEpoch {
				m.cut(k.lo, k.hi, func(mark) bool { return true })
				k.epoch = t
				m.put(m.slot(), k)
				return
			}
		}
	})
}
