package cudarttest

import (
	"slices"
	"sort"

	"github.com/cudapool/cudapool/cudart"
)

// allocAlign is where sub-allocations start and what their sizes round to: 1 MiB
// buffers land at 1 MiB offsets and small ones at 512-byte steps (FACTS 1).
const allocAlign = 512

// pool is a pool this Device created (the exporter side, if shared) or imported.
type pool struct {
	handle      cudart.MemPool // 0 once destroyed; the memory stays until its users go
	dev         int            // resident device
	handleTypes cudart.HandleType
	maxSize     uint64 // bound on reserved bytes
	isDefault   bool
	imported    bool
	reg         *region
	uid         uid
	base, size  uint64 // device addresses [base, base+size)

	// Attributes this process holds; the memory figures live in the header.
	reuse     [3]uint64 // PoolReuse* flags, by attribute - 1
	threshold uint64
	access    map[int]cudart.AccessFlags // devices other than dev

	pending int // queued ops that touch the pool's memory: it stays mapped for them

	// Exporter side.
	exported    bool
	live        []*alloc // by offset, until their frees have run
	freeing     int      // allocations whose frees are queued, not run
	freeEntries []uint32 // FIFO, so a freed entry keeps its record for a while

	// Importer side.
	importer ident        // this Device, as registered in importer slots
	refs     int          // MemPoolImportFromShareableHandle calls not yet destroyed
	imports  []*importRec // by address
	released map[cudart.DevicePtr]uint64
}

type alloc struct {
	off, size uint64
	entry     uint32
	gen       uint64
	freeing   bool // its free is queued
}

// exporterGone reports whether the Device that made this imported pool has closed or
// its process exited.
func (p *pool) exporterGone() bool {
	return p.reg.load(hExporterGone) != 0 || !ident(p.reg.load(hExporter)).alive()
}

func (p *pool) ipc() bool { return p.handleTypes != cudart.HandleTypeNone }

func (p *pool) data(off, n uint64) []byte {
	return p.reg.mem[poolDataOffset+off : poolDataOffset+off+n : poolDataOffset+off+n]
}

// newPool creates and maps the memfd of a pool this Device owns.
func (d *Device) newPool(op string, props cudart.PoolProps, isDefault bool) (*pool, error) {
	size := d.cfg.memory
	if props.MaxSize != 0 {
		size = min(props.MaxSize, size)
	}
	reg, err := newRegion(poolMemfdName, poolDataOffset+size)
	if err != nil {
		return nil, errCapacity(op, err.Error())
	}
	p := &pool{
		handle:      cudart.MemPool(newHandle()),
		dev:         int(props.Location.ID),
		handleTypes: props.HandleTypes,
		maxSize:     size,
		isDefault:   isDefault,
		reg:         reg,
		uid:         newUID(),
		base:        reserveAddresses(size),
		size:        size,
		reuse:       [3]uint64{1, 1, 1},
		freeEntries: make([]uint32, maxEntries),
	}
	for i := range p.freeEntries {
		p.freeEntries[i] = uint32(i)
	}
	reg.storeUID(hUID, p.uid)
	reg.store(hBase, p.base)
	reg.store(hSize, size)
	reg.store(hGranularity, d.cfg.granularity)
	reg.store(hExporter, uint64(d.id))
	reg.store(hDevice, uint64(p.dev))
	reg.store(hHandleTypes, uint64(p.handleTypes))
	reg.store(hEntries, maxEntries)
	reg.store(hMagic, poolMagic) // last: an importer trusts nothing before it
	d.addPool(p)
	return p, nil
}

// addPool makes p's handle and addresses known.
func (d *Device) addPool(p *pool) {
	d.pools[p.handle] = p
	d.spans = insertSorted(d.spans, p)
}

// poolAt is the mapped pool whose address range holds ptr, or nil.
func (d *Device) poolAt(ptr cudart.DevicePtr) *pool {
	if i := covering(d.spans, uint64(ptr), 1); i >= 0 {
		return d.spans[i]
	}
	return nil
}

// A ranged thing occupies [start, start+length) of some space: pools of device
// addresses, allocations and imports of a pool's offsets.
type ranged interface{ bounds() (start, length uint64) }

