package cudarttest

import (
	"errors"
	"fmt"
	"math/bits"
	"slices"
	"sync/atomic"
	"unsafe"

	"golang.org/x/sys/unix"

	"github.com/cudapool/cudapool/cudart"
)

// The VMM route (cudart.VMM) on the software device. A chunk is a memfd: its
// descriptor is the POSIX shareable handle, so passing it over a Unix socket to
// another process works as on the GPU, and the descriptor alone keeps the memory
// alive (FACTS 26). A reservation is addresses of this process reserved with an
// inaccessible anonymous mmap, so a device address of the route is its host address,
// as with registered host memory; a mapping is an mmap of the chunk's memfd at those
// addresses, so every process that maps a chunk reads and writes the same bytes.
//
// Behind its data, a chunk's memfd holds one page of access marks (shm.go's marks,
// in the chunk's own offsets), so that accesses to one chunk from the streams of
// every Device that maps it, in this process and others, are checked for order as
// pool memory's are.
//
// As the driver documents: a chunk's size, and every mapping's offset, size and
// address, are multiples of the granularity; a new mapping is inaccessible until
// MemSetAccess grants a device; MemUnmap takes exactly what one MemMap mapped, and
// the addresses stay reserved; MemRelease of a mapped chunk is allowed, and its
// memory lives while a mapping or a descriptor remains. An imported handle cannot be
// exported again (FACTS 25). FABRIC chunks are refused with cudart.ErrNotPermitted
// unless WithFabric, as on a host without an IMEX channel.
//
// Rules the driver leaves undefined are Violations: use of a released handle, access
// to unmapped memory that was mapped (ViolationUseAfterRelease), an access a mapping
// does not grant (ViolationAccessDenied), and unmapping memory that queued work still
// touches (ViolationUseAfterRelease, the mapping stays).

const (
	vmmMemfdName = "cudarttest-vmm"
	// vmmTail is the page of marks behind a chunk's data: the marks lock at
	// vmmLockOff (as marks.locked finds it, eMarksLock past offset 0), the marks at
	// vmmMarksOff.
	vmmTail     = 4096
	vmmLockOff  = 0
	vmmMarksOff = 64
	vmmFabric   = 0x4d4d56544455430a // the first word of a software FABRIC handle
)

// One page holds the lock and every mark.
var _ = [1]struct{}{}[(vmmMarksOff+maxMarks*markBytes)/(vmmTail+1)]
var _ = [1]struct{}{}[(eMarksLock+8)/(vmmMarksOff+1)]

// vmmChunk is a chunk as this Device holds it: through a live handle (fd open), and
// through mappings. Guarded by d.mu.
type vmmChunk struct {
	handle   cudart.MemHandle
	fd       int // the handle's descriptor of the memfd; -1 once released
	size     uint64
	dev      int
	ht       cudart.HandleType
	imported bool
	ino      uint64  // the memfd's inode: what a FABRIC handle names
	tail     *region // the marks page
	maps     int     // this Device's mappings of it
}

func (c *vmmChunk) marks(me ident) marks {
	return marks{r: c.tail, eo: vmmLockOff, mo: vmmMarksOff, me: me}
}

// vmmReservation is addresses MemAddressReserve reserved, with its mappings sorted by
// address. mem covers it all; only mapped parts may be touched. Guarded by d.mu.
type vmmReservation struct {
	base, size uint64
	mem        []byte
	maps       []*vmmMap
	unmapped   []vmmMap // what was mapped once and unmapped since, to name a use after it
}

func (r *vmmReservation) bounds() (uint64, uint64) { return r.base, r.size }

// vmmMap is one MemMap: size bytes of c from off, at base. Guarded by d.mu.
type vmmMap struct {
	base, size uint64
	c          *vmmChunk
	off        uint64
	access     []cudart.AccessFlags // by device
	pending    int                  // queued ops that touch it
	gone       bool                 // unmapped
}

func (m *vmmMap) bounds() (uint64, uint64) { return m.base, m.size }

// A vmmPiece is the part of an access that lies in one mapping: the chunk's offsets
// [lo, hi).
type vmmPiece struct {
	m      *vmmMap
	lo, hi uint64
}

