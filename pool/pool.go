// Package pool owns cudapool's allocator: stream-ordered CUDA memory pools that a Go
// program allocates from instead of calling cudaMalloc, with the bookkeeping that lets
// other processes share their buffers safely.
//
// A [Pool] stands on a [cudart.Runtime], so it runs on a GPU and on the cudarttest
// software device alike. Alloc and Free are stream-ordered (cudaMallocFromPoolAsync,
// cudaFreeAsync) and safe from many goroutines; [Allocator] is the interface that code
// accepts so that a program can switch between a local pool, an exportable pool and
// the device's default pool without change.
//
// # Granularity
//
// An exportable pool rounds every allocation up to the device's allocation granularity
// (2 MiB on the target GPUs), so each buffer starts and ends on a granule and owns its
// pages: the driver packs smaller allocations below the granularity, and alignment only
// holds when every allocation in the pool is a multiple of it. Alloc checks every
// pointer and fails with [ErrMisaligned] if the driver ever breaks that. [WithMaxSize] is
// rounded the same way. [Stats] report the rounding overhead. A local pool (handle type
// none) does not round.
//
// # The pool is the unit of trust
//
// Importing a pool exposes the whole pool: an importer's kernels can read every
// allocation in it, not only the buffers it was given, in the same granule and in
// others. Rounding keeps buffers from sharing pages; it does not hide one buffer from
// an importer of another. Never put data for different trust domains in one
// exportable pool: make a pool per domain.
//
// # Ordered release
//
// A buffer that other processes imported must not go back to the pool before every
// importer has freed its import and that free has completed. The sharing layer
// (package producer) takes a [Lease] on a buffer ([Buffer.Lease]) before it shares it, and
// ends the lease with the importer's release event ([Lease.End]). Free on a leased buffer only marks it
// (Shared reports it); the real cudaFreeAsync is issued when the last lease ends, on
// the pool's release stream, which first waits for every completion and for the work
// the freeing stream had queued before Free. A lease may leave that wait to the
// buffer's free or reuse, which asks the importer's event then and waits only if it
// has not completed: a buffer shared many times between two frees costs no wait per
// share, and usually none at its free. The leases themselves are not part of this
// package's API.
package pool

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"sync"
	"sync/atomic"

	"github.com/cudapool/cudapool/cudart"
	"github.com/cudapool/cudapool/internal/granularity"
	"github.com/cudapool/cudapool/internal/printable"
)

// Allocator is what code that needs device memory accepts: a *Pool of any kind,
// including the device's default pool ([FromDefault]), or a wrapper or a test double
// that hands out buffers made with [NewBuffer]. A wrapper that passes on a [Pool]'s
// buffers should know that [Buffer.Free] goes to the Pool, not to the wrapper.
type Allocator interface {
	// Alloc returns a buffer of at least size bytes, ready for work queued on s
	// after the call.
	Alloc(ctx context.Context, size uint64, s cudart.Stream) (*Buffer, error)
	// Free returns b to the allocator once the work queued on s before the call
	// has completed.
	Free(b *Buffer, s cudart.Stream) error
	// Device is the ordinal of the device the memory is on.
	Device() int
	// Stats is a snapshot of the allocator's figures; an allocator that does not
	// keep one of them leaves it zero.
	Stats() (Stats, error)
}

var _ Allocator = (*Pool)(nil)

// lastPoolID numbers unnamed pools across the process.
var lastPoolID atomic.Uint64

// idBlock is the buffer IDs a pool has left to hand out, [next, end): numbering a
// buffer is then an increment under the pool's lock, not an atomic operation on a
// counter that every Alloc in the process would share. IDs are unique in the process
// and rise within a pool.
type idBlock struct{ next, end uint64 }

// idBlockSize is how many IDs a pool takes at a time from lastIDBlock.
const idBlockSize = 1 << 16

var lastIDBlock atomic.Uint64

// newIDs takes the next block of IDs; ID 0 is never given.
func newIDs() idBlock {
	start := (lastIDBlock.Add(1) - 1) * idBlockSize
	return idBlock{next: max(start, 1), end: start + idBlockSize}
}