func (p *pool) bounds() (uint64, uint64)      { return p.base, p.size }
func (a *alloc) bounds() (uint64, uint64)     { return a.off, a.size }
func (r *importRec) bounds() (uint64, uint64) { return r.off, r.size }

// covering is the index of the item of items (sorted by start, not overlapping) that
// holds all of [at, at+n), or -1.
func covering[T ranged](items []T, at, n uint64) int {
	i := sort.Search(len(items), func(i int) bool { start, _ := items[i].bounds(); return start > at })
	if i == 0 {
		return -1
	}
	start, length := items[i-1].bounds()
	if at+n > start+length || at+n < at {
		return -1
	}
	return i - 1
}

// insertSorted inserts item into items by start.
func insertSorted[T ranged](items []T, item T) []T {
	at, _ := item.bounds()
	i := sort.Search(len(items), func(i int) bool { start, _ := items[i].bounds(); return start > at })
	return slices.Insert(items, i, item)
}

// dropPool unmaps a destroyed pool once nothing uses its memory any more.
func (d *Device) dropPool(p *pool) {
	if p.handle != 0 || len(p.live) > 0 || len(p.imports) > 0 || p.pending > 0 || p.reg.mem == nil {
		return
	}
	if i := slices.Index(d.spans, p); i >= 0 {
		d.spans = slices.Delete(d.spans, i, i+1)
	}
	if !p.imported {
		d.devs[p.dev].reserved -= p.reg.load(hReserved)
	}
	p.reg.release()
}

// enterPool is enter for a call on pool h, which it returns; d.mu is held.
func (d *Device) enterPool(op string, dev int, h cudart.MemPool) (*pool, error) {
	if err := d.enter(op, dev); err != nil {
		return nil, err
	}
	p, ok := d.pools[h]
	if !ok {
		return nil, fail(op, cudart.ErrInvalidValue)
	}
	return p, nil
}

// MemPoolCreate creates a pinned device pool. Handle types other than POSIX fd and
// FABRIC fail with ErrNotSupported; so do host-located pools, which this device does
// not model. A maxSize that is not a granularity multiple is accepted (FACTS 10);
// reserved memory never exceeds it.
func (d *Device) MemPoolCreate(props cudart.PoolProps) (cudart.MemPool, error) {
	const op = "cudaMemPoolCreate"
	d.mu.Lock()
	defer d.mu.Unlock()
	if d.closed {
		return 0, errClosed(op)
	}
	if d.lost {
		return 0, d.errLost(op, int(props.Location.ID))
	}
	switch {
	case props.Location.Type == cudart.LocationHost:
		return 0, fail(op, cudart.ErrNotSupported)
	case props.Location.Type != cudart.LocationDevice:
		return 0, fail(op, cudart.ErrInvalidValue)
	case props.Location.ID < 0 || int(props.Location.ID) >= d.cfg.devices:
		return 0, fail(op, cudart.ErrInvalidDevice)
	case props.HandleTypes&^supportedHandles != 0:
		return 0, fail(op, cudart.ErrNotSupported)
	}
	p, err := d.newPool(op, props, false)
	if err != nil {
		return 0, err
	}
	return p.handle, nil
}

// DeviceGetDefaultMemPool returns dev's default pool, which is not IPC capable.
func (d *Device) DeviceGetDefaultMemPool(dev int) (cudart.MemPool, error) {
	const op = "cudaDeviceGetDefaultMemPool"
	d.mu.Lock()
	defer d.mu.Unlock()
	if err := d.enter(op, dev); err != nil {
		return 0, err
	}
	if p := d.devs[dev].defaultPool; p != nil {
		return p.handle, nil
	}
	p, err := d.newPool(op, cudart.PoolProps{Location: cudart.DeviceLocation(dev)}, true)
	if err != nil {
		return 0, err
	}
	d.devs[dev].defaultPool = p
	return p.handle, nil
}