// vmmState is a Device's VMM route.
type vmmState struct {
	chunks   map[cudart.MemHandle]*vmmChunk // live handles
	released map[cudart.MemHandle]bool      // handles released, to name a use after it
	ranges   []*vmmReservation              // sorted by base
}

var _ cudart.VMM = (*Device)(nil)

// enterVMM is enter for a VMM call, making the route's tables on first use. d.mu is
// held.
func (d *Device) enterVMM(op string, dev int) error {
	if err := d.enter(op, dev); err != nil {
		return err
	}
	if d.vmm.chunks == nil {
		d.vmm.chunks, d.vmm.released = map[cudart.MemHandle]*vmmChunk{}, map[cudart.MemHandle]bool{}
	}
	return nil
}

// aligned is ErrInvalidValue unless every value is a multiple of the granularity.
func (d *Device) aligned(op string, what string, vs ...uint64) error {
	for _, v := range vs {
		if v%d.cfg.granularity != 0 {
			return invalid(op, fmt.Sprintf("%s %d is not a multiple of the granularity (%d)", what, v, d.cfg.granularity))
		}
	}
	return nil
}

// MemCreate makes a memfd of size bytes (sparse) and its marks page.
func (d *Device) MemCreate(dev int, size uint64, ht cudart.HandleType) (cudart.MemHandle, error) {
	const op = "cuMemCreate"
	d.mu.Lock()
	defer d.mu.Unlock()
	if err := d.enterVMM(op, dev); err != nil {
		return 0, err
	}
	switch {
	case ht&^supportedHandles != 0:
		return 0, invalid(op, "unknown handle type "+ht.String())
	case size == 0:
		return 0, invalid(op, "size 0")
	case ht&cudart.HandleTypeFabric != 0 && !d.cfg.fabric:
		return 0, &detailError{cuda: cudart.NewError(op, cudart.ErrNotPermitted),
			detail: "FABRIC allocations need an IMEX channel, and this host has none (cudarttest.WithFabric gives one)"}
	}
	if err := d.aligned(op, "size", size); err != nil {
		return 0, err
	}
	if size > d.cfg.memory-d.devs[dev].reserved {
		return 0, fail(op, cudart.ErrOutOfMemory)
	}
	fd, err := memfdCreate(vmmMemfdName)
	if err != nil {
		return 0, &detailError{cuda: cudart.NewError(op, cudart.ErrOutOfMemory), detail: err.Error()}
	}
	c, err := newVMMChunk(fd, size)
	if err != nil {
		_ = unix.Close(fd) // cleanup: the descriptor is ours and unused
		return 0, &detailError{cuda: cudart.NewError(op, cudart.ErrOutOfMemory), detail: err.Error()}
	}
	c.dev, c.ht = dev, ht
	d.devs[dev].reserved += size
	d.vmm.chunks[c.handle] = c
	return c.handle, nil
}

// newVMMChunk sizes the memfd fd for size bytes and its marks page, and maps the
// page. It takes fd on success only.
func newVMMChunk(fd int, size uint64) (*vmmChunk, error) {
	if err := unix.Ftruncate(fd, int64(size+vmmTail)); err != nil {
		return nil, fmt.Errorf("ftruncate memfd to %d: %w", size+vmmTail, err)
	}
	return mapVMMChunk(fd, size)
}

// mapVMMChunk maps the marks page of the chunk memfd fd of size bytes. It takes fd on
// success only.
func mapVMMChunk(fd int, size uint64) (*vmmChunk, error) {
	var st unix.Stat_t
	if err := unix.Fstat(fd, &st); err != nil {
		return nil, fmt.Errorf("fstat: %w", err)
	}
	tail, err := unix.Mmap(fd, int64(size), vmmTail, unix.PROT_READ|unix.PROT_WRITE, unix.MAP_SHARED)
	if err != nil {
		return nil, fmt.Errorf("mmap the marks of a chunk of %d bytes: %w", size, err)
	}
	return &vmmChunk{handle: cudart.MemHandle(newHandle()), fd: fd, size: size, ino: st.Ino,
		tail: &region{mem: tail, fd: -1}}, nil
}

