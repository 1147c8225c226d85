package pool

import (
	"context"
	"errors"
	"fmt"
	"strings"

	"golang.org/x/sys/unix"

	"github.com/cudapool/cudapool/cudart"
)

// CloseReport says what Close released.
type CloseReport struct {
	Name string
	// ReleasedBuffers and ReleasedBytes are the buffers Close(Force) freed.
	ReleasedBuffers int
	ReleasedBytes   uint64
	// AbandonedBuffers and AbandonedBytes are the buffers Close(Force) left
	// allocated because importers may still hold them. Their memory is given back
	// to the device when the process exits.
	AbandonedBuffers int
	AbandonedBytes   uint64
	// CachedBuffers and CachedBytes are the buffers Close returned from the cache
	// (WithCache) to the driver.
	CachedBuffers int
	CachedBytes   uint64
	// FailedFrees are the deferred frees and frees of cached buffers that failed
	// during the pool's life, and Close's own frees that failed.
	FailedFrees []error
	// Destroyed reports whether the CUDA pool was destroyed. A device's default pool
	// is not, nor a FABRIC pool whose export the driver refused: destroying one
	// crashed the process on driver 580.159.04, so it is left to the process's exit.
	Destroyed bool
}

func (r CloseReport) String() string {
	var b strings.Builder
	fmt.Fprintf(&b, "pool %q closed: released %d buffers (%s)", r.Name, r.ReleasedBuffers, human(r.ReleasedBytes))
	if r.CachedBuffers > 0 {
		fmt.Fprintf(&b, ", returned %d cached buffers (%s)", r.CachedBuffers, human(r.CachedBytes))
	}
	if r.AbandonedBuffers > 0 {
		fmt.Fprintf(&b, ", abandoned %d shared buffers (%s) until exit", r.AbandonedBuffers, human(r.AbandonedBytes))
	}
	if len(r.FailedFrees) > 0 {
		fmt.Fprintf(&b, ", %d failed frees", len(r.FailedFrees))
	}
	if !r.Destroyed {
		b.WriteString("; CUDA pool not destroyed")
	}
	return b.String()
}

// Close destroys the pool. Without [Force] it refuses, with [ErrBusy] and no change, while
// buffers are live (leased, waiting for a deferred free, or whose deferred free
// failed) or calls are in flight. With Force it stops new calls, waits for the calls
// in flight (bounded by ctx), frees the live buffers that no importer holds and
// abandons the rest (see Force); if ctx ends first it returns ctx's error, and a later
// Close finishes the job. Waiting Allocs fail with [ErrClosed].
//
// Close then returns the cache to the driver (as Trim does), destroys the release
// stream, the pool's events, the exported handle's descriptor and the CUDA pool (not a
// default pool), and returns what it released.
// Errors from those are joined in the error, with the report filled in. A second
// Close fails with ErrClosed.
func (p *Pool) Close(ctx context.Context, opts ...CloseOption) (CloseReport, error) {
	var cfg closeConfig
	for _, o := range opts {
		if o != nil {
			o(&cfg)
		}
	}
	if err := p.takeCloser(ctx); err != nil {
		return CloseReport{}, err
	}
	defer func() { <-p.closer }()
	p.mu.Lock()
	switch {
	case p.state == poolClosed:
		p.mu.Unlock()
		return CloseReport{}, p.closedError("close")
	case p.state == poolClosing:
		// An earlier Close(Force) ran out of time; carry on with it.
	case !cfg.force:
		if err := p.busyLocked(); err != nil {
			p.mu.Unlock()
			return CloseReport{}, err
		}
		p.beginClosingLocked()
		p.mu.Unlock()
		return p.teardown(CloseReport{Name: p.name}, nil)
	default:
		p.gate.close()
		p.beginClosingLocked()
	}
	p.mu.Unlock()
	select {
	case <-p.gate.drained:
	case <-ctx.Done():
		return CloseReport{}, p.errorf("close: waiting for calls in flight: %w", ctx.Err())
	}
	report, toFree, abandoned := p.sortForClose()
	errs := p.releaseAll(toFree, &report)
	return p.teardown(report, append(errs, p.destroyEvents(abandoned)...))
}

// takeCloser lets one Close run at a time: a second one waits (bounded by ctx), then
// finds the pool closed. A free token is taken even if ctx has ended.
func (p *Pool) takeCloser(ctx context.Context) error {
	select {
	case p.closer <- struct{}{}:
		return nil
	default:
	}
	select {
	case p.closer <- struct{}{}:
		return nil
	case <-ctx.Done():
		return p.errorf("close: waiting for another Close: %w", ctx.Err())
	}
}

