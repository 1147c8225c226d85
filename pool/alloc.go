package pool

import (
	"context"
	"errors"
	"fmt"

	"github.com/cudapool/cudapool/cudart"
	"github.com/cudapool/cudapool/internal/granularity"
)

// remember adds b to the live buffers and the counts, numbering it the first time;
// forget takes it out, moving the last live buffer into its slot. Call with pool.mu
// held.
func (p *Pool) remember(b *Buffer) {
	if b.id == 0 {
		b.id = p.ids.take()
	}
	b.slot = len(p.live)
	p.live = append(p.live, b)
	p.counts.liveBuffers++
	p.counts.bytesRequested += b.size
	p.counts.bytesReserved += b.reserved
}

func (p *Pool) forget(b *Buffer) {
	last := len(p.live) - 1
	moved := p.live[last]
	p.live[b.slot], moved.slot = moved, b.slot
	p.live[last] = nil
	p.live = p.live[:last]
	p.counts.liveBuffers--
	p.counts.bytesRequested -= b.size
	p.counts.bytesReserved -= b.reserved
}

// Alloc returns a buffer of at least size bytes, rounded up to the pool's granularity,
// ready for work queued on s after the call. On failure nothing is allocated.
//
// With [WithCache], a buffer freed on s that fits is taken from the cache first, without
// calling the driver; it may hold up to a quarter more than the granularity asks for
// (Reserved says how much), and an exportable one keeps its export record.
//
// A full pool fails with an error that wraps [cudart.ErrOutOfMemory] and says how much
// the pool has reserved and in use, after it returned its cache to the driver and
// tried again; with [WaitForMemory], Alloc instead waits for a Free in this process
// and tries again until ctx ends (the error then wraps both ctx's error and
// cudart.ErrOutOfMemory). A request that can never fit, larger than [WithMaxSize] or
// than the device's memory, fails at once with cudart.ErrOutOfMemory, waiting or not.
// A pointer that is not aligned to the granularity is freed
// and reported with [ErrMisaligned].
func (p *Pool) Alloc(ctx context.Context, size uint64, s cudart.Stream) (*Buffer, error) {
	if err := ctx.Err(); err != nil {
		return nil, p.errorf("alloc %s: %w", human(size), err)
	}
	if size == 0 {
		return nil, p.errorf("alloc: %w", ErrZeroSize)
	}
	reserved, err := granularity.RoundUp(size, p.gran)
	if err != nil {
		return nil, p.errorf("alloc %s: %w", human(size), err)
	}
	if p.maxSize != 0 && reserved > p.maxSize {
		return nil, p.errorf("alloc %s (%s after rounding): %w: larger than the pool's max size %s",
			human(size), human(reserved), cudart.ErrOutOfMemory, human(p.maxSize))
	}
	b := &Buffer{pool: p, size: size, reserved: reserved}
	err = p.allocOnce(b, s)
	if err != nil && errors.Is(err, cudart.ErrOutOfMemory) {
		if never := p.neverFits(size, reserved); never != nil {
			return nil, never
		}
		if p.wait {
			err = p.allocWaiting(ctx, b, s)
		}
	}
	if err != nil {
		return nil, err
	}
	return b, nil
}

// allocOnce fills b from the cache or the driver, returning the cache to the driver
// and trying once more if the pool is full.
func (p *Pool) allocOnce(b *Buffer, s cudart.Stream) error {
	if !p.gate.enter() {
		return p.closedError("alloc " + human(b.size))
	}
	defer p.gate.leave()
	// The cache holds no buffer above its limit: a larger one is a miss without a
	// look (or a lock).
	if b.reserved <= p.cache.limit {
		if hit, err := p.allocCached(b, s); hit {
			return err
		}
	}
	miss := p.cache.limit != 0
	err := p.allocDriver(b, s, miss)
	if err != nil && errors.Is(err, cudart.ErrOutOfMemory) && p.holdsCache() {
		_, _, _ = p.trim(func(cudart.Stream) bool { return true }, false) // failures are kept for Stats and Close
		err = p.allocDriver(b, s, false)
	}
	return err
}

// allocDriver asks the driver for b's memory, counting a cache miss if miss is set
// (under the lock it takes anyway). Call inside the gate.
func (p *Pool) allocDriver(b *Buffer, s cudart.Stream, miss bool) error {
	size, reserved := b.size, b.reserved
	claimed := p.maxSize != 0
	if claimed {
		err := p.claim(size, reserved, miss)
		miss = false // counted
		if err != nil {
			return err
		}
	}
	ptr, err := p.rt.MallocFromPoolAsync(p.dev, reserved, p.handle, s)
	if err == nil && !granularity.IsAligned(uint64(ptr), p.gran) {
		err = p.errorf("alloc %s: %w: %#x is %s into a %s granule",
			human(reserved), ErrMisaligned, uintptr(ptr), human(uint64(ptr)%p.gran), human(p.gran))
		if ferr := p.rt.FreeAsync(p.dev, ptr, s); ferr != nil {
			err = errors.Join(err, p.errorf("freeing the misaligned pointer: %w", ferr))
		}
	} else if err != nil {
		if errors.Is(err, cudart.ErrOutOfMemory) {
			err = p.fullError(size, reserved, err)
		} else {
			err = p.errorf("alloc %s: %w", human(reserved), err)
		}
	}
	if err == nil {
		b.ptr = ptr
	}
	if err == nil || claimed || miss {
		p.mu.Lock()
		if claimed {
			p.counts.bytesPending -= reserved
		}
		if miss {
			p.cache.misses++
		}
		if err == nil {
			p.remember(b)
		}
		p.mu.Unlock()
	}
	return err
}