// MemPoolDestroy invalidates the handle at once; like the driver, the memory goes
// when its last allocation (or import) is freed. A default pool cannot be destroyed.
// Destroying an imported pool undoes one import of it; once the exporter has exited,
// it fails with ErrInvalidValue (FACTS 7), and the pool is forgotten all the same.
func (d *Device) MemPoolDestroy(dev int, h cudart.MemPool) error {
	const op = "cudaMemPoolDestroy"
	d.mu.Lock()
	defer d.mu.Unlock()
	p, err := d.enterPool(op, dev, h)
	if err != nil {
		return err
	}
	if p.isDefault {
		return fail(op, cudart.ErrInvalidValue)
	}
	exporterGone := false
	if p.imported {
		if p.refs--; p.refs > 0 {
			return nil
		}
		exporterGone = p.exporterGone()
		delete(d.importedByUID, p.uid)
	}
	delete(d.pools, h)
	p.handle = 0
	d.dropPool(p)
	if exporterGone {
		return fail(op, cudart.ErrInvalidValue)
	}
	return nil
}

// MemPoolGetAttribute reads an attribute. The memory figures of an imported pool are
// the exporter's.
func (d *Device) MemPoolGetAttribute(dev int, h cudart.MemPool, attr cudart.PoolAttr) (uint64, error) {
	const op = "cudaMemPoolGetAttribute"
	d.mu.Lock()
	defer d.mu.Unlock()
	p, err := d.enterPool(op, dev, h)
	if err != nil {
		return 0, err
	}
	switch attr {
	case cudart.PoolReuseFollowEventDependencies, cudart.PoolReuseAllowOpportunistic, cudart.PoolReuseAllowInternalDependencies:
		return p.reuse[attr-1], nil
	case cudart.PoolReleaseThreshold:
		return p.threshold, nil
	}
	if off, ok := figureOffset(attr); ok {
		return p.reg.load(off), nil
	}
	return 0, fail(op, cudart.ErrInvalidValue)
}

func figureOffset(attr cudart.PoolAttr) (uint64, bool) {
	switch attr {
	case cudart.PoolReservedMemCurrent:
		return hReserved, true
	case cudart.PoolReservedMemHigh:
		return hReservedHigh, true
	case cudart.PoolUsedMemCurrent:
		return hUsed, true
	case cudart.PoolUsedMemHigh:
		return hUsedHigh, true
	}
	return 0, false
}

// MemPoolSetAttribute sets an attribute by CUDA's rules: the reuse flags take 0 or 1,
// the release threshold any value (IPC pools ignore it), the high marks only 0, which
// resets them to the current figure; the current figures are read-only. An importer
// cannot reset the exporter's high marks (ErrInvalidValue).
func (d *Device) MemPoolSetAttribute(dev int, h cudart.MemPool, attr cudart.PoolAttr, value uint64) error {
	const op = "cudaMemPoolSetAttribute"
	d.mu.Lock()
	defer d.mu.Unlock()
	p, err := d.enterPool(op, dev, h)
	if err != nil {
		return err
	}
	switch attr {
	case cudart.PoolReuseFollowEventDependencies, cudart.PoolReuseAllowOpportunistic, cudart.PoolReuseAllowInternalDependencies:
		if value > 1 {
			return fail(op, cudart.ErrInvalidValue)
		}
		p.reuse[attr-1] = value
		return nil
	case cudart.PoolReleaseThreshold:
		p.threshold = value
		return nil
	case cudart.PoolReservedMemHigh, cudart.PoolUsedMemHigh:
		if value != 0 || p.imported {
			return fail(op, cudart.ErrInvalidValue)
		}
		high, _ := figureOffset(attr)
		p.reg.store(high, p.reg.load(high-8)) // each high mark follows its current figure
		return nil
	}
	return fail(op, cudart.ErrInvalidValue)
}