// chunk is the live chunk of handle h; a released one is a ViolationUseAfterRelease
// (the driver leaves it undefined). d.mu is held.
func (d *Device) chunk(op string, h cudart.MemHandle) (*vmmChunk, error) {
	if c := d.vmm.chunks[h]; c != nil {
		return c, nil
	}
	if d.vmm.released[h] {
		return nil, violationErr(op, cudart.ErrInvalidValue, d.violate(ViolationUseAfterRelease, op,
			"VMM handle %#x was released", uint64(h)))
	}
	return nil, invalid(op, fmt.Sprintf("%#x is no VMM handle of this process", uint64(h)))
}

// enterChunk is enterVMM, then chunk. d.mu is held.
func (d *Device) enterChunk(op string, dev int, h cudart.MemHandle) (*vmmChunk, error) {
	if err := d.enterVMM(op, dev); err != nil {
		return nil, err
	}
	return d.chunk(op, h)
}

// MemRelease closes the handle's descriptor; the memory lives while a mapping (or
// another process's descriptor) remains.
func (d *Device) MemRelease(dev int, h cudart.MemHandle) error {
	const op = "cuMemRelease"
	d.mu.Lock()
	defer d.mu.Unlock()
	c, err := d.enterChunk(op, dev, h)
	if err != nil {
		return err
	}
	delete(d.vmm.chunks, h)
	d.vmm.released[h] = true
	_ = unix.Close(c.fd) // cleanup: the handle's own descriptor, unused from now on
	c.fd = -1
	d.dropChunk(c)
	return nil
}

// dropChunk lets go of c once it has no handle and no mapping here. d.mu is held.
func (d *Device) dropChunk(c *vmmChunk) {
	if c.fd >= 0 || c.maps > 0 || c.tail == nil {
		return
	}
	if !c.imported {
		d.devs[c.dev].reserved -= c.size
	}
	c.tail.release()
	c.tail = nil
}

// MemExportToShareableHandle exports a POSIX fd as a new descriptor of the memfd; a
// FABRIC handle names the memfd by this process, the handle's descriptor and the
// memfd's inode.
func (d *Device) MemExportToShareableHandle(dev int, h cudart.MemHandle, ht cudart.HandleType) (cudart.ShareableHandle, error) {
	const op = "cuMemExportToShareableHandle"
	d.mu.Lock()
	defer d.mu.Unlock()
	c, err := d.enterChunk(op, dev, h)
	if err != nil {
		return cudart.ShareableHandle{}, err
	}
	switch {
	case ht != cudart.HandleTypePosixFD && ht != cudart.HandleTypeFabric:
		return cudart.ShareableHandle{}, invalid(op, "cannot export as handle type "+ht.String())
	case c.imported:
		return cudart.ShareableHandle{}, invalid(op, "the handle was imported, and an imported handle cannot be exported again (pass its descriptor on instead)")
	case c.ht&ht == 0:
		return cudart.ShareableHandle{}, invalid(op, fmt.Sprintf("the allocation was created shareable as %v, not %v", c.ht, ht))
	}
	if ht == cudart.HandleTypeFabric {
		sh := cudart.ShareableHandle{Type: ht, FD: -1}
		for i, v := range []uint64{vmmFabric, uint64(d.id.pid()), uint64(c.fd), c.ino} {
			put64(sh.Fabric[8*i:], v)
		}
		return sh, nil
	}
	fd, err := unix.FcntlInt(uintptr(c.fd), unix.F_DUPFD_CLOEXEC, 0)
	if err != nil {
		return cudart.ShareableHandle{}, &detailError{cuda: cudart.NewError(op, cudart.ErrOutOfMemory), detail: "dup: " + err.Error()}
	}
	return cudart.ShareableHandle{Type: ht, FD: fd}, nil
}

