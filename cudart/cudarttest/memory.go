package cudarttest

import (
	"errors"
	"fmt"
	"slices"

	"github.com/cudapool/cudapool/cudart"
)

// A span is device memory a call touches, resolved when the call is made: the pool,
// the offset and length, and the allocation or import it lies in, which must still be
// there when the work runs.
type span struct {
	p     *pool
	off   uint64
	n     uint64
	ptr   cudart.DevicePtr
	a     *alloc     // own memory
	imp   *importRec // imported memory
	entry uint32
	write bool
	h     *hostReg // registered host memory (host.go), instead of p
	// Memory of the VMM route (vmm.go), instead of p: off is in the reservation r,
	// and v is the part in each mapping.
	r *vmmReservation
	v []vmmPiece
}

func (s span) buf() []byte {
	if s.h != nil {
		return s.h.mem[s.off : s.off+s.n : s.off+s.n]
	}
	if s.r != nil {
		return s.r.mem[s.off : s.off+s.n : s.off+s.n]
	}
	return s.p.data(s.off, s.n)
}

// markSet is what touch checks and updates: the marks of an allocation's entry,
// shared by every Device that maps it, per byte range, or those of registered host
// memory. lo and hi bound the bytes an access touches, in the set's own offsets.
type markSet interface {
	overlapping(lo, hi uint64) []mark
	wrote(st *stream, t, lo, hi uint64)
	read(st *stream, t, lo, hi uint64)
}

// access resolves [ptr, ptr+n) for a read or write from dev, as the call is made. It
// fails with ErrInvalidValue for memory outside every live allocation or import of
// this Device (a ViolationUseAfterRelease too, if it was freed or unmapped), and with
// a ViolationAccessDenied (and ErrInvalidValue) for a pool, own or imported, dev was
// not granted; through a stale import it fails with a ViolationUseAfterRelease alone, as
// the driver would read whatever is there now. d.mu is held.
func (d *Device) access(op string, dev int, ptr cudart.DevicePtr, n uint64, write bool) (span, error) {
	if r := d.reservation(ptr, 1); r != nil {
		return d.vmmAccess(op, dev, r, ptr, n, write)
	}
	p := d.poolAt(ptr)
	if p == nil || n > p.base+p.size-uint64(ptr) {
		return span{}, fail(op, cudart.ErrInvalidValue)
	}
	off := uint64(ptr) - p.base
	verb := verbOf(write)
	sp := span{p: p, off: off, n: n, ptr: ptr, write: write}
	if flags := p.accessOf(dev); flags == cudart.AccessNone || (write && flags != cudart.AccessReadWrite) {
		// The driver refuses it with invalid argument: pool memory is reachable only
		// from the devices its pool grants, own pools as imported ones (the GPU probe
		// of FACTS 14 copies into a peer's pool through the owner device only after
		// granting it).
		whose, grant := "pool", "MemPoolSetAccess grants it"
		if p.imported {
			whose, grant = "imported pool", "MemPoolSetAccess in the importer grants it"
		}
		return span{}, violationErr(op, cudart.ErrInvalidValue, d.violate(ViolationAccessDenied, op,
			"device %d may not %s %s %#x of device %d (flags %d; %s)",
			dev, verb, whose, uintptr(p.handle), p.dev, flags, grant))
	}
	if p.imported {
		if err := d.contained(op, dev, sp); err != nil {
			return span{}, err
		}
		imp, _ := p.importAt(off, n)
		if imp == nil || imp.freeing {
			if imp != nil || p.releasedAt(off, n) {
				return span{}, violationErr(op, cudart.ErrInvalidValue, d.violate(ViolationUseAfterRelease, op,
					"%s of %#x+%d through an import already unmapped", verb, uint64(ptr), n))
			}
			return span{}, fail(op, cudart.ErrInvalidValue)
		}
		if v, bad := d.staleImport(op, imp, sp, verb); bad {
			return span{}, violationErr(op, 0, v)
		}
		sp.imp, sp.entry = imp, imp.entry
		return sp, nil
	}
	a, _ := p.allocAt(off, n)
	if a == nil || a.freeing {
		if a != nil || p.freedAt(off, n) {
			return span{}, violationErr(op, cudart.ErrInvalidValue, d.violate(ViolationUseAfterRelease, op,
				"%s of %#x+%d after it was freed", verb, uint64(ptr), n))
		}
		return span{}, fail(op, cudart.ErrInvalidValue)
	}
	sp.a, sp.entry = a, a.entry
	return sp, nil
}

