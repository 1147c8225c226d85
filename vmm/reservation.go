package vmm

import (
	"errors"
	"fmt"
	"sync"

	"github.com/cudapool/cudapool/cudart"
)

// Reservation is a range of device addresses reserved on dev, into which whole chunks
// are mapped one behind the other from its start: the mapped part is contiguous
// memory at Ptr that grows (Grow) and shrinks (Shrink) at its end, in place, the rest
// untouched. Its methods are safe for concurrent use; each holds the Reservation's
// lock across its driver calls, which do not wait for the GPU.
type Reservation struct {
	v    cudart.VMM
	dev  int
	g    uint64
	base cudart.DevicePtr
	size uint64

	mu     sync.Mutex
	closed bool
	maps   []uint64 // the size of each mapped chunk, from base on
	mapped uint64
	access []cudart.AccessDesc
}

// ReserveOption changes what Reserve reserves.
type ReserveOption func(*reserveOptions)

type reserveOptions struct{ access []cudart.AccessDesc }

// WithAccess sets the access every mapping grants: by default, read and write from
// the Reservation's device alone. Each desc names a device (a peer must be able to
// reach it).
func WithAccess(descs ...cudart.AccessDesc) ReserveOption {
	return func(o *reserveOptions) { o.access = append([]cudart.AccessDesc(nil), descs...) }
}

// Reserve reserves size bytes of device addresses on dev, a multiple of Granularity
// (ErrGranularity), with nothing mapped. On failure nothing is reserved.
func Reserve(rt cudart.Runtime, dev int, size uint64, opts ...ReserveOption) (*Reservation, error) {
	o := reserveOptions{access: []cudart.AccessDesc{{Location: cudart.DeviceLocation(dev), Flags: cudart.AccessReadWrite}}}
	for _, opt := range opts {
		if opt != nil {
			opt(&o)
		}
	}
	if len(o.access) == 0 {
		return nil, errors.New("vmm: WithAccess names no device")
	}
	v, g, err := vmmOf(rt, dev, cudart.HandleTypePosixFD)
	if err != nil {
		return nil, err
	}
	if err := granular("reservation", size, g); err != nil {
		return nil, err
	}
	base, err := v.MemAddressReserve(dev, size, 0)
	if err != nil {
		return nil, fmt.Errorf("vmm: reserve %d bytes on device %d: %w", size, dev, err)
	}
	return &Reservation{v: v, dev: dev, g: g, base: base, size: size, access: o.access}, nil
}

// Ptr is the device address of the reservation's start, where the mapped part
// begins; it never moves.
func (r *Reservation) Ptr() cudart.DevicePtr { return r.base }

// Reserved is the reservation's size: how far the mapped part can grow.
func (r *Reservation) Reserved() uint64 { return r.size }

// Mapped is the size of the mapped part, [Ptr, Ptr+Mapped).
func (r *Reservation) Mapped() uint64 {
	r.mu.Lock()
	defer r.mu.Unlock()
	return r.mapped
}

// Chunks is how many chunks are mapped.
func (r *Reservation) Chunks() int {
	r.mu.Lock()
	defer r.mu.Unlock()
	return len(r.maps)
}

// Grow maps each chunk whole, in order, behind the mapped part, and grants each
// mapping the Reservation's access. The bytes and addresses already mapped do not
// change. The chunks may be closed afterwards: a mapping keeps the memory. On
// success Mapped has grown by the chunks' sizes; on failure (ErrFull where they do
// not fit, ErrClosed, or the driver's error) what this call mapped is unmapped
// again, and the Reservation is as it was.
func (r *Reservation) Grow(chunks ...*Chunk) error {
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.closed {
		return ErrClosed
	}
	var total uint64
	for _, c := range chunks {
		total += c.size
	}
	if total > r.size-r.mapped {
		return fmt.Errorf("%w: %d bytes mapped of %d reserved, %d more asked", ErrFull, r.mapped, r.size, total)
	}
	before := len(r.maps)
	for i, c := range chunks {
		if err := r.mapOne(c); err != nil {
			undo := r.unmapLast(len(r.maps) - before)
			return errors.Join(fmt.Errorf("vmm: grow by chunk %d of %d: %w", i, len(chunks), err), undo)
		}
	}
	return nil
}

// mapOne maps c behind the mapped part and grants it access. r.mu is held.
func (r *Reservation) mapOne(c *Chunk) error {
	at := r.base + cudart.DevicePtr(r.mapped)
	err := c.with(func(h cudart.MemHandle) error {
		if err := granular("chunk", c.size, r.g); err != nil {
			return err
		}
		return r.v.MemMap(r.dev, at, c.size, 0, h)
	})
	if err != nil {
		return err
	}
	if err := r.v.MemSetAccess(r.dev, at, c.size, r.access); err != nil {
		return errors.Join(err, r.v.MemUnmap(r.dev, at, c.size))
	}
	r.maps = append(r.maps, c.size)
	r.mapped += c.size
	return nil
}

// unmapLast unmaps the last n mappings. r.mu is held.
func (r *Reservation) unmapLast(n int) error {
	for ; n > 0; n-- {
		size := r.maps[len(r.maps)-1]
		if err := r.v.MemUnmap(r.dev, r.base+cudart.DevicePtr(r.mapped-size), size); err != nil {
			return fmt.Errorf("vmm: unmap %d bytes at offset %d: %w", size, r.mapped-size, err)
		}
		r.maps = r.maps[:len(r.maps)-1]
		r.mapped -= size
	}
	return nil
}

// Shrink unmaps the last n mapped chunks; the rest stays as it is, at the same
// addresses. Work queued that touches them must have run. Their memory lives on
// where a descriptor or another mapping of it remains. It fails with ErrNotMapped,
// changing nothing, where fewer than n are mapped; where the driver fails midway,
// the chunks behind the failing one stay unmapped and Mapped says what is left.
func (r *Reservation) Shrink(n int) error {
	r.mu.Lock()
	defer r.mu.Unlock()
	switch {
	case r.closed:
		return ErrClosed
	case n < 0 || n > len(r.maps):
		return fmt.Errorf("%w: %d mapped, %d asked", ErrNotMapped, len(r.maps), n)
	}
	return r.unmapLast(n)
}

// SetAccess replaces the access every mapping grants, those mapped now and those
// Grow maps later. On failure the mappings' access may be set in part: call it again.
func (r *Reservation) SetAccess(descs ...cudart.AccessDesc) error {
	if len(descs) == 0 {
		return errors.New("vmm: SetAccess names no device")
	}
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.closed {
		return ErrClosed
	}
	var off uint64
	for _, size := range r.maps {
		if err := r.v.MemSetAccess(r.dev, r.base+cudart.DevicePtr(off), size, descs); err != nil {
			return fmt.Errorf("vmm: set access at offset %d: %w", off, err)
		}
		off += size
	}
	r.access = append([]cudart.AccessDesc(nil), descs...)
	return nil
}

// Close unmaps every chunk and gives the addresses back. Work queued that touches
// them must have run. Closing twice is a no-op; on failure the Reservation is closed
// all the same, and what could not be unmapped stays reserved until the process
// exits.
func (r *Reservation) Close() error {
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.closed {
		return nil
	}
	r.closed = true
	if err := r.unmapLast(len(r.maps)); err != nil {
		return err
	}
	if err := r.v.MemAddressFree(r.dev, r.base, r.size); err != nil {
		return fmt.Errorf("vmm: free %d reserved bytes: %w", r.size, err)
	}
	return nil
}