// MemPoolSetAccess grants devices access to p. Every descriptor is checked before any
// is applied. AccessNone fails with ErrInvalidDevice (as measured); a device that
// cannot reach p's device, with ErrInvalidDevice; the resident device always has
// read-write access and cannot be lowered (ErrInvalidValue).
func (d *Device) MemPoolSetAccess(dev int, h cudart.MemPool, descs []cudart.AccessDesc) error {
	const op = "cudaMemPoolSetAccess"
	d.mu.Lock()
	defer d.mu.Unlock()
	p, err := d.enterPool(op, dev, h)
	if err != nil {
		return err
	}
	for _, desc := range descs {
		peer := int(desc.Location.ID)
		switch {
		case desc.Location.Type != cudart.LocationDevice:
			return fail(op, cudart.ErrInvalidValue)
		case peer < 0 || peer >= d.cfg.devices:
			return fail(op, cudart.ErrInvalidDevice)
		case desc.Flags == cudart.AccessNone:
			return fail(op, cudart.ErrInvalidDevice)
		case desc.Flags != cudart.AccessRead && desc.Flags != cudart.AccessReadWrite:
			return fail(op, cudart.ErrInvalidValue)
		case peer == p.dev && desc.Flags != cudart.AccessReadWrite:
			return fail(op, cudart.ErrInvalidValue)
		case peer != p.dev && !d.cfg.peerAccess:
			return fail(op, cudart.ErrInvalidDevice)
		}
	}
	for _, desc := range descs {
		if peer := int(desc.Location.ID); peer != p.dev {
			if p.access == nil {
				p.access = map[int]cudart.AccessFlags{}
			}
			p.access[peer] = desc.Flags
		}
	}
	return nil
}

// MemPoolGetAccess reports loc's access to p: read-write for the resident device,
// what MemPoolSetAccess granted in this Device for others.
func (d *Device) MemPoolGetAccess(dev int, h cudart.MemPool, loc cudart.Location) (cudart.AccessFlags, error) {
	const op = "cudaMemPoolGetAccess"
	d.mu.Lock()
	defer d.mu.Unlock()
	p, err := d.enterPool(op, dev, h)
	if err != nil {
		return 0, err
	}
	if loc.Type != cudart.LocationDevice || loc.ID < 0 || int(loc.ID) >= d.cfg.devices {
		return 0, fail(op, cudart.ErrInvalidValue)
	}
	return p.accessOf(int(loc.ID)), nil
}

func (p *pool) accessOf(dev int) cudart.AccessFlags {
	if dev == p.dev {
		return cudart.AccessReadWrite
	}
	return p.access[dev]
}

// MemPoolTrimTo releases reserved memory above the live allocations, down to
// minBytesToKeep, of a pool that is not IPC capable; IPC pools keep theirs (as the
// driver does).
func (d *Device) MemPoolTrimTo(dev int, h cudart.MemPool, minBytesToKeep uint64) error {
	const op = "cudaMemPoolTrimTo"
	d.mu.Lock()
	defer d.mu.Unlock()
	p, err := d.enterPool(op, dev, h)
	if err != nil {
		return err
	}
	if p.ipc() || p.imported {
		return nil
	}
	keep := roundUp(minBytesToKeep, d.cfg.granularity)
	if n := len(p.live); n > 0 {
		keep = max(keep, roundUp(p.live[n-1].off+p.live[n-1].size, d.cfg.granularity))
	}
	reserved := p.reg.load(hReserved)
	if keep >= reserved {
		return nil
	}
	// Give the pages back, as the driver unmaps the physical memory.
	punchHole(p.reg.fd, int64(poolDataOffset+keep), int64(reserved-keep))
	p.reg.store(hReserved, keep)
	d.devs[p.dev].reserved -= reserved - keep
	return nil
}

// MallocFromPoolAsync allocates first fit, at 512-byte alignment, sizes rounded to 512,
// growing the reserved memory in granules (FACTS 1). The pointer is returned at once;
// the allocation runs when the stream reaches it, and no other stream may touch the
// memory before that (ViolationUnorderedRead, ViolationUnorderedWrite). Memory comes
// back to the pool when a free has run: a pool found full waits for the frees queued
// on it, as the driver may order an allocation after them. Beyond the pool's maxSize or
// the device's memory (a single allocation too) it fails with ErrOutOfMemory
// (FACTS 10); on an imported pool (FACTS 6), or for a zero size, with ErrInvalidValue.
func (d *Device) MallocFromPoolAsync(dev int, size uint64, h cudart.MemPool, s cudart.Stream) (cudart.DevicePtr, error) {
	const op = "cudaMallocFromPoolAsync"
	d.mu.Lock()
	defer d.mu.Unlock()
	for {
		ptr, retry, err := d.mallocOnce(op, dev, size, h, s)
		if !retry {
			return ptr, err
		}
		if err := d.waitProgress(op); err != nil {
			return 0, err
		}
	}
}

