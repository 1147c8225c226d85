package pool

import (
	"fmt"

	"github.com/cudapool/cudapool/cudart"
)

// Lease keeps a shared buffer from going back to the pool: while any lease on a
// buffer lives, Free only marks it. The sharing layer takes one per importer.
type Lease struct {
	b *Buffer
	// Guarded by the pool's mu.
	ending, ended bool
}

// Buffer is the leased buffer.
func (l *Lease) Buffer() *Buffer { return l.b }

// Lease takes a lease on b, to be ended with the importer's completion. It fails with
// ErrNotShareable on a local pool, and with ErrFreed once Free was called or the pool
// closed (the error then wraps ErrClosed too). Take the lease before exporting the
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

// End ends the lease. completion is an event on the pool's device, owned by the
// caller, whose last record covers the importer's free of its import; 0 means that
// free is known to have completed (the importer synchronized, or exited). The release
// stream waits for completion as it is now, so the caller may destroy or re-record it
// as soon as End returns.
//
// If this was the last lease of a buffer that Free was called on, End issues the
// deferred free; if that fails, the lease has still ended, and the error wraps
// ErrFreeFailed (the failure is also kept for Stats and Close).
//
// Ending a lease twice fails with ErrLeaseEnded. If waiting for completion fails, the
// lease is still live and End may be called again. After Close began, End only ends
// the lease: the buffer has been abandoned and will not be freed.
func (l *Lease) End(completion cudart.Event) error {
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
	if completion != 0 {
		rel, err := p.releaseStream()
		if err == nil {
			if err = p.rt.StreamWaitEvent(p.dev, rel, completion); err != nil {
				err = p.errorf("end lease on %v: waiting for the completion event: %w", b, err)
			}
		}
		if err != nil {
			p.mu.Lock()
			l.ending = false
			p.mu.Unlock()
			return err
		}
	}
	p.mu.Lock()
	l.ending = false
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
	err := p.freeAfter(b, ev)
	p.mu.Lock()
	defer p.mu.Unlock()
	p.counts.deferredFrees--
	if err != nil {
		b.state = bufFailed
		err = p.errorf("%w: %v: %w", ErrFreeFailed, b, err)
		p.failed = append(p.failed, err)
		p.counts.failedFreeBytes += b.reserved
		return err
	}
	b.state = bufFreed
	p.forget(b)
	p.freedLocked()
	return nil
}

// freeShared frees a buffer that was leased before and has no live leases, on the
// release stream after the point reached on s. On failure b is live again. Call
// inside the gate with b.state bufFreeing.
func (p *Pool) freeShared(b *Buffer, s cudart.Stream) error {
	ev, err := p.recordOn(s)
	if err == nil {
		err = p.freeAfter(b, ev)
	}
	p.mu.Lock()
	defer p.mu.Unlock()
	if err != nil {
		b.state = bufLive
		return p.errorf("free %v: %w", b, err)
	}
	b.state = bufFreed
	p.forget(b)
	p.freedLocked()
	return nil
}

// freeAfter makes the release stream wait for ev, gives ev back, and frees b on the
// release stream.
func (p *Pool) freeAfter(b *Buffer, ev cudart.Event) error {
	rel, err := p.releaseStream()
	if err != nil {
		p.putEvent(ev)
		return err
	}
	err = p.rt.StreamWaitEvent(p.dev, rel, ev)
	p.putEvent(ev)
	if err != nil {
		return fmt.Errorf("release stream waiting for the free's stream: %w", err)
	}
	return p.rt.FreeAsync(p.dev, b.ptr, rel)
}

// ExportHandle exports the pool once and returns its shareable handle from then on.
// The pool owns the handle's descriptor and closes it at Close: pass it on (sendmsg
// duplicates it) but do not close it. A local pool fails with ErrNotShareable.
func (p *Pool) ExportHandle() (cudart.ShareableHandle, error) {
	if p.handleType == cudart.HandleTypeNone {
		return cudart.ShareableHandle{}, p.errorf("export: %w", ErrNotShareable)
	}
	if !p.gate.enter() {
		return cudart.ShareableHandle{}, p.closedError("export")
	}
	defer p.gate.leave()
	p.exportMu.Lock()
	defer p.exportMu.Unlock()
	return p.exportHandleLocked()
}

// exportHandleLocked is ExportHandle with exportMu held, inside the gate.
func (p *Pool) exportHandleLocked() (cudart.ShareableHandle, error) {
	if p.exported == nil {
		h, err := p.rt.MemPoolExportToShareableHandle(p.dev, p.handle, p.handleType)
		if err != nil {
			if p.handleType == cudart.HandleTypeFabric {
				// Driver 580.159.04 crashed the process in cudaMemPoolDestroy of a
				// FABRIC pool whose export it had refused (no IMEX channel): such a
				// pool is left to the process's exit instead.
				p.keepAtClose.Store(true)
			}
			return cudart.ShareableHandle{}, p.errorf("export: %w", err)
		}
		p.exported = &h
	}
	return *p.exported, nil
}

// ExportRecord returns the 64-byte record that lets another process that imported
// the pool import b. It exports the pool first if it has not been (the driver exports
// pointers only of exported pools), exports b once and returns the same bytes from
// then on. It fails with ErrNotShareable on a local pool and ErrFreed once b was freed.
func (b *Buffer) ExportRecord() (cudart.PtrExportData, error) {
	p := b.pool
	if p == nil {
		return cudart.PtrExportData{}, unpooled("export", b)
	}
	if p.handleType == cudart.HandleTypeNone {
		return cudart.PtrExportData{}, p.errorf("export %v: %w", b, ErrNotShareable)
	}
	if !p.gate.enter() {
		return cudart.PtrExportData{}, p.errorf("export %v: %w: %w", b, ErrFreed, ErrClosed)
	}
	defer p.gate.leave()
	p.exportMu.Lock()
	defer p.exportMu.Unlock()
	if err := p.checkLive(b, "export"); err != nil {
		return cudart.PtrExportData{}, err
	}
	if b.record != nil {
		return *b.record, nil
	}
	if _, err := p.exportHandleLocked(); err != nil {
		return cudart.PtrExportData{}, err
	}
	rec, err := p.rt.MemPoolExportPointer(p.dev, b.ptr)
	if err != nil {
		return cudart.PtrExportData{}, p.errorf("export %v: %w", b, err)
	}
	// Freed while exporting: the record may already name memory given to another buffer.
	if err := p.checkLive(b, "export"); err != nil {
		return cudart.PtrExportData{}, err
	}
	b.record = &rec
	return rec, nil
}

func (p *Pool) checkLive(b *Buffer, op string) error {
	p.mu.Lock()
	defer p.mu.Unlock()
	if b.state != bufLive {
		return b.stateError(op)
	}
	return nil
}
