package pool

import (
	"fmt"
	"runtime"
	"slices"
	"sync"
	"sync/atomic"
	"time"

	"github.com/cudapool/cudapool/cudart"
)

// Completions let a lease end without a stream wait. Lease.End makes the release
// stream wait for the importer's event at once, for every lease: one wait on another
// process's work per share, each a dependency between two processes' GPU work that
// the GPU may have to switch contexts to resolve. But the wait only matters once the
// buffer's memory is freed or reused, which most leases never see: a buffer is shared
// many times between two frees. So a Completion stands for an importer's event whose
// every record follows the one before on one stream; Lease.EndAt ends the lease at
// once and leaves the buffer owing the completion, and the free that needs it asks the
// event then (usually done by then: no wait) and waits for its latest record only if
// it has not completed. A later record covers the importer's free all the same: it
// comes after it on the same stream.

// Completion is an importer's event, recorded after each of its frees, always on one
// in-order stream, so that its latest record covers every earlier one. Its owner keeps
// the event alive until Close has returned.
type Completion struct {
	p  *Pool
	ev cudart.Event
	// gone, if not nil, reports that the importer's process has exited: its frees went
	// with it, and its event is not to be used any more.
	gone func() bool
	// spunOut is when a spin for ev last ended with ev pending (doneSoon).
	spunOut atomic.Int64
	// use is held (shared) by a free while it asks or waits on ev, and by Close
	// (exclusively) while it settles what is owed, so ev outlives every use.
	use sync.RWMutex
	// Guarded by p.mu.
	closed bool
	owers  map[*Buffer]struct{} // buffers whose ended leases ev must still cover
}

// NewCompletion returns the [Completion] of ev, an event on the pool's device, for
// [Lease.EndAt]. ev must be recorded only on one stream, in order, after each free it
// stands for; Close it before destroying ev. gone, if not nil, is asked before each use
// of ev: once the importer's process has exited its imports are gone with it, and its
// event (which it may have died recording) is waited for no more.
func (p *Pool) NewCompletion(ev cudart.Event, gone func() bool) *Completion {
	return &Completion{p: p, ev: ev, gone: gone, owers: map[*Buffer]struct{}{}}
}

// EndAt ends the lease now, as End does, but leaves the wait for the importer's free
// to the buffer's own free or reuse: it waits for c's latest record then, if that has
// not completed. It fails with [ErrLeaseEnded] if the lease has ended, and with
// [ErrInvalidOption] if c belongs to another pool or was closed. If this was the last
// lease of a buffer that Free was called on, EndAt issues the deferred free as End
// does, after c.
func (l *Lease) EndAt(c *Completion) error {
	if l.b == nil {
		return fmt.Errorf("pool: end a lease that Buffer.Lease did not make: %w", ErrLeaseEnded)
	}
	b := l.b
	p := b.pool
	if c == nil || c.p != p {
		return p.errorf("end lease on %v: %w: a completion of another pool", b, ErrInvalidOption)
	}
	if !p.gate.enter() {
		return l.endAfterClose()
	}
	defer p.gate.leave()
	p.mu.Lock()
	switch {
	case l.ended || l.ending:
		p.mu.Unlock()
		return p.errorf("end lease on %v: %w", b, ErrLeaseEnded)
	case c.closed:
		p.mu.Unlock()
		return p.errorf("end lease on %v: %w: its completion was closed", b, ErrInvalidOption)
	}
	if _, ok := c.owers[b]; !ok {
		c.owers[b] = struct{}{}
		p.owe(b, c)
	}
	return p.endLeaseLocked(l)
}

// owe records that b's memory must not be reused or freed before c. Call with p.mu
// held.
func (p *Pool) owe(b *Buffer, c *Completion) {
	if p.owed == nil {
		p.owed = map[*Buffer][]*Completion{}
	}
	p.owed[b] = append(p.owed[b], c)
}

