package cudarttest

import (
	"fmt"
	"slices"

	"golang.org/x/sys/unix"

	"github.com/cudapool/cudapool/cudart"
)

// importRec is one imported allocation in this Device. slot is this Device's importer
// slot in the entry, or -1 for a stale import (which holds nothing).
type importRec struct {
	ptr       cudart.DevicePtr
	off, size uint64
	entry     uint32
	gen       uint64
	slot      int
	stale     bool
	freeing   bool // its free is queued
}

// Magic numbers that begin the 64-byte handles; the last 8 bytes of each are a
// checksum of the rest, so junk is told from ours.
const (
	ptrMagic    = 0x31305f5254504443 // "CDPTR_01"
	fabricMagic = 0x31305f4241464443 // "CDFAB_01"
)

// sealed writes words into a 64-byte handle and seals it with the checksum.
func sealed(words ...uint64) [64]byte {
	var b [64]byte
	for i, w := range words {
		put64(b[8*i:], w)
	}
	put64(b[56:], checksum(b[:56]))
	return b
}

// unseal returns the 7 words of a handle if its magic and checksum are right.
func unseal(b [64]byte, magic uint64) ([7]uint64, bool) {
	var w [7]uint64
	for i := range w {
		w[i] = le64(b[8*i:])
	}
	return w, w[0] == magic && le64(b[56:]) == checksum(b[:56])
}

// MemPoolExportToShareableHandle exports an IPC pool. For a POSIX fd the caller owns
// the returned descriptor (a close-on-exec dup of the pool's memfd). A FABRIC handle
// names the exporter's descriptor through /proc and is refused with ErrNotPermitted
// unless the device was made WithFabric (FACTS 11). A handle type the pool was not
// created with, or an imported pool, fails with ErrInvalidValue (FACTS 9).
func (d *Device) MemPoolExportToShareableHandle(dev int, h cudart.MemPool, ht cudart.HandleType) (cudart.ShareableHandle, error) {
	const op = "cudaMemPoolExportToShareableHandle"
	none := cudart.ShareableHandle{FD: -1}
	d.mu.Lock()
	defer d.mu.Unlock()
	p, err := d.enterPool(op, dev, h)
	if err != nil {
		return none, err
	}
	if p.imported || (ht != cudart.HandleTypePosixFD && ht != cudart.HandleTypeFabric) || p.handleTypes&ht == 0 {
		return none, fail(op, cudart.ErrInvalidValue)
	}
	if ht == cudart.HandleTypeFabric {
		if !d.cfg.fabric {
			return none, fail(op, cudart.ErrNotPermitted)
		}
		p.exported = true
		return cudart.ShareableHandle{Type: ht, FD: -1,
			Fabric: sealed(fabricMagic, uint64(d.id.pid()), uint64(p.reg.fd), p.uid[0], p.uid[1])}, nil
	}
	fd, err := unix.FcntlInt(uintptr(p.reg.fd), unix.F_DUPFD_CLOEXEC, 0)
	if err != nil {
		return none, errCapacity(op, "dup: "+err.Error())
	}
	p.exported = true
	return cudart.ShareableHandle{Type: ht, FD: fd}, nil
}

// MemPoolImportFromShareableHandle maps a pool another Device exported; h.FD stays the
// caller's. Anything that is not such a pool fails with ErrInvalidValue, as does this
// Device's own pool. Importing a pool already imported returns the same handle and
// counts one more MemPoolDestroy to undo it.
func (d *Device) MemPoolImportFromShareableHandle(dev int, h cudart.ShareableHandle) (cudart.MemPool, error) {
	const op = "cudaMemPoolImportFromShareableHandle"
	d.mu.Lock()
	defer d.mu.Unlock()
	if err := d.enter(op, dev); err != nil {
		return 0, err
	}
	reg, err := d.mapShared(op, h)
	if err != nil {
		return 0, err
	}
	p, err := d.adoptPool(op, reg, h.Type)
	if err != nil {
		reg.release()
		return 0, err
	}
	return p.handle, nil
}

// mapShared maps the memfd a shareable handle names.
func (d *Device) mapShared(op string, h cudart.ShareableHandle) (*region, error) {
	switch h.Type {
	case cudart.HandleTypePosixFD:
		reg, err := mapRegion(h.FD, poolMemfdName, poolDataOffset)
		if err != nil {
			return nil, invalid(op, err.Error())
		}
		return reg, nil
	case cudart.HandleTypeFabric:
		if !d.cfg.fabric {
			return nil, fail(op, cudart.ErrNotPermitted)
		}
		w, ok := unseal(h.Fabric, fabricMagic)
		if !ok {
			return nil, invalid(op, "not a fabric handle")
		}
		reg, err := mapProcRegion(int(w[1]), int(w[2]), poolMemfdName, poolDataOffset, hUID, uid{w[3], w[4]})
		if err != nil {
			return nil, invalid(op, err.Error())
		}
		return reg, nil
	}
	return nil, invalid(op, fmt.Sprintf("handle type %v", h.Type))
}

