package pool

import "github.com/cudapool/cudapool/cudart"

// ExportHandle exports the pool once and returns its shareable handle from then on.
// The pool owns the handle's descriptor and closes it at Close: pass it on (sendmsg
// duplicates it) but do not close it. A local pool fails with [ErrNotShareable].
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
// then on. It fails with [ErrNotShareable] on a local pool and [ErrFreed] once b was freed.
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
	if rec := b.record.Load(); rec != nil {
		return *rec, nil
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
	b.record.Store(&rec)
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