// claim counts reserved bytes against the pool's max size before the driver is asked.
// The driver's own cap is looser than the maxSize it was given (on driver 580 a 16 MiB
// pool handed out nine 2 MiB buffers), so the pool keeps the bound itself: its buffers
// never hold more than MaxSize bytes. It counts a cache miss if miss is set. Call
// inside the gate; allocDriver gives the claim back when the driver answered.
func (p *Pool) claim(size, reserved uint64, miss bool) error {
	p.mu.Lock()
	if miss {
		p.cache.misses++
	}
	held := p.counts.bytesReserved + p.counts.bytesPending + p.cache.bytes
	fits := held <= p.maxSize && reserved <= p.maxSize-held
	if fits {
		p.counts.bytesPending += reserved
	}
	p.mu.Unlock()
	if !fits {
		return p.fullError(size, reserved, cudart.NewError("cudaMallocFromPoolAsync", cudart.ErrOutOfMemory))
	}
	return nil
}

// fullError says how full the pool is. Call inside the gate.
func (p *Pool) fullError(size, reserved uint64, cause error) error {
	p.mu.Lock()
	c := p.counts
	p.mu.Unlock()
	used, uerr := p.rt.MemPoolGetAttribute(p.dev, p.handle, cudart.PoolUsedMemCurrent)
	res, rerr := p.rt.MemPoolGetAttribute(p.dev, p.handle, cudart.PoolReservedMemCurrent)
	driver := fmt.Sprintf("driver: %s reserved, %s in use", human(res), human(used))
	if uerr != nil || rerr != nil {
		driver = "driver's figures unavailable"
	}
	limit := "no max size"
	if p.maxSize != 0 {
		limit = "max size " + human(p.maxSize)
	}
	return p.errorf("alloc %s (%s after rounding): pool full (%s; %s; %d live buffers hold %s): %w",
		human(size), human(reserved), driver, limit, c.liveBuffers, human(c.bytesReserved), cause)
}

// neverFits says, after the driver refused reserved bytes, whether no Free could ever
// make room: the request is larger than the device's memory. It returns nil where it
// might fit later (or the device's size is not known).
func (p *Pool) neverFits(size, reserved uint64) error {
	_, total, err := p.rt.MemGetInfo(p.dev)
	if err != nil || reserved <= total {
		return nil
	}
	return p.errorf("alloc %s (%s after rounding): %w: larger than the device's %s",
		human(size), human(reserved), cudart.ErrOutOfMemory, human(total))
}

// allocWaiting retries a full pool's allocation of b after each Free until it
// succeeds, ctx ends or the pool closes.
func (p *Pool) allocWaiting(ctx context.Context, b *Buffer, s cudart.Stream) error {
	// Counted before the next try, so a Free that lands after that try sees a waiter.
	p.waiting.Add(1)
	defer p.waiting.Add(-1)
	for {
		gen := p.freeGen.Load()
		err := p.allocOnce(b, s)
		if !errors.Is(err, cudart.ErrOutOfMemory) {
			return err
		}
		wake, retry := p.waitChannel(gen)
		if retry {
			continue
		}
		select {
		case <-wake:
		case <-ctx.Done():
			return fmt.Errorf("%w; gave up waiting for memory: %w", err, ctx.Err())
		case <-p.closing:
			return p.closedError("alloc " + human(b.size) + ": waiting for memory")
		}
	}
}

// Free returns b to the pool once the work queued on s before the call has
// completed. Free of a buffer that was never leased puts it in the cache ([WithCache])
// if the cache has room, calling nothing, and is otherwise one cudaFreeAsync on s.
//
// If b has live leases, Free records the point reached on s and returns nil at once;
// the real free is issued when the last lease ends, on the release stream, after the
// importers' completions and that point (or the buffer goes to the cache, for the
// next Alloc on s to take after them). A buffer that was leased before but has no live
// leases is freed on the release stream too, after that point, so that the free also
// follows every completion already waited for; or s waits for those completions and
// the buffer goes to the cache.
//
// Freeing a buffer twice fails with [ErrFreed], a buffer of another pool with
// [ErrForeignBuffer], and after Close with [ErrClosed]; none of them changes anything.
// If CUDA fails, b stays live and Free may be called again.
func (p *Pool) Free(b *Buffer, s cudart.Stream) error {
	if b == nil || b.pool != p {
		return p.errorf("free %v: %w", b, ErrForeignBuffer)
	}
	if !p.gate.enter() {
		return p.closedError(fmt.Sprintf("free %v", b))
	}
	defer p.gate.leave()
	p.mu.Lock()
	switch {
	case b.state != bufLive:
		err := b.stateError("free")
		p.mu.Unlock()
		return err
	case b.leases > 0:
		b.state = bufFreeing
		p.counts.deferredFrees++
		p.mu.Unlock()
		return p.deferFree(b, s)
	case b.shared:
		b.state = bufFreeing
		p.mu.Unlock()
		return p.freeShared(b, s)
	case p.claimCacheLocked(s, b.reserved):
		p.cacheLocked(b, s, 0)
		p.mu.Unlock()
		return nil
	case b.retained != nil:
		// Retained once: its free follows the retentions' completions, which the
		// release stream waited for.
		b.state = bufFreeing
		p.mu.Unlock()
		return p.freeRetained(b, s)
	}
	b.state = bufFreed
	p.forget(b)
	p.mu.Unlock()
	if err := p.rt.FreeAsync(p.dev, b.ptr, s); err != nil {
		p.mu.Lock()
		b.state = bufLive
		p.remember(b)
		p.mu.Unlock()
		return p.errorf("free %v: %w", b, err)
	}
	p.wakeWaiters()
	return nil
}