// adoptPool checks a mapped pool header and makes it one of this Device's pools.
func (d *Device) adoptPool(op string, reg *region, ht cudart.HandleType) (*pool, error) {
	size := reg.load(hSize)
	switch {
	case reg.load(hMagic) != poolMagic:
		return nil, invalid(op, "not a cudarttest pool")
	case reg.load(hEntries) != maxEntries || size > uint64(len(reg.mem)) || poolDataOffset+size > uint64(len(reg.mem)):
		return nil, invalid(op, "pool header does not match its memfd")
	case cudart.HandleType(reg.load(hHandleTypes))&ht == 0:
		return nil, invalid(op, fmt.Sprintf("pool was not created shareable as %v", ht))
	case reg.load(hDevice) >= uint64(d.cfg.devices):
		return nil, invalid(op, fmt.Sprintf("pool lives on device %d, which this Device lacks", reg.load(hDevice)))
	}
	id := reg.loadUID(hUID)
	if p, ok := d.importedByUID[id]; ok {
		reg.release()
		p.refs++
		return p, nil
	}
	base := reg.load(hBase)
	for _, q := range d.spans {
		if q.uid == id && q.imported {
			// Destroyed, its imports not all freed yet: the same pool again.
			reg.release()
			q.handle, q.refs = cudart.MemPool(newHandle()), 1
			d.importedByUID[id] = q
			d.pools[q.handle] = q
			return q, nil
		}
		if q.uid == id {
			return nil, invalid(op, "pool is this Device's own")
		}
		if base < q.base+q.size && q.base < base+size {
			return nil, &detailError{cudart.NewError(op, cudart.ErrOutOfMemory), ErrAddressOverlap,
				fmt.Sprintf("[%#x, %#x) overlaps [%#x, %#x)", base, base+size, q.base, q.base+q.size)}
		}
	}
	p := &pool{
		handle:      cudart.MemPool(newHandle()),
		dev:         int(reg.load(hDevice)),
		handleTypes: cudart.HandleType(reg.load(hHandleTypes)),
		maxSize:     size,
		imported:    true,
		importer:    d.id,
		reg:         reg,
		uid:         id,
		base:        base,
		size:        size,
		reuse:       [3]uint64{1, 1, 1},
		refs:        1,
		released:    map[cudart.DevicePtr]uint64{},
	}
	d.importedByUID[id] = p
	d.addPool(p)
	return p, nil
}

// MemPoolExportPointer returns the 64-byte record of a live allocation of an exported
// pool: the same bytes each time. A pool not yet exported (FACTS 12), not IPC capable,
// or memory that is not the start of a live allocation of this Device's own pool
// (FACTS 9) fail with ErrInvalidValue.
func (d *Device) MemPoolExportPointer(dev int, ptr cudart.DevicePtr) (cudart.PtrExportData, error) {
	const op = "cudaMemPoolExportPointer"
	d.mu.Lock()
	defer d.mu.Unlock()
	if err := d.enter(op, dev); err != nil {
		return cudart.PtrExportData{}, err
	}
	p := d.poolAt(ptr)
	if p == nil || p.imported || !p.ipc() || !p.exported {
		return cudart.PtrExportData{}, fail(op, cudart.ErrInvalidValue)
	}
	off := uint64(ptr) - p.base
	a, _ := p.allocAt(off, 1)
	if a == nil || a.off != off || a.freeing {
		return cudart.PtrExportData{}, fail(op, cudart.ErrInvalidValue)
	}
	return sealed(ptrMagic, p.uid[0], p.uid[1], uint64(a.entry), a.gen, a.off, a.size), nil
}

// MemPoolImportPointer maps an allocation of imported pool h. Junk, or a record of
// another pool, fails with ErrInvalidValue (FACTS 5). A stale record (the allocation
// was freed) succeeds, as with the driver (FACTS 3), but every access through the
// pointer is a ViolationUseAfterRelease. Importing the same record again returns the
// same pointer and no new reference (FACTS 4).
func (d *Device) MemPoolImportPointer(dev int, h cudart.MemPool, data cudart.PtrExportData) (cudart.DevicePtr, error) {
	const op = "cudaMemPoolImportPointer"
	d.mu.Lock()
	defer d.mu.Unlock()
	p, err := d.enterPool(op, dev, h)
	if err != nil {
		return 0, err
	}
	w, ok := unseal(data, ptrMagic)
	entry, gen, off, size := w[3], w[4], w[5], w[6]
	if !ok || !p.imported || (uid{w[1], w[2]}) != p.uid || entry >= maxEntries || gen == 0 ||
		off%allocAlign != 0 || size == 0 || off+size > p.size || off+size < off {
		return 0, fail(op, cudart.ErrInvalidValue)
	}
	for _, imp := range p.imports {
		if imp.entry == uint32(entry) && imp.gen == gen {
			return imp.ptr, nil
		}
	}
	imp := &importRec{ptr: cudart.DevicePtr(p.base + off), off: off, size: size, entry: uint32(entry), gen: gen, slot: -1}
	if p.entryHolds(imp) {
		if imp.slot = p.claimSlot(imp); imp.slot < 0 {
			return 0, errCapacity(op, fmt.Sprintf("%d live importers of one allocation", maxImporters))
		}
		// Registered first, checked again: an exporter freeing meanwhile either sees
		// this slot or is seen here.
		if !p.entryHolds(imp) {
			p.releaseSlot(imp)
		}
	}
	imp.stale = imp.slot < 0
	p.insertImport(imp)
	return imp.ptr, nil
}