// take returns the next ID, taking a new block when the pool's is used up.
func (ids *idBlock) take() uint64 {
	if ids.next == ids.end {
		*ids = newIDs()
	}
	id := ids.next
	ids.next++
	return id
}

type poolState int

const (
	poolOpen poolState = iota
	poolClosing
	poolClosed
)

// Pool is a CUDA memory pool on one device, with the bookkeeping of its buffers. Its
// methods are safe for concurrent use.
type Pool struct {
	// What every Alloc and Free reads or writes comes first, so that a pair touches
	// few cache lines: the driver calls between them evict the rest.
	rt      cudart.Runtime
	dev     int
	handle  cudart.MemPool
	gran    uint64 // 1 for a local pool
	maxSize uint64
	wait    bool
	// waiting counts Allocs waiting for memory; freeGen counts frees seen by them.
	// Both let Free skip the wake-up when nobody waits.
	waiting atomic.Int32
	gate    gate
	mu      sync.Mutex
	// Guarded by mu.
	cache  cache
	live   []*Buffer // the buffers not yet returned to the driver, each at its slot
	ids    idBlock
	counts counts

	owned      bool // created by New, destroyed by Close
	handleType cudart.HandleType
	name       string
	grans      *granularity.Cache // held until Close; nil for a local pool
	freeGen    atomic.Uint64

	exportMu sync.Mutex // serialises exports (the driver does too) and guards exported
	exported *cudart.ShareableHandle
	// keepAtClose is set when destroying the CUDA pool is known to be unsafe.
	keepAtClose atomic.Bool

	relMu     sync.Mutex // guards relStream; held while creating it
	relStream cudart.Stream

	closing chan struct{} // closed when Close begins; wakes waiting Allocs
	closer  chan struct{} // holds a token while a Close runs

	// Guarded by mu.
	state  poolState
	wake   chan struct{}
	events []cudart.Event // idle events for ordering frees
	failed []error        // deferred frees that failed
	// parked is the memory waiting for its retainers to let go (see retain).
	parked map[*retainSet]struct{}
	// owed is the completions that leases ended by EndAt left each buffer owing
	// (Completion.go).
	owed map[*Buffer][]*Completion
}

// counts are the pool's own figures, guarded by Pool.mu.
type counts struct {
	liveBuffers     int
	bytesRequested  uint64
	bytesReserved   uint64
	bytesPending    uint64 // reserved by Allocs still in the driver; counted against maxSize
	sharedBuffers   int
	activeLeases    int
	deferredFrees   int
	failedFreeBytes uint64
	retentions      int
	revokingBuffers int
	revokingBytes   uint64
}

func newPool(rt cudart.Runtime, dev int, handle cudart.MemPool, name string) *Pool {
	p := &Pool{rt: rt, dev: dev, handle: handle, name: name, gran: 1, gate: newGate(),
		closing: make(chan struct{}), closer: make(chan struct{}, 1)}
	return p
}

// New creates a pool on device. By default it is shareable as a POSIX file
// descriptor; see the options. Before creating anything it asks the device whether it
// supports memory pools and the handle type, and refuses with an error wrapping
// [ErrUnsupportedHandleType] (naming what the device supports) if not. On failure
// nothing is left behind.
func New(rt cudart.Runtime, device int, opts ...Option) (*Pool, error) {
	if rt == nil {
		return nil, fmt.Errorf("pool.New: %w: nil Runtime", ErrInvalidOption)
	}
	cfg := config{handleType: cudart.HandleTypePosixFD}
	for _, o := range opts {
		if o != nil {
			o(&cfg)
		}
	}
	if cfg.name == "" {
		cfg.name = fmt.Sprintf("pool-%d", lastPoolID.Add(1))
	}
	if err := printable.Check(cfg.name, MaxNameLen); err != nil {
		return nil, fmt.Errorf("pool.New: %w: name %w", ErrInvalidOption, err)
	}
	peers, err := checkConfig(&cfg, device)
	if err != nil {
		return nil, fmt.Errorf("pool.New %q: %w", cfg.name, err)
	}
	p := newPool(rt, device, 0, cfg.name)
	p.owned, p.handleType, p.wait, p.cache.limit = true, cfg.handleType, cfg.waitForMemory, cfg.cacheLimit
	if err := p.create(cfg, peers); err != nil {
		return nil, p.errorf("new: %w", err)
	}
	return p, nil
}