// settleOwed makes s wait for the latest records of the completions b owes that have
// not completed, and forgets them; it reports whether b must also be ordered after
// the release stream (a completion closed meanwhile had the release stream wait for
// it instead). On failure b owes them still. Call inside the gate, without pool.mu.
func (p *Pool) settleOwed(b *Buffer, s cudart.Stream) (viaRelease bool, err error) {
	p.mu.Lock()
	owed := p.owed[b]
	delete(p.owed, b)
	for _, c := range owed {
		delete(c.owers, b)
	}
	p.mu.Unlock()
	for i, c := range owed {
		if err = c.waitOn(s, &viaRelease); err != nil {
			p.mu.Lock()
			for _, c := range owed[i:] {
				if !c.closed {
					c.owers[b] = struct{}{}
					p.owe(b, c)
				}
			}
			p.mu.Unlock()
			return false, p.errorf("free %v: waiting for an importer's completion: %w", b, err)
		}
	}
	return viaRelease, nil
}

// waitOn makes s wait for c's latest record unless it has completed; once c is
// closed it sets viaRelease instead (Close had the release stream wait for it).
func (c *Completion) waitOn(s cudart.Stream, viaRelease *bool) error {
	c.use.RLock()
	defer c.use.RUnlock()
	c.p.mu.Lock()
	closed := c.closed
	c.p.mu.Unlock()
	if closed {
		*viaRelease = true
		return nil
	}
	return c.wait(s)
}

// wait makes s wait for c's latest record unless it has completed. Call with c.use
// held.
func (c *Completion) wait(s cudart.Stream) error {
	if c.gone != nil && c.gone() {
		return nil
	}
	if c.doneSoon() {
		return nil
	}
	return c.p.rt.StreamWaitEvent(c.p.dev, s, c.ev)
}

// settleSpin bounds how long a free asks an importer's event before it makes its
// stream wait for it instead. Measured on the GPU host (2026-11-30, the suite's
// recycled row): a producer stream made to wait on a consumer's release event while
// that consumer went on recording it, behind reads that waited for the producer's
// next writes, held those writes back for whole 300 ms windows; the consumers'
// last records, made as they went idle, complete within moments, so asking a little
// longer leaves that wait out. An event still pending then is waited for on the GPU,
// and asked without waiting for a while after (settleRespite), so that a busy
// importer costs the frees of many buffers one spin, not one each.
const (
	settleSpin    = 2 * time.Millisecond
	settleRespite = 20 * time.Millisecond
)

// doneSoon reports whether c's latest record completes within settleSpin (at once,
// within settleRespite of a spin that ended pending). Call with c.use held.
func (c *Completion) doneSoon() bool {
	rt, dev := c.p.rt, c.p.dev
	now := time.Now()
	spin := now.Sub(time.Unix(0, c.spunOut.Load())) > settleRespite
	for deadline := now.Add(settleSpin); ; {
		done, err := rt.EventQuery(dev, c.ev)
		switch {
		case err == nil && done:
			return true
		case err != nil || !spin || time.Now().After(deadline):
			if spin && err == nil {
				c.spunOut.Store(time.Now().UnixNano())
			}
			return false
		}
		runtime.Gosched()
	}
}

// Close settles what c is still owed, so that its event can be destroyed: with wait,
// the release stream waits for the event's latest record (unless it has completed)
// and the buffers that owed it are ordered after the release stream from then on;
// without (the importer's process has exited, and its frees with it), they owe it
// nothing any more. Close waits for the frees using the event to finish with it. A
// second Close does nothing.
func (c *Completion) Close(wait bool) error {
	c.use.Lock()
	defer c.use.Unlock()
	p := c.p
	p.mu.Lock()
	if c.closed {
		p.mu.Unlock()
		return nil
	}
	c.closed = true
	owers := c.owers
	c.owers = map[*Buffer]struct{}{}
	p.mu.Unlock()
	var err error
	if wait && len(owers) > 0 {
		// The release stream exists (the owers were leased), until the pool's teardown,
		// which takes relMu to destroy it.
		p.relMu.Lock()
		if p.relStream != 0 {
			err = c.wait(p.relStream)
		}
		p.relMu.Unlock()
		if err != nil {
			err = p.errorf("close a completion: waiting for it on the release stream: %w", err)
		}
	}
	p.mu.Lock()
	for b := range owers {
		if i := slices.Index(p.owed[b], c); i >= 0 {
			if p.owed[b] = slices.Delete(p.owed[b], i, i+1); len(p.owed[b]) == 0 {
				delete(p.owed, b)
			}
			b.ordered = b.ordered || wait
		}
	}
	p.mu.Unlock()
	return err
}