// MemImportFromShareableHandle takes a new descriptor of the memfd the handle names,
// after checking that it is one: a closed descriptor or one of anything else is
// refused with ErrInvalidValue.
func (d *Device) MemImportFromShareableHandle(dev int, sh cudart.ShareableHandle) (cudart.MemHandle, error) {
	const op = "cuMemImportFromShareableHandle"
	d.mu.Lock()
	defer d.mu.Unlock()
	if err := d.enterVMM(op, dev); err != nil {
		return 0, err
	}
	var fd int
	switch sh.Type {
	case cudart.HandleTypePosixFD:
		if sh.FD < 0 {
			return 0, invalid(op, fmt.Sprintf("%d is not a file descriptor", sh.FD))
		}
		link, err := fdLink(sh.FD)
		if err != nil {
			return 0, invalid(op, fmt.Sprintf("descriptor %d is not open: %v", sh.FD, err))
		}
		if !isOurMemfd(link, vmmMemfdName) {
			return 0, invalid(op, fmt.Sprintf("descriptor %d is %q, not a VMM allocation's", sh.FD, link))
		}
		if fd, err = unix.FcntlInt(uintptr(sh.FD), unix.F_DUPFD_CLOEXEC, 0); err != nil {
			return 0, &detailError{cuda: cudart.NewError(op, cudart.ErrOutOfMemory), detail: "dup: " + err.Error()}
		}
	case cudart.HandleTypeFabric:
		if !d.cfg.fabric {
			return 0, &detailError{cuda: cudart.NewError(op, cudart.ErrNotPermitted),
				detail: "FABRIC handles need an IMEX channel, and this host has none"}
		}
		var err error
		if fd, err = openFabric(sh.Fabric); err != nil {
			return 0, invalid(op, "the FABRIC handle names no live allocation: "+err.Error())
		}
	default:
		return 0, invalid(op, "cannot import from handle type "+sh.Type.String())
	}
	var st unix.Stat_t
	err := unix.Fstat(fd, &st)
	size := uint64(st.Size) - vmmTail
	if err == nil && (st.Size <= vmmTail || size%d.cfg.granularity != 0) {
		err = fmt.Errorf("a memfd of %d bytes is no chunk of granularity %d", st.Size, d.cfg.granularity)
	}
	var c *vmmChunk
	if err == nil {
		c, err = mapVMMChunk(fd, size)
	}
	if err != nil {
		_ = unix.Close(fd) // cleanup: the descriptor is ours and unused
		return 0, invalid(op, err.Error())
	}
	c.dev, c.ht, c.imported = dev, sh.Type, true
	d.vmm.chunks[c.handle] = c
	return c.handle, nil
}

// fdLink is what /proc says descriptor fd of this process is.
func fdLink(fd int) (string, error) {
	var buf [256]byte
	n, err := unix.Readlink(fmt.Sprintf("/proc/self/fd/%d", fd), buf[:])
	if err != nil {
		return "", err
	}
	return string(buf[:n]), nil
}

// openFabric opens the memfd a software FABRIC handle names, checking its inode: a
// descriptor since closed and reused must not open someone else's memory.
func openFabric(h cudart.FabricHandle) (int, error) {
	if le64(h[0:]) != vmmFabric {
		return -1, errors.New("not a software device's VMM FABRIC handle")
	}
	pid, fd, ino := le64(h[8:]), le64(h[16:]), le64(h[24:])
	if pid > 1<<31 || fd > 1<<31 {
		return -1, errors.New("a malformed handle")
	}
	nfd, err := openProcFD(int(pid), int(fd), vmmMemfdName)
	if err != nil {
		return -1, err
	}
	var st unix.Stat_t
	if err := unix.Fstat(nfd, &st); err != nil || st.Ino != ino {
		_ = unix.Close(nfd) // cleanup: the descriptor is ours and unused
		return -1, errors.New("the descriptor it names now holds another allocation")
	}
	return nfd, nil
}

