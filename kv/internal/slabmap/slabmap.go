// Package slabmap owns one process's mapping of a KV slab on the VMM route, for the
// owner (kv/owner) and every replica (kv/replica) alike: a reservation of addresses per
// region of a [kv.SlabLayout], reserved once for the slab's bound, and the slab's
// chunks mapped into them in index order, in place, so that a growth moves nothing
// mapped before it. It is the one place that imports chunks' descriptors and maps them
// where the layout places them.
package slabmap

import (
	"errors"
	"fmt"
	"sync"

	"github.com/cudapool/cudapool/cudart"
	"github.com/cudapool/cudapool/kv"
	"github.com/cudapool/cudapool/vmm"
)

// ErrOrder means chunks came out of order: not the next one the map lacks, or past
// the layout's last.
var ErrOrder = errors.New("kv/slabmap: chunks out of order")

// Map is a slab's mapping in this process. Its methods are safe for concurrent use;
// Bases and Layout may be read at any time.
type Map struct {
	rt     cudart.Runtime
	dev    int
	layout kv.SlabLayout
	res    []*vmm.Reservation // one a region
	bases  []cudart.DevicePtr

	mu     sync.Mutex
	n      int // chunks mapped: [0, n)
	closed bool
}

// New reserves the addresses of every region of l on dev (l.ReservedBytes() in all),
// with nothing mapped; opts set who may access the chunks mapped later
// (vmm.WithAccess). l's ChunkBytes must be a multiple of the device's granularity
// (vmm.ErrGranularity). On failure nothing is reserved.
func New(rt cudart.Runtime, dev int, l kv.SlabLayout, opts ...vmm.ReserveOption) (_ *Map, err error) {
	m := &Map{rt: rt, dev: dev, layout: l}
	defer func() {
		if err != nil {
			_ = m.Close() // cleanup: the first error is the one returned
		}
	}()
	for r := range l.Regions() {
		res, err := vmm.Reserve(rt, dev, l.RegionBytes(), opts...)
		if err != nil {
			return nil, fmt.Errorf("kv/slabmap: region %d of %v on device %d: %w", r, l, dev, err)
		}
		m.res = append(m.res, res)
		m.bases = append(m.bases, res.Ptr())
	}
	return m, nil
}

// Layout is the layout the map follows.
func (m *Map) Layout() kv.SlabLayout { return m.layout }

// Bases are the regions' addresses, region r's at Bases()[r]: a tensor's address, for
// kv.SlabLayout.Addr. They are the Map's own: do not modify them.
func (m *Map) Bases() []cudart.DevicePtr { return m.bases }

// Chunks is the number of chunks mapped.
func (m *Map) Chunks() int {
	m.mu.Lock()
	defer m.mu.Unlock()
	return m.n
}

// Mapped is the bytes mapped.
func (m *Map) Mapped() uint64 { return m.layout.MappedBytes(m.Chunks()) }

// Grow maps chunks as the next ones, Chunks() on, each where the layout places it.
// The caller keeps them (and may close them once Grow returns: a mapping keeps its
// memory). More chunks than the layout has left fail with ErrOrder. On failure the
// map is as it was.
func (m *Map) Grow(chunks ...*vmm.Chunk) error {
	m.mu.Lock()
	defer m.mu.Unlock()
	if m.closed {
		return vmm.ErrClosed
	}
	if m.n+len(chunks) > m.layout.Chunks() {
		return fmt.Errorf("%w: %d chunks mapped of %d, %d more asked", ErrOrder, m.n, m.layout.Chunks(), len(chunks))
	}
	for i, c := range chunks {
		if c.Size() != m.layout.ChunkBytes() {
			return errors.Join(fmt.Errorf("%w: chunk %d is %d bytes, the layout's are %d", kv.ErrGeometry, m.n, c.Size(), m.layout.ChunkBytes()), m.shrinkLocked(i))
		}
		r, _ := m.layout.ChunkPlace(m.n)
		if err := m.res[r].Grow(c); err != nil {
			return errors.Join(fmt.Errorf("kv/slabmap: chunk %d into region %d: %w", m.n, r, err), m.shrinkLocked(i))
		}
		m.n++
	}
	return nil
}

// Import imports the chunks that fds are descriptors of (vmm.Import) as chunks from
// on, and maps them as Grow does; the caller keeps fds. from must be Chunks()
// (ErrOrder). On failure the map is as it was.
func (m *Map) Import(from int, fds []int) error {
	if n := m.Chunks(); from != n {
		return fmt.Errorf("%w: chunk %d comes where chunk %d is next", ErrOrder, from, n)
	}
	chunks := make([]*vmm.Chunk, 0, len(fds))
	defer func() {
		for _, c := range chunks {
			_ = c.Close() // the mapping, if any, keeps the memory
		}
	}()
	for i, fd := range fds {
		c, err := vmm.Import(m.rt, m.dev, fd, m.layout.ChunkBytes())
		if err != nil {
			return fmt.Errorf("kv/slabmap: chunk %d: %w", from+i, err)
		}
		chunks = append(chunks, c)
	}
	return m.Grow(chunks...)
}

// Shrink unmaps the last n chunks. Work that touches them must have completed. On
// failure the chunks it did not unmap stay mapped.
func (m *Map) Shrink(n int) error {
	m.mu.Lock()
	defer m.mu.Unlock()
	if m.closed {
		return vmm.ErrClosed
	}
	if n < 0 || n > m.n {
		return fmt.Errorf("%w: %d chunks mapped, %d to unmap", vmm.ErrNotMapped, m.n, n)
	}
	return m.shrinkLocked(n)
}

func (m *Map) shrinkLocked(n int) error {
	for ; n > 0; n-- {
		r, _ := m.layout.ChunkPlace(m.n - 1)
		if err := m.res[r].Shrink(1); err != nil {
			return fmt.Errorf("kv/slabmap: unmapping chunk %d: %w", m.n-1, err)
		}
		m.n--
	}
	return nil
}

// Close unmaps every chunk and gives back the addresses. Work that touches them must
// have completed. Closing twice is a no-op.
func (m *Map) Close() error {
	m.mu.Lock()
	defer m.mu.Unlock()
	if m.closed {
		return nil
	}
	m.closed = true
	var errs []error
	for r, res := range m.res {
		if err := res.Close(); err != nil {
			errs = append(errs, fmt.Errorf("kv/slabmap: region %d: %w", r, err))
		}
	}
	m.n = 0
	return errors.Join(errs...)
}