// contained fails an access of sp from dev, as the call is made or as its work runs,
// if sp is imported memory of another device whose exporter has exited: the driver
// reaches a peer's memory over NVLink, and once its owner died the access is contained
// and the context lost (FACTS 14; on the GPU host, copies in flight on the peer's
// stream failed so as the producer was killed). The owner device itself still reads
// it (FACTS 7), and copies through it into a peer's memory all succeeded. d.mu is
// held.
func (d *Device) contained(op string, dev int, sp span) error {
	p := sp.p
	if !p.imported || dev == p.dev || !p.exporterGone() {
		return nil
	}
	d.lost, d.lostOn = true, dev
	e := cudart.NewError(op, cudart.ErrContained)
	e.ContextLost = true
	return &detailError{cuda: e, detail: fmt.Sprintf(
		"device %d %s %#x+%d of pool %#x on device %d, whose exporter has exited: the context is lost",
		dev, verbOf(sp.write), uint64(sp.ptr), sp.n, uintptr(p.handle), p.dev)}
}

func verbOf(write bool) string {
	if write {
		return "write"
	}
	return "read"
}

// staleImport reports a use of an import whose allocation the exporter freed, or that
// was imported from a stale record.
func (d *Device) staleImport(op string, imp *importRec, sp span, verb string) (Violation, bool) {
	if !imp.stale && sp.p.entryHolds(imp) {
		return Violation{}, false
	}
	why := "the exporter freed it after it was imported"
	if imp.stale {
		why = "it was imported from a stale record (the allocation was already freed)"
	}
	return d.violate(ViolationUseAfterRelease, op, "%s of %#x+%d through an import, but %s", verb, uint64(sp.ptr), sp.n, why), true
}

// touch checks, as the work runs on st, that sp's memory is still there and that the
// access is ordered after the accesses of other streams it must follow, and marks it.
// It returns the violations; bad is true if the memory is gone, and the work must not
// touch it. d.mu is held.
func (d *Device) touch(op string, sp span, st *stream, after uint64) (vs []Violation, bad bool) {
	if sp.r != nil {
		return d.touchVMM(op, sp, st, after)
	}
	write := sp.write
	verb := verbOf(write)
	var m markSet
	if sp.h != nil {
		if sp.h.gone {
			return []Violation{d.violate(ViolationUseAfterRelease, op,
				"%s of host memory %#x+%d after its cudaHostUnregister", verb, uint64(sp.ptr), sp.n)}, true
		}
		m = sp.h
	} else if sp.imp != nil {
		if cur, _ := sp.p.importAt(sp.off, sp.n); cur != sp.imp {
			return []Violation{d.violate(ViolationUseAfterRelease, op,
				"%s of %#x+%d through an import that was unmapped before the work ran", verb, uint64(sp.ptr), sp.n)}, true
		}
		if v, stale := d.staleImport(op, sp.imp, sp, verb); stale {
			return []Violation{v}, true
		}
	} else if cur, _ := sp.p.allocAt(sp.off, sp.n); cur != sp.a {
		return []Violation{d.violate(ViolationUseAfterRelease, op,
			"%s of %#x+%d after its free ran", verb, uint64(sp.ptr), sp.n)}, true
	}
	if m == nil {
		m = sp.p.marks(sp.entry, d.id)
	}
	lo, hi := sp.off, sp.off+sp.n
	vs = d.checkMarks(op, sp, m, st, after, lo, hi)
	if write {
		m.wrote(st, now(), lo, hi)
	} else {
		m.read(st, now(), lo, hi)
	}
	return vs, false
}

// checkMarks is the violations of sp's access, on st, of the bytes [lo, hi) of m that
// it is not ordered after. d.mu is held.
func (d *Device) checkMarks(op string, sp span, m markSet, st *stream, after, lo, hi uint64) (vs []Violation) {
	write, verb := sp.write, verbOf(sp.write)
	for _, k := range m.overlapping(lo, hi) {
		switch {
		case k.is(d.id, st) || k.epoch <= after:
		case k.write:
			kind := ViolationUnorderedRead
			if write {
				kind = ViolationUnorderedWrite
			}
			what := "write or allocation"
			if k.epoch == pendingEpoch {
				what = "allocation, which had not run yet"
			}
			vs = append(vs, d.violate(kind, op,
				"%s of %#x+%d on a stream not ordered after %v's %s of it (wait on an event recorded after it)",
				verb, uint64(sp.ptr), sp.n, k.accessor, what))
		case write:
			vs = append(vs, d.violate(ViolationUnorderedWrite, op,
				"write of %#x+%d on a stream not ordered after %v's read of it", uint64(sp.ptr), sp.n, k.accessor))
		}
	}
	return vs
}