// MemAddressReserve reserves addresses with an inaccessible anonymous mapping,
// aligned as asked.
func (d *Device) MemAddressReserve(dev int, size, alignment uint64) (cudart.DevicePtr, error) {
	const op = "cuMemAddressReserve"
	d.mu.Lock()
	defer d.mu.Unlock()
	if err := d.enterVMM(op, dev); err != nil {
		return 0, err
	}
	if alignment == 0 {
		alignment = d.cfg.granularity
	}
	switch {
	case size == 0:
		return 0, invalid(op, "size 0")
	case bits.OnesCount64(alignment) != 1 || alignment < d.cfg.granularity:
		return 0, invalid(op, fmt.Sprintf("alignment %d is not a power of two of at least the granularity (%d)", alignment, d.cfg.granularity))
	case size > 1<<46:
		return 0, fail(op, cudart.ErrOutOfMemory)
	}
	if err := d.aligned(op, "size", size); err != nil {
		return 0, err
	}
	const reserveFlags = unix.MAP_PRIVATE | unix.MAP_ANONYMOUS | unix.MAP_NORESERVE
	p, err := unix.MmapPtr(-1, 0, nil, uintptr(size+alignment), unix.PROT_NONE, reserveFlags)
	if err != nil {
		return 0, &detailError{cuda: cudart.NewError(op, cudart.ErrOutOfMemory), detail: "mmap: " + err.Error()}
	}
	all := unsafe.Slice((*byte)(p), size+alignment)
	lead := (alignment - uint64(uintptr(p))%alignment) % alignment
	// Give back what lies outside the aligned part: the lead, and the tail.
	if lead > 0 {
		_ = unix.MunmapPtr(p, uintptr(lead)) // cleanup: addresses nothing uses
	}
	if tail := alignment - lead; tail > 0 {
		_ = unix.MunmapPtr(unsafe.Pointer(&all[lead+size]), uintptr(tail)) // cleanup: as above
	}
	r := &vmmReservation{mem: all[lead : lead+size : lead+size], size: size}
	r.base = addrOf(r.mem)
	d.vmm.ranges = insertSorted(d.vmm.ranges, r)
	return cudart.DevicePtr(r.base), nil
}

// reservation is the reservation starting at ptr (exact) or holding [ptr, ptr+n).
// d.mu is held.
func (d *Device) reservation(ptr cudart.DevicePtr, n uint64) *vmmReservation {
	if i := covering(d.vmm.ranges, uint64(ptr), max(n, 1)); i >= 0 {
		return d.vmm.ranges[i]
	}
	return nil
}

// MemAddressFree gives the addresses back; what is still mapped there must be
// unmapped first (ErrInvalidValue).
func (d *Device) MemAddressFree(dev int, ptr cudart.DevicePtr, size uint64) error {
	const op = "cuMemAddressFree"
	d.mu.Lock()
	defer d.mu.Unlock()
	if err := d.enterVMM(op, dev); err != nil {
		return err
	}
	r := d.reservation(ptr, size)
	switch {
	case r == nil || r.base != uint64(ptr) || r.size != size:
		return invalid(op, fmt.Sprintf("%#x+%d is not what one cuMemAddressReserve reserved", uint64(ptr), size))
	case len(r.maps) > 0:
		return invalid(op, fmt.Sprintf("%d mappings are still in %#x+%d: unmap them first", len(r.maps), uint64(ptr), size))
	}
	_ = unix.MunmapPtr(unsafe.Pointer(unsafe.SliceData(r.mem)), uintptr(r.size)) // cleanup: nothing is mapped there
	r.mem = nil
	d.vmm.ranges = slices.DeleteFunc(d.vmm.ranges, func(x *vmmReservation) bool { return x == r })
	return nil
}

