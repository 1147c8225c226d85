package pool

import (
	"errors"
	"fmt"

	"github.com/cudapool/cudapool/cudart"
)

// The deferred-free engine: a shared buffer goes back to the driver on the pool's
// release stream, after its importers' completions and the work its freeing stream had
// queued before Free.

// releaseStream returns the stream deferred and shared frees are issued on, creating
// it the first time.
func (p *Pool) releaseStream() (cudart.Stream, error) {
	p.relMu.Lock()
	defer p.relMu.Unlock()
	if p.relStream == 0 {
		s, err := p.rt.StreamCreate(p.dev, cudart.StreamNonBlocking)
		if err != nil {
			return 0, p.errorf("creating the release stream: %w", err)
		}
		p.relStream = s
	}
	return p.relStream, nil
}

// takeEvent returns an idle event for ordering a free; putEvent gives it back. An
// event may be reused as soon as a stream has been made to wait on it: the wait
// captures the event's work when it is issued.
func (p *Pool) takeEvent() (cudart.Event, error) {
	p.mu.Lock()
	if n := len(p.events); n > 0 {
		e := p.events[n-1]
		p.events = p.events[:n-1]
		p.mu.Unlock()
		return e, nil
	}
	p.mu.Unlock()
	e, err := p.rt.EventCreate(p.dev, cudart.EventDisableTiming)
	if err != nil {
		return 0, p.errorf("creating an event: %w", err)
	}
	return e, nil
}

func (p *Pool) putEvent(e cudart.Event) {
	p.mu.Lock()
	p.events = append(p.events, e)
	p.mu.Unlock()
}

// recordOn returns an event recorded on s, capturing the work queued on s so far.
func (p *Pool) recordOn(s cudart.Stream) (cudart.Event, error) {
	e, err := p.takeEvent()
	if err != nil {
		return 0, err
	}
	if err := p.rt.EventRecord(p.dev, e, s); err != nil {
		p.putEvent(e)
		return 0, p.errorf("recording an event on stream %#x: %w", uintptr(s), err)
	}
	return e, nil
}

// deferFree records the point reached on s for a leased buffer being freed, and
// issues the free if its last lease ended meanwhile. Call inside the gate, with
// b.state already bufFreeing and counted as a deferred free.
func (p *Pool) deferFree(b *Buffer, s cudart.Stream) error {
	ev, err := p.recordOn(s)
	if err != nil {
		p.mu.Lock()
		b.state = bufLive
		p.counts.deferredFrees--
		p.mu.Unlock()
		return p.errorf("free %v: %w", b, err)
	}
	p.mu.Lock()
	b.freeStream = s
	release := b.leases == 0
	if !release {
		b.freeEvent = ev
	}
	p.mu.Unlock()
	if release {
		return p.releaseDeferred(b, ev)
	}
	return nil
}

// releaseDeferred issues the deferred free of b after ev. A failure is kept: b's
// memory stays reserved, Stats counts it and Close reports it. Call inside the gate.
func (p *Pool) releaseDeferred(b *Buffer, ev cudart.Event) error {
	err := p.waitRelease(ev)
	if err == nil {
		err = p.settleOwedOnRelease(b)
	}
	done := func(err error) error {
		p.counts.deferredFrees--
		if err != nil {
			b.state = bufFailed
			err = p.errorf("%w: %v: %w", ErrFreeFailed, b, err)
			p.failed = append(p.failed, err)
			p.counts.failedFreeBytes += b.reserved
		}
		return err
	}
	if err != nil {
		p.mu.Lock()
		defer p.mu.Unlock()
		return done(err)
	}
	if p.cacheShared(b, b.freeStream, false) {
		p.mu.Lock()
		defer p.mu.Unlock()
		return done(nil)
	}
	return p.finishFree(b, done)
}