// entryHolds reports whether the allocation imp was imported from is still live, at
// the offset and size the record gave.
func (p *pool) entryHolds(imp *importRec) bool {
	eo := entryOff(imp.entry)
	w := p.reg.load(eo + eState)
	off, size := p.reg.load(eo+eOffset), p.reg.load(eo+eSize)
	return w == packState(imp.gen, stateLive) && p.reg.load(eo+eState) == w && off == imp.off && size == imp.size
}

// claimSlot registers this Device as an importer of imp's allocation; -1 if every
// slot is held by a live importer.
func (p *pool) claimSlot(imp *importRec) int {
	me := uint64(p.importer)
	for range 2 {
		for s := range maxImporters {
			so := slotOff(imp.entry, s)
			if p.reg.cas(so, 0, me) {
				p.reg.store(so+8, imp.gen)
				return s
			}
		}
		// Full: free the slots of dead importers and try once more.
		for s := range maxImporters {
			so := slotOff(imp.entry, s)
			if id := ident(p.reg.load(so)); id != 0 && !id.alive() {
				p.reg.store(so+8, 0)
				p.reg.cas(so, uint64(id), 0)
			}
		}
	}
	return -1
}

// releaseSlot gives up imp's importer slot, if it holds one.
func (p *pool) releaseSlot(imp *importRec) {
	if imp.slot < 0 {
		return
	}
	so := slotOff(imp.entry, imp.slot)
	p.reg.store(so+8, 0)
	p.reg.cas(so, uint64(p.importer), 0)
	imp.slot = -1
}

// insertImport adds imp by address. An older import overlapping it must be of memory
// the exporter freed and reused, which the driver maps anew at the same addresses: it
// is superseded, as unmapped.
func (p *pool) insertImport(imp *importRec) {
	p.imports = slices.DeleteFunc(p.imports, func(old *importRec) bool {
		if old.off < imp.off+imp.size && imp.off < old.off+old.size {
			p.releaseSlot(old)
			return true
		}
		return false
	})
	p.imports = insertSorted(p.imports, imp)
	delete(p.released, imp.ptr)
}

// importAt is the import holding [off, off+n), or nil.
func (p *pool) importAt(off, n uint64) (*importRec, int) {
	i := covering(p.imports, off, n)
	if i < 0 {
		return nil, -1
	}
	return p.imports[i], i
}

// releasedAt reports whether [off, off+n) lies in an import this Device unmapped.
func (p *pool) releasedAt(off, n uint64) bool {
	for ptr, size := range p.released {
		start := uint64(ptr) - p.base
		if off >= start && off+n <= start+size {
			return true
		}
	}
	return false
}

// maxReleased bounds the unmapped imports a pool remembers, so that a long run of
// imports and frees does not grow without end.
const maxReleased = 4096

// freeImport queues the unmapping of an import. When it runs it unmaps whatever import
// is at the pointer then, with every alias of it (FACTS 4): an import of the same
// record made while the free was queued is the same mapping, and goes too. It must be
// ordered after this Device's accesses through the import on other streams
// (ViolationUnorderedFree).
func (d *Device) freeImport(op string, st *stream, p *pool, ptr cudart.DevicePtr) error {
	off := uint64(ptr) - p.base
	imp, _ := p.importAt(off, 1)
	switch {
	case imp != nil && imp.off == off && imp.freeing:
		return violationErr(op, cudart.ErrInvalidValue,
			d.violate(ViolationUseAfterRelease, op, "import %#x is already being unmapped", uint64(ptr)))
	case imp == nil || imp.off != off:
		if imp == nil && p.releasedAt(off, 1) {
			return violationErr(op, cudart.ErrInvalidValue,
				d.violate(ViolationUseAfterRelease, op, "import %#x was already unmapped", uint64(ptr)))
		}
		return fail(op, cudart.ErrInvalidValue)
	}
	imp.freeing = true
	return d.submit(op, st, &task{pool: p, run: func(st *stream, after uint64) error {
		cur, i := p.importAt(off, 1)
		if cur == nil || cur.off != off {
			return nil // superseded by an import of reused memory, which this free does not name
		}
		mine := func(id ident) bool { return id == d.id }
		vs := d.unorderedFree(op, p, cur.entry, st, after, ptr, mine)
		if p.entryHolds(cur) {
			// The exporter's free of the allocation must be ordered after this one.
			p.reg.storeMax(entryOff(cur.entry)+eReleased, now())
		}
		p.releaseSlot(cur)
		p.imports = slices.Delete(p.imports, i, i+1)
		if len(p.released) >= maxReleased {
			for old := range p.released { // forget one: the record is for diagnosis only
				delete(p.released, old)
				break
			}
		}
		p.released[cur.ptr] = cur.size
		if len(vs) > 0 {
			return violationErr(op, 0, vs...)
		}
		return nil
	}})
}