// MemMap maps the chunk's memfd over the reserved addresses, inaccessible to every
// device until MemSetAccess.
func (d *Device) MemMap(dev int, ptr cudart.DevicePtr, size, offset uint64, h cudart.MemHandle) error {
	const op = "cuMemMap"
	d.mu.Lock()
	defer d.mu.Unlock()
	c, err := d.enterChunk(op, dev, h)
	if err != nil {
		return err
	}
	r := d.reservation(ptr, size)
	switch {
	case size == 0:
		return invalid(op, "size 0")
	case r == nil:
		return invalid(op, fmt.Sprintf("%#x+%d does not lie in one reservation", uint64(ptr), size))
	case offset > c.size || size > c.size-offset:
		return invalid(op, fmt.Sprintf("%d bytes from offset %d run past the end of an allocation of %d", size, offset, c.size))
	}
	if err := d.aligned(op, "size, offset or address in the reservation", size, offset, uint64(ptr)-r.base); err != nil {
		return err
	}
	if i := overlapAt(r.maps, uint64(ptr), size); i >= 0 {
		return invalid(op, fmt.Sprintf("%#x+%d overlaps the mapping at %#x+%d", uint64(ptr), size, r.maps[i].base, r.maps[i].size))
	}
	at := unsafe.Pointer(&r.mem[uint64(ptr)-r.base])
	if _, err := unix.MmapPtr(c.fd, int64(offset), at, uintptr(size), unix.PROT_READ|unix.PROT_WRITE, unix.MAP_SHARED|unix.MAP_FIXED); err != nil {
		return &detailError{cuda: cudart.NewError(op, cudart.ErrOutOfMemory), detail: "mmap: " + err.Error()}
	}
	c.maps++
	m := &vmmMap{base: uint64(ptr), size: size, c: c, off: offset, access: make([]cudart.AccessFlags, d.cfg.devices)}
	r.maps = insertSorted(r.maps, m)
	r.unmapped = slices.DeleteFunc(r.unmapped, func(u vmmMap) bool { return u.base < m.base+m.size && m.base < u.base+u.size })
	return nil
}

// overlapAt is the index of an item of items (sorted, not overlapping) that overlaps
// [at, at+n), or -1.
func overlapAt[T ranged](items []T, at, n uint64) int {
	for i, it := range items {
		start, length := it.bounds()
		if start < at+n && at < start+length {
			return i
		}
	}
	return -1
}

// MemUnmap puts the reservation's inaccessible mapping back over exactly one
// mapping. Queued work that still touches it is a ViolationUseAfterRelease, and the
// mapping stays: the work would touch memory that is gone.
func (d *Device) MemUnmap(dev int, ptr cudart.DevicePtr, size uint64) error {
	const op = "cuMemUnmap"
	d.mu.Lock()
	defer d.mu.Unlock()
	if err := d.enterVMM(op, dev); err != nil {
		return err
	}
	r := d.reservation(ptr, size)
	i := -1
	if r != nil {
		i = slices.IndexFunc(r.maps, func(m *vmmMap) bool { return m.base == uint64(ptr) && m.size == size })
	}
	if i < 0 {
		return invalid(op, fmt.Sprintf("%#x+%d is not what one cuMemMap mapped", uint64(ptr), size))
	}
	m := r.maps[i]
	if m.pending > 0 {
		return violationErr(op, 0, d.violate(ViolationUseAfterRelease, op,
			"%#x+%d unmapped while %d queued ops still touch it (synchronize with them first)", m.base, m.size, m.pending))
	}
	const reserveFlags = unix.MAP_PRIVATE | unix.MAP_ANONYMOUS | unix.MAP_NORESERVE | unix.MAP_FIXED
	if _, err := unix.MmapPtr(-1, 0, unsafe.Pointer(&r.mem[m.base-r.base]), uintptr(m.size), unix.PROT_NONE, reserveFlags); err != nil {
		return &detailError{cuda: cudart.NewError(op, cudart.ErrUnknown), detail: "mmap: " + err.Error()}
	}
	m.gone = true
	r.maps = slices.Delete(r.maps, i, i+1)
	r.unmapped = append(r.unmapped, vmmMap{base: m.base, size: m.size})
	m.c.maps--
	d.dropChunk(m.c)
	return nil
}

// MemSetAccess sets each device's access to the whole mappings [ptr, ptr+size)
// covers, which must be mapped throughout.
func (d *Device) MemSetAccess(dev int, ptr cudart.DevicePtr, size uint64, descs []cudart.AccessDesc) error {
	const op = "cuMemSetAccess"
	d.mu.Lock()
	defer d.mu.Unlock()
	if err := d.enterVMM(op, dev); err != nil {
		return err
	}
	if len(descs) == 0 {
		return invalid(op, "no access to set")
	}
	for _, a := range descs {
		switch {
		case a.Location.Type != cudart.LocationDevice || a.Location.ID < 0 || int(a.Location.ID) >= d.cfg.devices:
			return fail(op, cudart.ErrInvalidDevice)
		case a.Flags != cudart.AccessNone && a.Flags != cudart.AccessRead && a.Flags != cudart.AccessReadWrite:
			return invalid(op, fmt.Sprintf("unknown access flags %d", a.Flags))
		}
	}
	ms, err := d.mapped(op, ptr, size)
	if err != nil {
		return err
	}
	for _, p := range ms {
		if p.lo != p.m.off || p.hi != p.m.off+p.m.size {
			return invalid(op, fmt.Sprintf("%#x+%d covers part of the mapping at %#x+%d", uint64(ptr), size, p.m.base, p.m.size))
		}
	}
	for _, p := range ms {
		for _, a := range descs {
			p.m.access[a.Location.ID] = a.Flags
		}
	}
	return nil
}

