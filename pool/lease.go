package pool

import (
	"fmt"

	"github.com/cudapool/cudapool/cudart"
)

// Lease keeps a shared buffer from going back to the pool: while any lease on a
// buffer lives, Free only marks it. The sharing layer (package producer) takes one per
// grant, before it exports the buffer's record, and ends it with End or EndAt once the
// importer has released its mapping (see "Ordered release" in the package
// documentation). The zero Lease is ended already.
type Lease struct {
	b *Buffer
	// Guarded by the pool's mu.
	ending, ended bool
}

// Buffer is the leased buffer.
func (l *Lease) Buffer() *Buffer { return l.b }

// Lease takes a lease on b, to be ended with the importer's completion. It fails with
// [ErrNotShareable] on a local pool, and with [ErrFreed] once Free was called or the pool
// closed (the error then wraps [ErrClosed] too). Take the lease before exporting the
// buffer's record, so it cannot be freed while being shared.
func (b *Buffer) Lease() (*Lease, error) {
	p := b.pool
	if p == nil {
		return nil, unpooled("lease", b)
	}
	if p.handleType == cudart.HandleTypeNone {
		return nil, p.errorf("lease %v: %w", b, ErrNotShareable)
	}
	if !p.gate.enter() {
		return nil, p.errorf("lease %v: %w: %w", b, ErrFreed, ErrClosed)
	}
	defer p.gate.leave()
	// Made before the first lease, so that every shared buffer's free has a stream.
	if _, err := p.releaseStream(); err != nil {
		return nil, err
	}
	p.mu.Lock()
	defer p.mu.Unlock()
	if b.state != bufLive {
		return nil, b.stateError("lease")
	}
	b.leases++
	if b.leases == 1 {
		p.counts.sharedBuffers++
	}
	b.shared = true
	p.counts.activeLeases++
	return &Lease{b: b}, nil
}

// End ends the lease. releaseEvent is an event on the pool's device, owned by the
// caller, whose last record covers the importer's free of its import; 0 means that
// free is known to have completed (the importer synchronized, or exited). The release
// stream waits for releaseEvent as it is now, so the caller may destroy or re-record it
// as soon as End returns.
//
// If this was the last lease of a buffer that Free was called on, End issues the
// deferred free; if that fails, the lease has still ended, and the error wraps
// [ErrFreeFailed] (the failure is also kept for [Stats] and Close).
//
// Ending a lease twice fails with [ErrLeaseEnded]. If waiting for releaseEvent fails, the
// lease is still live and End may be called again. After Close began, End only ends
// the lease: the buffer has been abandoned and will not be freed.
func (l *Lease) End(releaseEvent cudart.Event) error {
	if l.b == nil {
		return fmt.Errorf("pool: end a lease that Buffer.Lease did not make: %w", ErrLeaseEnded)
	}
	b := l.b
	p := b.pool
	if !p.gate.enter() {
		return l.endAfterClose()
	}
	defer p.gate.leave()
	p.mu.Lock()
	if l.ended || l.ending {
		p.mu.Unlock()
		return p.errorf("end lease on %v: %w", b, ErrLeaseEnded)
	}
	l.ending = true
	p.mu.Unlock()
	if releaseEvent != 0 {
		if err := p.releaseWaitsFor(releaseEvent); err != nil {
			p.mu.Lock()
			l.ending = false
			p.mu.Unlock()
			return p.errorf("end lease on %v: waiting for the importer's release event: %w", b, err)
		}
	}
	p.mu.Lock()
	l.ending = false
	b.ordered = b.ordered || releaseEvent != 0
	return p.endLeaseLocked(l)
}

// endLeaseLocked ends l and, if that was the last lease of a buffer that Free was
// called on, issues its deferred free. Call inside the gate with pool.mu held; it
// returns with pool.mu released.
func (p *Pool) endLeaseLocked(l *Lease) error {
	b := l.b
	p.dropLease(l)
	ev := b.freeEvent
	release := b.leases == 0 && b.state == bufFreeing && ev != 0
	if release {
		b.freeEvent = 0
	}
	p.mu.Unlock()
	if release {
		return p.releaseDeferred(b, ev)
	}
	return nil
}

// dropLease ends l in the counts. Call with pool.mu held.
func (p *Pool) dropLease(l *Lease) {
	l.ended = true
	l.b.leases--
	if l.b.leases == 0 {
		p.counts.sharedBuffers--
	}
	p.counts.activeLeases--
}

// endAfterClose ends a lease once Close has begun. Its completion can no longer be
// waited for, so the buffer is abandoned rather than freed. A lease whose End is still
// in flight (inside the gate, which Close waits for) is that End's to end: ending it
// here too would drop another lease of the buffer.
func (l *Lease) endAfterClose() error {
	p := l.b.pool
	p.mu.Lock()
	defer p.mu.Unlock()
	if l.ended || l.ending {
		return p.errorf("end lease on %v: %w", l.b, ErrLeaseEnded)
	}
	p.dropLease(l)
	l.b.abandoned = true
	return nil
}
