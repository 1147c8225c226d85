package producer

import (
	"context"
	"fmt"
	"maps"

	"github.com/cudapool/cudapool/pool"

	"github.com/cudapool/cudapool/cudart"
	"github.com/cudapool/cudapool/export"
	"github.com/cudapool/cudapool/export/internal/wire"
)

// retention is a peer's retained import of one piece of memory.
type retention struct {
	r   *pool.Retention
	dev int
}

// retainLocked makes sure the peer retains entry's memory before its grants end, so
// that there is no moment when neither holds it. Call with p.mu held.
func (p *peer) retainLocked(entry *lease) error {
	if entry.buf == nil {
		return fmt.Errorf("%w: release retaining lease %#x: a VMM allocation's lease cannot be retained", export.ErrBadRequest, entry.id)
	}
	if !p.retains {
		return fmt.Errorf("%w: release retaining lease %#x: this exporter does not keep imports", export.ErrBadRequest, entry.id)
	}
	if p.retained[entry.record] != nil {
		return nil
	}
	rec := entry.record
	r, err := entry.buf.Retain(func() { go p.revoke(context.Background(), rec) })
	if err != nil {
		return fmt.Errorf("producer: retain lease %#x: %w", entry.id, err)
	}
	p.retained[rec] = &retention{r: r, dev: entry.buf.Device()}
	return nil
}

// revoke asks the peer to free its retained import of rec. If the message cannot go
// out, the connection is ending, and cleanup ends the retention.
func (p *peer) revoke(ctx context.Context, rec cudart.PtrExportData) {
	if err := p.c.Send(ctx, &wire.RevokeMsg{Record: rec}, -1); err != nil {
		p.ex.log.Debug("producer: could not revoke a retained import; it ends with the connection", "pid", p.pid(), "err", err)
	}
}

// answerRevoked ends the retention of the import the peer freed, after its release
// event.
func (p *peer) answerRevoked(m *wire.RevokedMsg) {
	p.mu.Lock()
	rt := p.retained[m.Record]
	delete(p.retained, m.Record)
	releaseEvent := cudart.Event(0)
	if rt != nil {
		releaseEvent = p.releaseEvents[rt.dev]
	}
	p.mu.Unlock()
	if rt == nil {
		p.ex.log.Warn("producer: peer revoked an import it did not retain", "pid", p.pid())
		return
	}
	if releaseEvent != 0 && wire.Completed(p.ex.rt, rt.dev, releaseEvent) {
		releaseEvent = 0
	}
	if err := rt.r.End(releaseEvent); err != nil {
		p.ex.log.Error("producer: ending a revoked import", "pid", p.pid(), "err", err)
	}
	p.ex.poke()
}

// revokeAll asks the peer to free every import it retains, as Close does.
func (p *peer) revokeAll(ctx context.Context) {
	p.mu.Lock()
	recs := make([]cudart.PtrExportData, 0, len(p.retained))
	for rec := range p.retained {
		recs = append(recs, rec)
	}
	p.mu.Unlock()
	for _, rec := range recs {
		p.revoke(ctx, rec)
	}
}

// endRetentions ends the retentions of a peer that said Bye, as of its release event:
// an Importer frees what it retains before it says Bye.
func (p *peer) endRetentions() {
	p.mu.Lock()
	retained := p.retained
	p.retained = map[cudart.PtrExportData]*retention{}
	release := maps.Clone(p.releaseEvents)
	p.mu.Unlock()
	p.endAll(retained, release)
}

// dropRetentions deals with what a departing peer still retains (one that said Bye
// retains nothing any more). clean false: its process is gone and its imports with it,
// so they end at once. clean true without Bye: the exporter cut a live peer, which
// may still map them, and whose release event may be gone: they are left held, and
// the memory stays reserved until its pool is closed with Force.
func (p *peer) dropRetentions(clean bool) {
	p.mu.Lock()
	retained := p.retained
	p.retained = map[cudart.PtrExportData]*retention{}
	p.mu.Unlock()
	if len(retained) == 0 {
		return
	}
	if clean {
		p.ex.log.Warn("producer: a peer cut off while it may still map its retained imports; their memory stays reserved",
			"pid", p.pid(), "imports", len(retained))
		return
	}
	p.endAll(retained, nil)
}

// endAll ends retentions after the release events given (none: at once).
func (p *peer) endAll(retained map[cudart.PtrExportData]*retention, release map[int]cudart.Event) {
	for _, rt := range retained {
		releaseEvent := release[rt.dev]
		if releaseEvent != 0 && wire.Completed(p.ex.rt, rt.dev, releaseEvent) {
			releaseEvent = 0
		}
		if err := rt.r.End(releaseEvent); err != nil {
			p.ex.log.Error("producer: ending a retained import of a departed peer", "pid", p.pid(), "err", err)
		}
	}
}

func (p *peer) retainedCount() int {
	p.mu.Lock()
	defer p.mu.Unlock()
	return len(p.retained)
}