// mapped is [ptr, ptr+n) as the pieces of the mappings it lies in, which must cover
// it without a gap: ErrInvalidValue where they do not, and a ViolationUseAfterRelease
// too where the gap was mapped once. d.mu is held.
func (d *Device) mapped(op string, ptr cudart.DevicePtr, n uint64) ([]vmmPiece, error) {
	r := d.reservation(ptr, n)
	if n == 0 || r == nil {
		return nil, invalid(op, fmt.Sprintf("%#x+%d does not lie in one reservation", uint64(ptr), n))
	}
	var ps []vmmPiece
	at, end := uint64(ptr), uint64(ptr)+n
	for at < end {
		i := covering(r.maps, at, 1)
		if i < 0 {
			if slices.ContainsFunc(r.unmapped, func(u vmmMap) bool { return u.base <= at && at < u.base+u.size }) {
				return nil, violationErr(op, cudart.ErrInvalidValue, d.violate(ViolationUseAfterRelease, op,
					"%#x+%d: %#x was unmapped", uint64(ptr), n, at))
			}
			return nil, invalid(op, fmt.Sprintf("%#x+%d: nothing is mapped at %#x", uint64(ptr), n, at))
		}
		m := r.maps[i]
		stop := min(end, m.base+m.size)
		ps = append(ps, vmmPiece{m: m, lo: m.off + at - m.base, hi: m.off + stop - m.base})
		at = stop
	}
	return ps, nil
}

// vmmAccess resolves [ptr, ptr+n) in a reservation for a read or write from dev, as
// access does for pools. d.mu is held.
func (d *Device) vmmAccess(op string, dev int, r *vmmReservation, ptr cudart.DevicePtr, n uint64, write bool) (span, error) {
	ps, err := d.mapped(op, ptr, n)
	if err != nil {
		return span{}, err
	}
	for _, p := range ps {
		if flags := p.m.access[dev]; flags == cudart.AccessNone || (write && flags != cudart.AccessReadWrite) {
			return span{}, violationErr(op, cudart.ErrInvalidValue, d.violate(ViolationAccessDenied, op,
				"device %d may not %s the mapping at %#x+%d (flags %d; cuMemSetAccess grants it)",
				dev, verbOf(write), p.m.base, p.m.size, flags))
		}
	}
	return span{r: r, v: ps, off: uint64(ptr) - r.base, n: n, ptr: ptr, write: write}, nil
}

// touchVMM is touch for a span of mappings: each must still be mapped, and each
// piece's marks are checked and updated. d.mu is held.
func (d *Device) touchVMM(op string, sp span, st *stream, after uint64) (vs []Violation, bad bool) {
	for _, p := range sp.v {
		if p.m.gone {
			return []Violation{d.violate(ViolationUseAfterRelease, op,
				"%s of %#x+%d: the mapping at %#x was unmapped before the work ran", verbOf(sp.write), uint64(sp.ptr), sp.n, p.m.base)}, true
		}
	}
	for _, p := range sp.v {
		m := p.m.c.marks(d.id)
		vs = append(vs, d.checkMarks(op, sp, m, st, after, p.lo, p.hi)...)
		if sp.write {
			m.wrote(st, now(), p.lo, p.hi)
		} else {
			m.read(st, now(), p.lo, p.hi)
		}
	}
	return vs, false
}

