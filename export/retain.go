package export

import (
	"context"
	"fmt"

	"github.com/cudapool/cudapool/cudart"
	"github.com/cudapool/cudapool/pool"
)

// Retained imports (WithRetainedImports): a consumer's Release with releaseRetain ends
// its lease but keeps its import mapped, and the exporter holds a pool.Retention on
// the memory for it, so that the pool never returns the memory to the driver under the
// mapping. The memory may be recycled to a new buffer meanwhile (pool.WithCache): a
// lease on it is then found mapped by the consumer, which imports nothing. When the
// pool wants the memory back it revokes the retention: the exporter sends Revoke, the
// consumer frees its import and answers Revoked, and the retention ends as of the
// consumer's release event.

// retention is a peer's retained import of one piece of memory.
type retention struct {
	r   *pool.Retention
	dev int
}

// retainLocked makes sure the peer retains entry's memory before its grants end, so
// that there is no moment when neither holds it. Call with p.mu held.
func (p *peer) retainLocked(entry *lease) error {
	if !p.retains {
		return fmt.Errorf("%w: release retaining lease %#x: this exporter does not keep imports", ErrBadRequest, entry.id)
	}
	if p.retained[entry.record] != nil {
		return nil
	}
	rec := entry.record
	r, err := entry.buf.Retain(func() { go p.revoke(context.Background(), rec) })
	if err != nil {
		return fmt.Errorf("export: retain lease %#x: %w", entry.id, err)
	}
	p.retained[rec] = &retention{r: r, dev: entry.buf.Device()}
	return nil
}

// revoke asks the peer to free its retained import of rec. If the message cannot go
// out, the connection is ending, and cleanup ends the retention.
func (p *peer) revoke(ctx context.Context, rec cudart.PtrExportData) {
	if err := p.c.send(ctx, &revokeMsg{Record: rec}, -1); err != nil {
		p.ex.log.Debug("export: could not revoke a retained import; it ends with the connection", "pid", p.pid(), "err", err)
	}
}

// answerRevoked ends the retention of the import the peer freed, after its release
// event.
func (p *peer) answerRevoked(m *revokedMsg) {
	p.mu.Lock()
	rt := p.retained[m.Record]
	delete(p.retained, m.Record)
	completion := cudart.Event(0)
	if rt != nil {
		completion = p.releaseEvents[rt.dev]
	}
	p.mu.Unlock()
	if rt == nil {
		p.ex.log.Warn("export: peer revoked an import it did not retain", "pid", p.pid())
		return
	}
	if completion != 0 && completed(p.ex.rt, rt.dev, completion) {
		completion = 0
	}
	if err := rt.r.End(completion); err != nil {
		p.ex.log.Error("export: ending a revoked import", "pid", p.pid(), "err", err)
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

func (p *peer) retainedCount() int {
	p.mu.Lock()
	defer p.mu.Unlock()
	return len(p.retained)
}
