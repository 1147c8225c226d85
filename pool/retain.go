package pool

import (
	"github.com/cudapool/cudapool/cudart"
)

// Retentions: an importer may keep a buffer's memory mapped after its lease ended, so
// that sharing the memory again (a buffer recycled through the cache, WithCache) costs
// no import. The memory then passes from buffer to buffer with its retentions; the
// pool never returns it to the driver while one lives. When it would (a free past the
// cache, Trim, a full pool), it asks each retainer to let go through the revoke
// function given to Retain, and frees the memory once the last retention has ended,
// after the importers' completions.

// Retention is one importer's hold on a buffer's memory past the buffer's leases.
type Retention struct {
	p      *Pool
	set    *retainSet
	revoke func()
	// Guarded by the pool's mu.
	ending, ended bool
}

// retainSet is the retentions of one piece of memory, moving with it from buffer to
// buffer. Guarded by Pool.mu.
type retainSet struct {
	list []*Retention
	// Once revoking, the memory belongs to no buffer and is freed when list empties:
	// ptr and reserved say what, after is 0 or a pool event the release stream waits
	// for first.
	revoking bool
	ptr      cudart.DevicePtr
	reserved uint64
	after    cudart.Event
}

// holds reports whether s has a retention.
func (s *retainSet) holds() bool { return s != nil && len(s.list) > 0 }

// Retain keeps b's memory from going back to the driver until the retention ends,
// across the buffers the memory passes to. It needs a live lease on b: take it before
// ending the lease that the importer's mapping came with. revoke is called (without
// the pool's locks held, and never twice) when the pool wants the memory back: the
// caller then has the importer free its mapping and ends the retention with the
// importer's completion. revoke must not block.
//
// It fails with [ErrNotShareable] on a local pool, [ErrNotLeased] without a live lease,
// and [ErrClosed] after Close.
func (b *Buffer) Retain(revoke func()) (*Retention, error) {
	p := b.pool
	if p == nil {
		return nil, unpooled("retain", b)
	}
	if p.handleType == cudart.HandleTypeNone {
		return nil, p.errorf("retain %v: %w", b, ErrNotShareable)
	}
	if revoke == nil {
		return nil, p.errorf("retain %v: %w: nil revoke", b, ErrInvalidOption)
	}
	if !p.gate.enter() {
		return nil, p.closedError("retain")
	}
	defer p.gate.leave()
	p.mu.Lock()
	defer p.mu.Unlock()
	if b.leases == 0 {
		return nil, p.errorf("retain %v: %w", b, ErrNotLeased)
	}
	if b.retained == nil {
		b.retained = &retainSet{}
	}
	r := &Retention{p: p, set: b.retained, revoke: revoke}
	b.retained.list = append(b.retained.list, r)
	p.counts.retentions++
	return r, nil
}

// End ends the retention once the importer has freed its mapping. releaseEvent is an
// event on the pool's device whose last record covers that free, or 0 if it is known
// to have completed; the release stream waits for it as it is now. If this was the
// last retention of memory the pool is taking back, End frees it; a failure there is
// reported as for [Lease.End] ([ErrFreeFailed]) and the retention has still ended.
//
// Ending a retention twice fails with [ErrLeaseEnded]. If waiting for releaseEvent fails,
// the retention lives on and End may be called again. After Close began, End only
// ends the retention.
func (r *Retention) End(releaseEvent cudart.Event) error {
	p := r.p
	if !p.gate.enter() {
		p.mu.Lock()
		defer p.mu.Unlock()
		if r.ended || r.ending {
			return p.errorf("end retention: %w", ErrLeaseEnded)
		}
		p.dropRetentionLocked(r)
		return nil
	}
	defer p.gate.leave()
	p.mu.Lock()
	if r.ended || r.ending {
		p.mu.Unlock()
		return p.errorf("end retention: %w", ErrLeaseEnded)
	}
	r.ending = true
	p.mu.Unlock()
	if releaseEvent != 0 {
		if err := p.releaseWaitsFor(releaseEvent); err != nil {
			p.mu.Lock()
			r.ending = false
			p.mu.Unlock()
			return p.errorf("end retention: waiting for the importer's release event: %w", err)
		}
	}
	p.mu.Lock()
	r.ending = false
	p.dropRetentionLocked(r)
	set := r.set
	free := set.revoking && len(set.list) == 0
	if free {
		p.unparkLocked(set)
	}
	p.mu.Unlock()
	if free {
		return p.freeRevoked(set.ptr, set.reserved, set.after)
	}
	return nil
}

func (p *Pool) dropRetentionLocked(r *Retention) {
	r.ended = true
	for i, x := range r.set.list {
		if x == r {
			r.set.list = append(r.set.list[:i], r.set.list[i+1:]...)
			break
		}
	}
	p.counts.retentions--
}

// retire returns memory that no buffer or cache holds any more to the driver on the
// release stream, after after (0, or a pool event, given back here): at once if
// nothing retains it, else once the retainers it now asks to let go have. Call inside
// the gate, without pool.mu.
func (p *Pool) retire(set *retainSet, ptr cudart.DevicePtr, reserved uint64, after cudart.Event) error {
	p.mu.Lock()
	if !set.holds() {
		p.mu.Unlock()
		return p.freeRevoked(ptr, reserved, after)
	}
	set.revoking, set.ptr, set.reserved, set.after = true, ptr, reserved, after
	if p.parked == nil {
		p.parked = map[*retainSet]struct{}{}
	}
	p.parked[set] = struct{}{}
	p.counts.revokingBuffers++
	p.counts.revokingBytes += reserved
	revokes := make([]func(), len(set.list))
	for i, r := range set.list {
		revokes[i] = r.revoke
	}
	p.mu.Unlock()
	for _, revoke := range revokes {
		revoke()
	}
	return nil
}

func (p *Pool) unparkLocked(set *retainSet) {
	set.revoking = false
	delete(p.parked, set)
	p.counts.revokingBuffers--
	p.counts.revokingBytes -= set.reserved
}

// freeRevoked frees memory on the release stream after after. A failure is kept as a
// failed free: the memory stays reserved.
func (p *Pool) freeRevoked(ptr cudart.DevicePtr, reserved uint64, after cudart.Event) error {
	rel, err := p.releaseStream()
	if err == nil && after != 0 {
		err = p.rt.StreamWaitEvent(p.dev, rel, after)
	}
	if after != 0 {
		p.putEvent(after)
	}
	if err == nil {
		err = p.rt.FreeAsync(p.dev, ptr, rel)
	}
	if err != nil {
		err = p.errorf("%w: retained memory (%s at %#x): %w", ErrFreeFailed, human(reserved), uintptr(ptr), err)
		p.mu.Lock()
		p.failed = append(p.failed, err)
		p.counts.failedFreeBytes += reserved
		p.mu.Unlock()
		return err
	}
	p.wakeWaiters()
	return nil
}
