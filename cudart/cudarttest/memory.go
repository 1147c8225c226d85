package cudarttest

import (
	"errors"

	"github.com/cudapool/cudapool/cudart"
)

// A span is device memory a call may touch: the bytes and the allocation's entry,
// whose write mark a write updates.
type span struct {
	p     *pool
	buf   []byte
	entry uint32
}

// access resolves [ptr, ptr+n) for a read or write on st from dev. It fails with
// ErrInvalidValue for memory outside every live allocation or import of this Device
// (a ViolationUseAfterRelease too, if it was freed or unmapped), and with a
// ViolationAccessDenied (and ErrInvalidValue) for an imported pool dev was not
// granted; through a stale import it fails with a ViolationUseAfterRelease alone, as
// the driver would read whatever is there now. An access not ordered after another
// Device's last write is appended to unordered: the call still copies the bytes, as
// the device is immediate, then reports it. d.mu is held.
func (d *Device) access(op string, dev int, ptr cudart.DevicePtr, n uint64, st *stream, write bool, unordered *[]Violation) (span, error) {
	p := d.poolAt(ptr)
	if p == nil || n > p.base+p.size-uint64(ptr) {
		return span{}, fail(op, cudart.ErrInvalidValue)
	}
	off := uint64(ptr) - p.base
	verb := "read"
	if write {
		verb = "write"
	}
	var entry uint32
	if p.imported {
		if flags := p.accessOf(dev); flags == cudart.AccessNone || (write && flags != cudart.AccessReadWrite) {
			return span{}, violationErr(op, cudart.ErrInvalidValue, d.violate(ViolationAccessDenied, op,
				"device %d may not %s imported pool %#x of device %d (flags %d; MemPoolSetAccess in the importer grants it)",
				dev, verb, uintptr(p.handle), p.dev, flags))
		}
		imp, _ := p.importAt(off, n)
		if imp == nil {
			if p.releasedAt(off, n) {
				return span{}, violationErr(op, cudart.ErrInvalidValue, d.violate(ViolationUseAfterRelease, op,
					"%s of %#x+%d through an import already unmapped", verb, uint64(ptr), n))
			}
			return span{}, fail(op, cudart.ErrInvalidValue)
		}
		if imp.stale || !p.entryHolds(imp) {
			why := "the exporter freed it after it was imported"
			if imp.stale {
				why = "it was imported from a stale record (the allocation was already freed)"
			}
			return span{}, violationErr(op, 0, d.violate(ViolationUseAfterRelease, op,
				"%s of %#x+%d through an import, but %s", verb, uint64(ptr), n, why))
		}
		entry = imp.entry
	} else {
		a, _ := p.allocAt(off, n)
		if a == nil {
			if p.freedAt(off, n) {
				return span{}, violationErr(op, cudart.ErrInvalidValue, d.violate(ViolationUseAfterRelease, op,
					"%s of %#x+%d after it was freed", verb, uint64(ptr), n))
			}
			return span{}, fail(op, cudart.ErrInvalidValue)
		}
		entry = a.entry
	}
	eo := entryOff(entry)
	epoch := p.reg.load(eo + eWriteEpoch)
	if writer := ident(p.reg.load(eo + eWriter)); writer != d.id && epoch > d.orderedAfter(st) {
		kind := ViolationUnorderedRead
		if write {
			kind = ViolationUnorderedWrite
		}
		*unordered = append(*unordered, d.violate(kind, op,
			"%s of %#x+%d on a stream not ordered after %v's write or allocation of it (wait on an event recorded after it)",
			verb, uint64(ptr), n, writer))
	}
	return span{p: p, buf: p.data(off, n), entry: entry}, nil
}

// wrote marks s as written by this Device now.
func (d *Device) wrote(s span) {
	eo := entryOff(s.entry)
	s.p.reg.store(eo+eWriter, uint64(d.id))
	s.p.reg.store(eo+eWriteEpoch, now())
}

// transfer runs one copy or set: it resolves the device ranges, does the work, marks
// the written range and reports unordered accesses. d.mu is taken here.
func (d *Device) transfer(op string, dev int, s cudart.Stream, n uint64, work func(st *stream, unordered *[]Violation) error) error {
	d.mu.Lock()
	defer d.mu.Unlock()
	if err := d.enter(op, dev); err != nil {
		return err
	}
	st, err := d.stream(op, dev, s)
	if err != nil || n == 0 {
		return err
	}
	var unordered []Violation
	err = work(st, &unordered)
	if len(unordered) > 0 {
		return errors.Join(err, violationErr(op, 0, unordered...))
	}
	return err
}

func (d *Device) MemcpyHtoDAsync(dev int, dst cudart.DevicePtr, src []byte, s cudart.Stream) error {
	const op = "cudaMemcpyAsync"
	return d.transfer(op, dev, s, uint64(len(src)), func(st *stream, unordered *[]Violation) error {
		to, err := d.access(op, dev, dst, uint64(len(src)), st, true, unordered)
		if err != nil {
			return err
		}
		copy(to.buf, src)
		d.wrote(to)
		return nil
	})
}

func (d *Device) MemcpyDtoHAsync(dev int, dst []byte, src cudart.DevicePtr, s cudart.Stream) error {
	const op = "cudaMemcpyAsync"
	return d.transfer(op, dev, s, uint64(len(dst)), func(st *stream, unordered *[]Violation) error {
		from, err := d.access(op, dev, src, uint64(len(dst)), st, false, unordered)
		if err != nil {
			return err
		}
		copy(dst, from.buf)
		return nil
	})
}

func (d *Device) MemcpyDtoDAsync(dev int, dst, src cudart.DevicePtr, n uint64, s cudart.Stream) error {
	const op = "cudaMemcpyAsync"
	return d.transfer(op, dev, s, n, func(st *stream, unordered *[]Violation) error {
		from, err := d.access(op, dev, src, n, st, false, unordered)
		if err != nil {
			return err
		}
		to, err := d.access(op, dev, dst, n, st, true, unordered)
		if err != nil {
			return err
		}
		copy(to.buf, from.buf)
		d.wrote(to)
		return nil
	})
}

func (d *Device) MemsetAsync(dev int, dst cudart.DevicePtr, value byte, n uint64, s cudart.Stream) error {
	const op = "cudaMemsetAsync"
	return d.transfer(op, dev, s, n, func(st *stream, unordered *[]Violation) error {
		to, err := d.access(op, dev, dst, n, st, true, unordered)
		if err != nil {
			return err
		}
		for i := range to.buf {
			to.buf[i] = value
		}
		d.wrote(to)
		return nil
	})
}