// checkConfig validates what does not need the device, and returns the peers
// without duplicates.
func checkConfig(cfg *config, device int) ([]int, error) {
	if device < 0 {
		return nil, fmt.Errorf("%w: device %d", ErrInvalidOption, device)
	}
	switch cfg.handleType {
	case cudart.HandleTypeNone, cudart.HandleTypePosixFD, cudart.HandleTypeFabric:
	default:
		return nil, fmt.Errorf("%w: handle type %v (want none, posix-fd or fabric)", ErrInvalidOption, cfg.handleType)
	}
	var peers []int
	for _, d := range cfg.peers {
		switch {
		case d < 0:
			return nil, fmt.Errorf("%w: peer device %d", ErrInvalidOption, d)
		case d == device:
			return nil, fmt.Errorf("%w: peer device %d is the pool's own device", ErrInvalidOption, d)
		}
		if !slices.Contains(peers, d) {
			peers = append(peers, d)
		}
	}
	return peers, nil
}

// create asks the device, creates the CUDA pool and configures it. On failure it
// destroys what it made.
func (p *Pool) create(cfg config, peers []int) (err error) {
	if err := p.checkDevice(); err != nil {
		return err
	}
	p.maxSize = cfg.maxSize
	if p.handleType != cudart.HandleTypeNone {
		p.grans = granularity.Acquire(p.rt)
		defer func() {
			if err != nil {
				p.grans.Release()
			}
		}()
		if p.gran, err = p.grans.Get(p.dev, p.handleType); err != nil {
			return err
		}
		if p.maxSize, err = granularity.RoundUp(cfg.maxSize, p.gran); err != nil {
			return fmt.Errorf("%w: max size: %w", ErrInvalidOption, err)
		}
	}
	for _, peer := range peers {
		ok, err := p.rt.DeviceCanAccessPeer(peer, p.dev)
		if err != nil {
			return fmt.Errorf("asking whether device %d can access device %d: %w", peer, p.dev, err)
		}
		if !ok {
			return fmt.Errorf("%w: device %d cannot access device %d", ErrNoPeerAccess, peer, p.dev)
		}
	}
	p.handle, err = p.rt.MemPoolCreate(cudart.PoolProps{HandleTypes: p.handleType, Location: cudart.DeviceLocation(p.dev), MaxSize: p.maxSize})
	if err != nil {
		return err
	}
	if err := p.configure(cfg, peers); err != nil {
		if derr := p.rt.MemPoolDestroy(p.dev, p.handle); derr != nil {
			return errors.Join(err, derr)
		}
		return err
	}
	return nil
}

// checkDevice refuses a device without memory pools or without the pool's handle type.
func (p *Pool) checkDevice() error {
	pools, err := p.rt.DeviceAttribute(p.dev, cudart.DevAttrMemoryPoolsSupported)
	if err != nil {
		return fmt.Errorf("asking device %d whether it supports memory pools: %w", p.dev, err)
	}
	if pools == 0 {
		return fmt.Errorf("device %d does not support memory pools: %w", p.dev, cudart.ErrNotSupported)
	}
	if p.handleType == cudart.HandleTypeNone {
		return nil
	}
	mask, err := p.rt.DeviceAttribute(p.dev, cudart.DevAttrMemoryPoolSupportedHandles)
	if err != nil {
		return fmt.Errorf("asking device %d which pool handle types it supports: %w", p.dev, err)
	}
	if cudart.HandleType(mask)&p.handleType == 0 {
		return fmt.Errorf("%w: device %d supports %s, not %v", ErrUnsupportedHandleType, p.dev, describeHandleTypes(mask), p.handleType)
	}
	return nil
}

