package pool

import (
	"context"
	"errors"
	"fmt"

	"github.com/cudapool/cudapool/cudart"
	"github.com/cudapool/cudapool/internal/granularity"
)

// remember adds b to the live ring and the counts; forget takes it out. Call with
// pool.mu held.
func (p *Pool) remember(b *Buffer) {
	b.prev, b.next = &p.live, p.live.next
	p.live.next.prev = b
	p.live.next = b
	p.counts.liveBuffers++
	p.counts.bytesRequested += b.size
	p.counts.bytesReserved += b.reserved
}

func (p *Pool) forget(b *Buffer) {
	b.prev.next, b.next.prev = b.next, b.prev
	b.prev, b.next = nil, nil
	p.counts.liveBuffers--
	p.counts.bytesRequested -= b.size
	p.counts.bytesReserved -= b.reserved
}

// Alloc returns a buffer of at least size bytes, rounded up to the pool's granularity,
// ready for work queued on s after the call. On failure nothing is allocated.
//
// A full pool fails with an error that wraps cudart.ErrOutOfMemory and says how much
// the pool has reserved and in use; with WithWaitForMemory, Alloc instead waits for a
// Free in this process and tries again until ctx ends (the error then wraps both
// ctx's error and cudart.ErrOutOfMemory). A pointer that is not aligned to the
// granularity is freed and reported with ErrMisaligned.
func (p *Pool) Alloc(ctx context.Context, size uint64, s cudart.Stream) (*Buffer, error) {
	if err := ctx.Err(); err != nil {
		return nil, p.errorf("alloc %d bytes: %w", size, err)
	}
	if size == 0 {
		return nil, p.errorf("alloc: %w", ErrZeroSize)
	}
	reserved, err := granularity.RoundUp(size, p.gran)
	if err != nil {
		return nil, p.errorf("alloc %d bytes: %w", size, err)
	}
	b, err := p.allocOnce(size, reserved, s)
	if p.wait && errors.Is(err, cudart.ErrOutOfMemory) {
		return p.allocWaiting(ctx, size, reserved, s)
	}
	return b, err
}

// allocOnce tries once to allocate.
func (p *Pool) allocOnce(size, reserved uint64, s cudart.Stream) (*Buffer, error) {
	if !p.gate.enter() {
		return nil, p.closedError(fmt.Sprintf("alloc %d bytes", size))
	}
	defer p.gate.leave()
	claimed := p.maxSize != 0
	if claimed {
		if err := p.claim(size, reserved); err != nil {
			return nil, err
		}
	}
	ptr, err := p.rt.MallocFromPoolAsync(p.dev, reserved, p.handle, s)
	if err == nil && !granularity.IsAligned(uint64(ptr), p.gran) {
		err = p.errorf("alloc %d bytes: %w: %#x is %d bytes into a %d-byte granule",
			reserved, ErrMisaligned, uintptr(ptr), uint64(ptr)%p.gran, p.gran)
		if ferr := p.rt.FreeAsync(p.dev, ptr, s); ferr != nil {
			err = errors.Join(err, p.errorf("freeing the misaligned pointer: %w", ferr))
		}
	} else if err != nil {
		if errors.Is(err, cudart.ErrOutOfMemory) {
			err = p.fullError(size, reserved, err)
		} else {
			err = p.errorf("alloc %d bytes: %w", reserved, err)
		}
	}
	if err != nil {
		if claimed {
			p.mu.Lock()
			p.counts.bytesPending -= reserved
			p.mu.Unlock()
		}
		return nil, err
	}
	b := &Buffer{pool: p, ptr: ptr, size: size, reserved: reserved, id: lastBufferID.Add(1)}
	p.mu.Lock()
	if claimed {
		p.counts.bytesPending -= reserved
	}
	p.remember(b)
	p.mu.Unlock()
	return b, nil
}

// claim counts reserved bytes against the pool's max size before the driver is asked.
// The driver's own cap is looser than the maxSize it was given (on driver 580 a 16 MiB
// pool handed out nine 2 MiB buffers), so the pool keeps the bound itself: its buffers
// never hold more than MaxSize bytes. Call inside the gate; allocOnce gives the claim
// back when the driver answered.
func (p *Pool) claim(size, reserved uint64) error {
	p.mu.Lock()
	held := p.counts.bytesReserved + p.counts.bytesPending
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
	driver := fmt.Sprintf("driver: %d bytes reserved, %d in use", res, used)
	if uerr != nil || rerr != nil {
		driver = "driver's figures unavailable"
	}
	limit := "no max size"
	if p.maxSize != 0 {
		limit = fmt.Sprintf("max size %d", p.maxSize)
	}
	return p.errorf("alloc %d bytes (%d after rounding): pool full (%s; %s; %d live buffers hold %d bytes): %w",
		size, reserved, driver, limit, c.liveBuffers, c.bytesReserved, cause)
}

// allocWaiting retries a full pool's allocation after each Free until it succeeds,
// ctx ends or the pool closes.
func (p *Pool) allocWaiting(ctx context.Context, size, reserved uint64, s cudart.Stream) (*Buffer, error) {
	// Counted before the next try, so a Free that lands after that try sees a waiter.
	p.waiting.Add(1)
	defer p.waiting.Add(-1)
	for {
		gen := p.freeGen.Load()
		b, err := p.allocOnce(size, reserved, s)
		if !errors.Is(err, cudart.ErrOutOfMemory) {
			return b, err
		}
		wake, retry := p.waitChannel(gen)
		if retry {
			continue
		}
		select {
		case <-wake:
		case <-ctx.Done():
			return nil, fmt.Errorf("%w; gave up waiting for memory: %w", err, ctx.Err())
		case <-p.closing:
			return nil, p.closedError(fmt.Sprintf("alloc %d bytes: waiting for memory", size))
		}
	}
}

// Free returns b to the pool once the work queued on s before the call has
// completed. Free of a buffer that was never leased is one cudaFreeAsync on s.
//
// If b has live leases, Free records the point reached on s and returns nil at once;
// the real free is issued when the last lease ends, on the release stream, after the
// importers' completions and that point. A buffer that was leased before but has no
// live leases is freed on the release stream too, after that point, so that the free
// also follows every completion already waited for.
//
// Freeing a buffer twice fails with ErrFreed, a buffer of another pool with
// ErrForeignBuffer, and after Close with ErrClosed; none of them changes anything.
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