// holdMaps keeps the mappings spans touch from being unmapped until the returned
// func runs, once their work has. d.mu is held by both.
func holdMaps(spans []span) (done func()) {
	var ms []*vmmMap
	for _, sp := range spans {
		for _, p := range sp.v {
			p.m.pending++
			ms = append(ms, p.m)
		}
	}
	return func() {
		for _, m := range ms {
			m.pending--
		}
	}
}

// closeVMM drops every mapping, reservation and handle of the route, as a process's
// exit does; chunks live on in other processes' descriptors and mappings. d.mu is
// held.
func (d *Device) closeVMM() {
	for _, r := range d.vmm.ranges {
		for _, m := range r.maps {
			m.gone = true
			m.c.maps--
		}
		_ = unix.MunmapPtr(unsafe.Pointer(unsafe.SliceData(r.mem)), uintptr(r.size)) // cleanup: the process's exit
	}
	for _, c := range d.vmm.chunks {
		_ = unix.Close(c.fd) // cleanup: as above
		c.fd = -1
	}
	for _, r := range d.vmm.ranges {
		for _, m := range r.maps {
			d.dropChunk(m.c)
		}
	}
	for _, c := range d.vmm.chunks {
		d.dropChunk(c)
	}
	d.vmm = vmmState{}
}

// StreamWriteValue32 writes the word when the stream reaches it. Stream memory
// operations are modelled on VMM memory only: pool memory refuses them with
// ErrInvalidValue, as the driver does (FACTS 15). They are synchronisation, not data:
// their accesses are not marked, so a word written by one process and waited for by
// another is no unordered access.
func (d *Device) StreamWriteValue32(dev int, ptr cudart.DevicePtr, value uint32, s cudart.Stream) error {
	return d.memOp("cuStreamWriteValue32", dev, ptr, true, s, nil, func(w *uint32) { atomic.StoreUint32(w, value) })
}

// StreamWaitValue32 holds the stream until the word meets cond; once it does, the
// stream's later work is ordered after whatever had run anywhere by then, as after an
// event's completion.
func (d *Device) StreamWaitValue32(dev int, ptr cudart.DevicePtr, value uint32, cond cudart.WaitCond, s cudart.Stream) error {
	const op = "cuStreamWaitValue32"
	if cond > cudart.WaitNor {
		return invalid(op, fmt.Sprintf("unknown wait condition %d", cond))
	}
	return d.memOp(op, dev, ptr, false, s, func(w *uint32) bool { return cond.Met(atomic.LoadUint32(w), value) }, nil)
}

// memOp queues a stream memory operation on the word at ptr: ready, if not nil, holds
// the stream until it is met; run, if not nil, runs when the stream reaches it.
func (d *Device) memOp(op string, dev int, ptr cudart.DevicePtr, write bool, s cudart.Stream,
	ready func(w *uint32) bool, run func(w *uint32)) error {
	d.mu.Lock()
	defer d.mu.Unlock()
	if err := d.enter(op, dev); err != nil {
		return err
	}
	st, err := d.stream(op, dev, s)
	if err != nil {
		return err
	}
	r := d.reservation(ptr, 4)
	switch {
	case ptr%4 != 0:
		return invalid(op, fmt.Sprintf("%#x is not 4-byte aligned", uint64(ptr)))
	case r == nil:
		return invalid(op, fmt.Sprintf("%#x is not VMM memory: pool memory refuses stream memory operations (FACTS 15), and the software device models them on VMM memory only", uint64(ptr)))
	}
	sp, err := d.vmmAccess(op, dev, r, ptr, 4, write)
	if err != nil {
		return err
	}
	w := (*uint32)(unsafe.Pointer(&sp.buf()[0]))
	m := sp.v[0].m
	release := holdMaps([]span{sp})
	o := &task{run: func(st *stream, _ uint64) error {
		defer release()
		if m.gone {
			return violationErr(op, 0, d.violate(ViolationUseAfterRelease, op,
				"the word at %#x was unmapped before the operation ran", uint64(ptr)))
		}
		if run != nil {
			run(w)
		}
		if ready != nil {
			st.waited = max(st.waited, now())
		}
		return nil
	}}
	if ready != nil {
		o.ready = func() bool { return m.gone || ready(w) }
	}
	return d.submit(op, st, o)
}