// mallocOnce tries once; retry says the pool is full but frees queued on it may make
// room. d.mu is held.
func (d *Device) mallocOnce(op string, dev int, size uint64, h cudart.MemPool, s cudart.Stream) (_ cudart.DevicePtr, retry bool, _ error) {
	p, err := d.enterPool(op, dev, h)
	if err != nil {
		return 0, false, err
	}
	st, err := d.stream(op, dev, s)
	if err != nil {
		return 0, false, err
	}
	if p.imported || size == 0 {
		return 0, false, fail(op, cudart.ErrInvalidValue)
	}
	if size > p.size { // checked before rounding, which could wrap
		return 0, false, fail(op, cudart.ErrOutOfMemory)
	}
	size = roundUp(size, allocAlign)
	off, at, ok := p.firstFit(size)
	if !ok {
		return 0, p.freeing > 0, fail(op, cudart.ErrOutOfMemory)
	}
	reserved := p.reg.load(hReserved)
	grown := max(reserved, roundUp(off+size, d.cfg.granularity))
	if grown > p.maxSize || d.devs[p.dev].reserved+(grown-reserved) > d.cfg.memory {
		return 0, p.freeing > 0, fail(op, cudart.ErrOutOfMemory)
	}
	if len(p.freeEntries) == 0 {
		return 0, p.freeing > 0, errCapacity(op, "pool has maxEntries live allocations")
	}
	entry := p.freeEntries[0]
	p.freeEntries = p.freeEntries[1:]
	if len(p.freeEntries) == 0 {
		p.freeEntries = nil // let the drained backing array go
	}
	eo := entryOff(entry)
	gen := p.reg.load(eo+eState)>>2 + 1
	p.reg.store(eo+eOffset, off)
	p.reg.store(eo+eSize, size)
	m := p.marks(entry, d.id)
	m.reset(st, pendingEpoch, off, off+size) // until it runs, no other stream may touch it
	p.reg.store(eo+eReleased, 0)
	p.reg.store(eo+eState, packState(gen, stateLive))
	a := &alloc{off: off, size: size, entry: entry, gen: gen}
	p.live = slices.Insert(p.live, at, a)

	d.devs[p.dev].reserved += grown - reserved
	p.reg.store(hReserved, grown)
	p.reg.storeMax(hReservedHigh, grown)
	used := p.reg.load(hUsed) + size
	p.reg.store(hUsed, used)
	p.reg.storeMax(hUsedHigh, used)
	err = d.submit(op, st, &task{pool: p, run: func(st *stream, _ uint64) error {
		if cur, _ := p.allocAt(a.off, a.size); cur == a {
			m.ran(now())
		}
		return nil
	}})
	return cudart.DevicePtr(p.base + off), false, err
}

// firstFit finds the lowest offset where size bytes fit between live allocations, and
// the index in p.live to insert at.
func (p *pool) firstFit(size uint64) (off uint64, at int, ok bool) {
	var end uint64
	for i, a := range p.live {
		if a.off-end >= size {
			return end, i, true
		}
		end = a.off + a.size
	}
	return end, len(p.live), p.size-end >= size
}

// allocAt is the live allocation holding [off, off+n), or nil.
func (p *pool) allocAt(off, n uint64) (*alloc, int) {
	i := covering(p.live, off, n)
	if i < 0 {
		return nil, -1
	}
	return p.live[i], i
}

// freedAt reports whether [off, off+n) lies in an allocation that was freed and whose
// record has not been reused yet: touching it is a use after release rather than a
// wild address.
func (p *pool) freedAt(off, n uint64) bool {
	for i := range uint32(maxEntries) {
		eo := entryOff(i)
		w := p.reg.load(eo + eState)
		if w == stateUnused {
			break // entries are used in order, so the rest never were
		}
		if w&3 == stateFreed {
			eoff, esize := p.reg.load(eo+eOffset), p.reg.load(eo+eSize)
			if off >= eoff && off+n <= eoff+esize {
				return true
			}
		}
	}
	return false
}