// describeHandleTypes names the bits of cudaDevAttrMemoryPoolSupportedHandleTypes.
func describeHandleTypes(mask int) string {
	names := []struct {
		bit  int
		name string
	}{{0x1, "posix-fd"}, {0x2, "win32"}, {0x4, "win32-kmt"}, {0x8, "fabric"}}
	s := ""
	for _, n := range names {
		if mask&n.bit != 0 {
			if s != "" {
				s += ", "
			}
			s += n.name
		}
	}
	if s == "" {
		return fmt.Sprintf("no shareable handle type (%#x)", mask)
	}
	return fmt.Sprintf("%s (%#x)", s, mask)
}

func (p *Pool) configure(cfg config, peers []int) error {
	if cfg.releaseThreshold != nil {
		if err := p.rt.MemPoolSetAttribute(p.dev, p.handle, cudart.PoolReleaseThreshold, *cfg.releaseThreshold); err != nil {
			return fmt.Errorf("setting the release threshold: %w", err)
		}
	}
	if len(peers) == 0 {
		return nil
	}
	descs := make([]cudart.AccessDesc, len(peers))
	for i, d := range peers {
		descs[i] = cudart.AccessDesc{Location: cudart.DeviceLocation(d), Flags: cudart.AccessReadWrite}
	}
	if err := p.rt.MemPoolSetAccess(p.dev, p.handle, descs); err != nil {
		return fmt.Errorf("giving devices %v access: %w", peers, err)
	}
	return nil
}

// FromDefault returns the device's default pool as a local [Pool], so that code written
// against [Allocator] can use it. The pool is not owned: Close releases the buffers and
// the bookkeeping but does not destroy the device's default pool. It cannot be shared
// (CUDA's default pools are not exportable).
func FromDefault(rt cudart.Runtime, device int) (*Pool, error) {
	if rt == nil {
		return nil, fmt.Errorf("pool.FromDefault: %w: nil Runtime", ErrInvalidOption)
	}
	if device < 0 {
		return nil, fmt.Errorf("pool.FromDefault: %w: device %d", ErrInvalidOption, device)
	}
	h, err := rt.DeviceGetDefaultMemPool(device)
	if err != nil {
		return nil, fmt.Errorf("pool.FromDefault: device %d: %w", device, err)
	}
	return newPool(rt, device, h, fmt.Sprintf("default-%d", device)), nil
}

// Device is the ordinal of the pool's device.
func (p *Pool) Device() int { return p.dev }

// Name is the pool's name, from [WithName] or made up by [New].
func (p *Pool) Name() string { return p.name }

// HandleType is how the pool can be shared; HandleTypeNone for a local pool.
func (p *Pool) HandleType() cudart.HandleType { return p.handleType }

// Granularity is the unit allocations are rounded to: the device's allocation
// granularity for an exportable pool, 1 for a local one.
func (p *Pool) Granularity() uint64 { return p.gran }

// MaxSize is the bound on the pool's reserved memory after rounding; 0 means the
// driver's bound.
func (p *Pool) MaxSize() uint64 { return p.maxSize }

// Runtime is the runtime the pool calls.
func (p *Pool) Runtime() cudart.Runtime { return p.rt }

// Handle is the CUDA pool. It stays the pool's: do not destroy it.
func (p *Pool) Handle() cudart.MemPool { return p.handle }

func (p *Pool) errorf(format string, args ...any) error {
	return fmt.Errorf("pool %q: "+format, append([]any{p.name}, args...)...)
}

func (p *Pool) closedError(op string) error {
	return p.errorf("%s: %w", op, ErrClosed)
}

// wakeWaiters tells Allocs waiting for memory that some came back.
func (p *Pool) wakeWaiters() {
	if p.waiting.Load() == 0 {
		return
	}
	p.mu.Lock()
	p.freedLocked()
	p.mu.Unlock()
}

// freedLocked is wakeWaiters with pool.mu held.
func (p *Pool) freedLocked() {
	if p.waiting.Load() == 0 {
		return
	}
	p.freeGen.Add(1)
	if p.wake != nil {
		close(p.wake)
		p.wake = nil
	}
}

// waitChannel returns a channel closed at the next free, or retry if a free came
// since gen was read.
func (p *Pool) waitChannel(gen uint64) (wake <-chan struct{}, retry bool) {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.freeGen.Load() != gen {
		return nil, true
	}
	if p.wake == nil {
		p.wake = make(chan struct{})
	}
	return p.wake, false
}