// transfer makes one copy or set: resolve resolves the device ranges as the call is
// made; the work queued on the stream checks them when it runs and, unless one is
// gone, calls work. A copy into host memory (sync) waits for its work, as the driver
// does for pageable memory, and returns its violations and the stream's earlier ones.
// d.mu is taken here.
func (d *Device) transfer(op string, dev int, s cudart.Stream, n uint64, sync bool,
	resolve func() ([]span, error), work func(spans []span)) error {
	d.mu.Lock()
	defer d.mu.Unlock()
	if err := d.enter(op, dev); err != nil {
		return err
	}
	st, err := d.stream(op, dev, s)
	if err != nil || n == 0 {
		return err
	}
	spans, err := resolve()
	if err != nil {
		return err
	}
	release := holdMaps(spans)
	o := &task{pool: spans[0].p, run: func(st *stream, after uint64) error {
		defer release()
		return d.runSpans(op, spans, st, after, work)
	}}
	if len(spans) > 1 && spans[1].p != nil && spans[1].p != spans[0].p {
		other := spans[1].p // kept mapped by its own count
		other.pending++
		run := o.run
		o.run = func(st *stream, after uint64) error {
			defer func() { other.pending--; d.dropPool(other) }()
			return run(st, after)
		}
	}
	if sync {
		o.done = make(chan error, 1)
	}
	err = d.submit(op, st, o)
	if !sync {
		return err
	}
	return errors.Join(err, faultsOf(st))
}

// runSpans is the work of a copy or set as it runs on st: it checks each span
// (contained, then touch) and, unless one's memory is gone, calls work. It returns the
// violations found. d.mu is held.
func (d *Device) runSpans(op string, spans []span, st *stream, after uint64, work func(spans []span)) error {
	for _, sp := range spans {
		if sp.h != nil || sp.r != nil {
			continue // host memory, or the VMM route's: its descriptor keeps it (FACTS 26)
		}
		if err := d.contained(op, st.dev, sp); err != nil {
			return err
		}
	}
	var vs []Violation
	gone := false
	for _, sp := range spans {
		v, bad := d.touch(op, sp, st, after)
		vs = append(vs, v...)
		gone = gone || bad
	}
	if !gone {
		work(spans)
	}
	if len(vs) > 0 {
		return violationErr(op, 0, vs...)
	}
	return nil
}

// MemcpyHtoDAsync takes a copy of src at once (so src may be reused when it returns,
// as with pageable memory) and writes it when the stream reaches the copy.
func (d *Device) MemcpyHtoDAsync(dev int, dst cudart.DevicePtr, src []byte, s cudart.Stream) error {
	const op = "cudaMemcpyAsync"
	staged := slices.Clone(src)
	return d.transfer(op, dev, s, uint64(len(src)), false, func() ([]span, error) {
		to, err := d.access(op, dev, dst, uint64(len(src)), true)
		return []span{to}, err
	}, func(sp []span) { copy(sp[0].buf(), staged) })
}

// MemcpyDtoHAsync waits for the work queued on s, then copies: host memory given by Go
// is pageable.
func (d *Device) MemcpyDtoHAsync(dev int, dst []byte, src cudart.DevicePtr, s cudart.Stream) error {
	const op = "cudaMemcpyAsync"
	return d.transfer(op, dev, s, uint64(len(dst)), true, func() ([]span, error) {
		from, err := d.access(op, dev, src, uint64(len(dst)), false)
		return []span{from}, err
	}, func(sp []span) { copy(dst, sp[0].buf()) })
}

func (d *Device) MemcpyDtoDAsync(dev int, dst, src cudart.DevicePtr, n uint64, s cudart.Stream) error {
	const op = "cudaMemcpyAsync"
	return d.transfer(op, dev, s, n, false, func() ([]span, error) {
		from, err := d.access(op, dev, src, n, false)
		if err != nil {
			return nil, err
		}
		to, err := d.access(op, dev, dst, n, true)
		return []span{from, to}, err
	}, func(sp []span) { copy(sp[1].buf(), sp[0].buf()) })
}

func (d *Device) MemsetAsync(dev int, dst cudart.DevicePtr, value byte, n uint64, s cudart.Stream) error {
	const op = "cudaMemsetAsync"
	return d.transfer(op, dev, s, n, false, func() ([]span, error) {
		to, err := d.access(op, dev, dst, n, true)
		return []span{to}, err
	}, func(sp []span) {
		b := sp[0].buf()
		for i := range b {
			b[i] = value
		}
	})
}