// FreeAsync queues the free of an allocation of this Device's pool, or the unmapping
// of an import. Freeing memory whose free is already queued or has run is a
// ViolationUseAfterRelease with ErrInvalidValue (FACTS 4); any other address is
// ErrInvalidValue. When the free runs, the memory goes back to the pool; freeing an
// allocation that a live importer still holds is then a
// ViolationExporterFreedWhileImported (the free still happens), and a free not ordered
// after another stream's access is a ViolationUnorderedFree.
func (d *Device) FreeAsync(dev int, ptr cudart.DevicePtr, s cudart.Stream) error {
	const op = "cudaFreeAsync"
	d.mu.Lock()
	defer d.mu.Unlock()
	if err := d.enter(op, dev); err != nil {
		return err
	}
	st, err := d.stream(op, dev, s)
	if err != nil {
		return err
	}
	p := d.poolAt(ptr)
	if p == nil {
		return fail(op, cudart.ErrInvalidValue)
	}
	if p.imported {
		return d.freeImport(op, st, p, ptr)
	}
	off := uint64(ptr) - p.base
	a, _ := p.allocAt(off, 1)
	switch {
	case a != nil && a.off == off && a.freeing:
		return violationErr(op, cudart.ErrInvalidValue,
			d.violate(ViolationUseAfterRelease, op, "%#x is already being freed", uint64(ptr)))
	case a == nil || a.off != off:
		if a == nil && p.freedAt(off, 1) {
			return violationErr(op, cudart.ErrInvalidValue,
				d.violate(ViolationUseAfterRelease, op, "%#x was already freed", uint64(ptr)))
		}
		return fail(op, cudart.ErrInvalidValue)
	}
	a.freeing = true
	p.freeing++
	return d.submit(op, st, &task{pool: p, run: func(st *stream, after uint64) error {
		return d.runFree(op, st, after, p, a, ptr)
	}})
}

// runFree is an allocation's free, as it runs on st.
func (d *Device) runFree(op string, st *stream, after uint64, p *pool, a *alloc, ptr cudart.DevicePtr) error {
	vs := d.unorderedFree(op, p, a.entry, st, after, ptr, func(ident) bool { return true })
	eo := entryOff(a.entry)
	p.reg.store(eo+eState, packState(a.gen, stateFreed))
	holders := p.liveImporters(a)
	released := p.reg.load(eo + eReleased)
	i := slices.Index(p.live, a)
	p.live = slices.Delete(p.live, i, i+1)
	p.freeing--
	p.freeEntries = append(p.freeEntries, a.entry)
	p.reg.store(hUsed, p.reg.load(hUsed)-a.size)
	switch {
	case len(holders) > 0:
		vs = append(vs, d.violate(ViolationExporterFreedWhileImported, op,
			"%#x (%d bytes) freed while imported by %v", uint64(ptr), a.size, holders))
	case released > after:
		// The importer's free must have completed before this one runs: an IPC event
		// recorded after it and waited on here says so.
		vs = append(vs, d.violate(ViolationExporterFreedWhileImported, op,
			"%#x (%d bytes) freed on a stream not ordered after an importer's free of it", uint64(ptr), a.size))
	}
	if len(vs) > 0 {
		return violationErr(op, 0, vs...)
	}
	return nil
}

// unorderedFree reports the accesses to an entry's memory, by the Devices whose
// accesses count, that a free running on st is not ordered after.
func (d *Device) unorderedFree(op string, p *pool, entry uint32, st *stream, after uint64, ptr cudart.DevicePtr, counts func(ident) bool) []Violation {
	m := p.marks(entry, d.id)
	var vs []Violation
	for _, k := range m.overlapping(0, ^uint64(0)) {
		if counts(k.id) && !k.is(d.id, st) && k.epoch > after {
			vs = append(vs, d.violate(ViolationUnorderedFree, op,
				"%#x freed on a stream not ordered after %v's %s of it", uint64(ptr), k.accessor, verbOf(k.write)))
		}
	}
	return vs
}

// liveImporters lists the Devices that hold an import of a and are still alive,
// clearing the slots of dead ones.
func (p *pool) liveImporters(a *alloc) []ident {
	var holders []ident
	for s := range maxImporters {
		so := slotOff(a.entry, s)
		id := ident(p.reg.load(so))
		if id == 0 || p.reg.load(so+8) != a.gen {
			continue // empty, still registering (it will see the free), or another generation's
		}
		if id.alive() {
			holders = append(holders, id)
		} else {
			p.reg.cas(so+8, a.gen, 0)
			p.reg.cas(so, uint64(id), 0)
		}
	}
	return holders
}