// freeShared frees a buffer that was leased before and has no live leases, on the
// release stream after the point reached on s. On failure b is live again. Call
// inside the gate with b.state bufFreeing.
func (p *Pool) freeShared(b *Buffer, s cudart.Stream) error {
	done := func(err error) error {
		if err != nil {
			b.state = bufLive
			return p.errorf("free %v: %w", b, err)
		}
		return nil
	}
	viaRelease, err := p.settleOwed(b, s)
	if err != nil {
		p.mu.Lock()
		b.state = bufLive
		p.mu.Unlock()
		return err
	}
	if viaRelease {
		p.mu.Lock()
		b.ordered = true
		p.mu.Unlock()
	}
	if p.cacheShared(b, s, true) {
		return nil
	}
	ev, err := p.recordOn(s)
	if err == nil {
		err = p.waitRelease(ev)
	}
	if err != nil {
		p.mu.Lock()
		defer p.mu.Unlock()
		return done(err)
	}
	return p.finishFree(b, done)
}

// finishFree returns b's memory once the release stream is ordered after every use of
// it: to the driver once the importers that retain it let go (retire), else to the
// driver on the release stream at once. done runs under pool.mu with nil as b is marked freed, or
// with the driver's error (b is then left as done makes it), and says what to
// return. This is the one tail of every deferred free. Call inside the gate.
func (p *Pool) finishFree(b *Buffer, done func(error) error) error {
	if set := p.retainedSet(b); set != nil {
		p.mu.Lock()
		err := done(nil)
		b.state = bufFreed
		p.forget(b)
		p.mu.Unlock()
		return errors.Join(err, p.retire(set, b.ptr, b.reserved, 0))
	}
	err := p.freeOnRelease(b)
	p.mu.Lock()
	defer p.mu.Unlock()
	if err != nil {
		return done(err)
	}
	err = done(nil)
	b.state = bufFreed
	p.forget(b)
	p.freedLocked()
	return err
}

// settleOwedOnRelease makes the release stream wait for the completions b still owes.
func (p *Pool) settleOwedOnRelease(b *Buffer) error {
	p.mu.Lock()
	owes := len(p.owed[b]) > 0
	p.mu.Unlock()
	if !owes {
		return nil
	}
	rel, err := p.releaseStream()
	if err == nil {
		_, err = p.settleOwed(b, rel)
	}
	return err
}

// waitRelease makes the release stream wait for ev, and gives ev back.
func (p *Pool) waitRelease(ev cudart.Event) error {
	err := p.releaseWaitsFor(ev)
	p.putEvent(ev)
	if err != nil {
		return fmt.Errorf("release stream waiting for the free's stream: %w", err)
	}
	return nil
}

// releaseWaitsFor makes the release stream wait for ev as it is now.
func (p *Pool) releaseWaitsFor(ev cudart.Event) error {
	rel, err := p.releaseStream()
	if err == nil {
		err = p.rt.StreamWaitEvent(p.dev, rel, ev)
	}
	return err
}

// freeOnRelease frees b on the release stream, which exists once b was leased.
func (p *Pool) freeOnRelease(b *Buffer) error {
	rel, err := p.releaseStream()
	if err != nil {
		return err
	}
	return p.rt.FreeAsync(p.dev, b.ptr, rel)
}

// retainedSet returns b's retentions if it has any, else nil.
func (p *Pool) retainedSet(b *Buffer) *retainSet {
	p.mu.Lock()
	defer p.mu.Unlock()
	if b.retained.holds() {
		return b.retained
	}
	return nil
}

// freeRetained frees a buffer that was never leased but whose memory importers
// retain or retained (it came from the cache): the memory goes back to the driver on
// the release stream, which waited for their completions, after the point reached on
// s, once they let go. On failure b is live again. Call inside the gate
// with b.state bufFreeing.
func (p *Pool) freeRetained(b *Buffer, s cudart.Stream) error {
	ev, err := p.recordOn(s)
	p.mu.Lock()
	if err != nil {
		b.state = bufLive
		p.mu.Unlock()
		return p.errorf("free %v: %w", b, err)
	}
	b.state = bufFreed
	p.forget(b)
	set := b.retained
	p.mu.Unlock()
	return p.retire(set, b.ptr, b.reserved, ev)
}