// busyLocked says why Close without Force must refuse, and otherwise closes the gate.
// Call with pool.mu held.
func (p *Pool) busyLocked() error {
	c := p.counts
	if c.retentions > 0 {
		return p.errorf("close: %w: importers retain %d mappings of its memory", ErrBusy, c.retentions)
	}
	if c.liveBuffers > 0 {
		return p.errorf("close: %w: %d live buffers (%s reserved; %d shared with %d leases, %d deferred frees, %d failed frees)",
			ErrBusy, c.liveBuffers, human(c.bytesReserved), c.sharedBuffers, c.activeLeases, c.deferredFrees, len(p.failed))
	}
	if !p.gate.closeIfIdle() {
		return p.errorf("close: %w: calls in flight", ErrBusy)
	}
	return nil
}

func (p *Pool) beginClosingLocked() {
	p.state = poolClosing
	close(p.closing)
}

// sortForClose takes every buffer out of the pool once no call is in flight, marking
// it released, and returns the ones to free and the free events of the abandoned ones.
func (p *Pool) sortForClose() (r CloseReport, toFree []*Buffer, abandoned []cudart.Event) {
	p.mu.Lock()
	defer p.mu.Unlock()
	r.Name = p.name
	for i := len(p.live) - 1; i >= 0; i-- { // from the end, as forget moves the last
		b := p.live[i]
		switch {
		case b.state == bufFailed:
		case b.leases > 0 || b.abandoned || b.state == bufFreeing || b.retained.holds():
			r.AbandonedBuffers++
			r.AbandonedBytes += b.reserved
			if b.freeEvent != 0 {
				abandoned = append(abandoned, b.freeEvent)
				b.freeEvent = 0
			}
		default:
			toFree = append(toFree, b)
		}
		if b.state != bufFailed {
			b.state = bufReleased
		}
		p.forget(b)
	}
	// Memory waiting for its retainers is abandoned with the rest that importers hold.
	for set := range p.parked {
		r.AbandonedBuffers++
		r.AbandonedBytes += set.reserved
		if set.after != 0 {
			abandoned = append(abandoned, set.after)
		}
		p.unparkLocked(set)
	}
	r.FailedFrees = append(r.FailedFrees, p.failed...)
	return r, toFree, abandoned
}

// releaseAll frees the buffers Close(Force) releases, on the release stream if the
// pool has one (it has waited for every completion of a buffer that was shared), else
// on the legacy default stream.
func (p *Pool) releaseAll(bufs []*Buffer, r *CloseReport) []error {
	var errs []error
	p.relMu.Lock()
	s := p.relStream
	p.relMu.Unlock()
	for _, b := range bufs {
		err := p.settleOwedOnRelease(b)
		if err == nil {
			err = p.rt.FreeAsync(p.dev, b.ptr, s)
		}
		if err != nil {
			err = p.errorf("close: free %v: %w", b, err)
			r.FailedFrees = append(r.FailedFrees, err)
			errs = append(errs, err)
			continue
		}
		r.ReleasedBuffers++
		r.ReleasedBytes += b.reserved
	}
	return errs
}

func (p *Pool) destroyEvents(events []cudart.Event) []error {
	var errs []error
	for _, e := range events {
		if err := p.rt.EventDestroy(p.dev, e); err != nil {
			errs = append(errs, p.errorf("close: destroying an event: %w", err))
		}
	}
	return errs
}

// teardown destroys the pool's CUDA objects once no call can reach them, and marks
// the pool closed.
func (p *Pool) teardown(r CloseReport, errs []error) (CloseReport, error) {
	freed, abandoned, terrs := p.trim(func(cudart.Stream) bool { return true }, true)
	r.CachedBuffers, r.CachedBytes = freed.buffers, freed.bytes
	r.AbandonedBuffers += abandoned.buffers
	r.AbandonedBytes += abandoned.bytes
	r.FailedFrees = append(r.FailedFrees, terrs...)
	errs = append(errs, terrs...)
	p.mu.Lock()
	events := p.events
	p.events = nil
	p.mu.Unlock()
	errs = append(errs, p.destroyEvents(events)...)
	p.relMu.Lock()
	if p.relStream != 0 {
		if err := p.rt.StreamDestroy(p.dev, p.relStream); err != nil {
			errs = append(errs, p.errorf("close: destroying the release stream: %w", err))
		}
		p.relStream = 0
	}
	p.relMu.Unlock()
	p.exportMu.Lock()
	if h := p.exported; h != nil && h.Type == cudart.HandleTypePosixFD && h.FD >= 0 {
		if err := unix.Close(h.FD); err != nil {
			errs = append(errs, p.errorf("close: closing the exported descriptor: %w", err))
		}
	}
	p.exported = nil
	p.exportMu.Unlock()
	if p.owned && !p.keepAtClose.Load() {
		if err := p.rt.MemPoolDestroy(p.dev, p.handle); err != nil {
			errs = append(errs, p.errorf("close: destroying the CUDA pool: %w", err))
		} else {
			r.Destroyed = true
		}
	}
	if p.grans != nil {
		p.grans.Release()
	}
	p.mu.Lock()
	p.state = poolClosed
	p.mu.Unlock()
	return r, errors.Join(errs...)
}
