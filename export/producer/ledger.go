package producer

import (
	"errors"
	"fmt"
	"slices"

	"github.com/cudapool/cudapool/cudart"
	"github.com/cudapool/cudapool/export"
	"github.com/cudapool/cudapool/export/internal/wire"
	"github.com/cudapool/cudapool/pool"
)

// lease is a peer's hold on one buffer (or VMM allocation), under one lease id: one
// grant (a pool lease) per Open or Push the id answered, as a connection asking again
// for a buffer it holds gets the same id. It ends when its last grant is released. A
// VMM allocation's grants are nil: the peer's import holds its memory, not a pool.
type lease struct {
	id     uint64
	buf    *pool.Buffer
	alloc  *vmmAlloc // set instead of buf for a VMM allocation
	record cudart.PtrExportData
	grants []*pool.Lease
	bytes  uint64
}

// held is what the lease holds, its key in peer.byHeld.
func (l *lease) held() any {
	if l.alloc != nil {
		return l.alloc
	}
	return l.buf
}

// releaseUnsent ends pl, granted under lease id but whose message did not go out
// whole: the peer never learnt of it, so it will never release it, and imported
// nothing under it. Once cleanup has run it ended pl already. A peer that held the
// buffer under id before may have released, meanwhile, as many grants as it knew of,
// and releaseLease ends the newest, pl among them: then one of those the peer knew of
// is left, and goes instead, so that the lease keeps exactly the grants the peer holds.
func (p *peer) releaseUnsent(id uint64, pl *pool.Lease) {
	p.mu.Lock()
	entry := p.leases[id]
	i := -1
	if entry != nil {
		i = slices.Index(entry.grants, pl)
		if i < 0 && len(entry.grants) > 0 {
			i = len(entry.grants) - 1
			pl = entry.grants[i]
		}
	}
	if i >= 0 {
		entry.grants = slices.Delete(entry.grants, i, i+1)
		p.grants--
		if len(entry.grants) == 0 {
			delete(p.leases, entry.id)
			delete(p.byHeld, entry.held())
		}
	}
	p.mu.Unlock()
	if i < 0 || pl == nil {
		return
	}
	if err := pl.End(0); err != nil {
		p.ex.log.Error("producer: taking back a lease that was never sent", "pid", p.pid(), "err", err)
	}
	p.ex.poke()
}

// lookupLease finds the lease of id on this connection, or says why there is none.
// Call with p.mu held.
func (p *peer) lookupLease(id uint64) (*lease, error) {
	if entry := p.leases[id]; entry != nil {
		return entry, nil
	}
	if conn, ctr := p.space.keys.unseal(id); conn == p.id && ctr >= 1 && ctr <= p.issued {
		return nil, fmt.Errorf("%w: lease %#x was released already", export.ErrStaleLease, id)
	}
	if s, conn, _, ok := p.ex.connIDs.owner(id); ok && (s != p.space || conn != p.id) {
		return nil, fmt.Errorf("%w: lease %#x is another connection's", export.ErrStaleLease, id)
	}
	return nil, fmt.Errorf("%w: lease %#x was never issued", export.ErrStaleLease, id)
}

func (p *peer) releaseLease(m *wire.ReleaseMsg) error {
	if err := p.release(m); err != nil {
		return err
	}
	ctx, cancel := bounded()
	defer cancel()
	return p.c.Send(ctx, &wire.ReleasedMsg{ReqID: m.ReqID, LeaseID: m.LeaseID}, -1)
}

// releaseBatch releases every entry of a ReleaseBatch, and answers once. An entry that
// fails changes nothing; the others are released all the same, and the answer is an
// Error naming the failures.
func (p *peer) releaseBatch(m *wire.ReleaseBatchMsg) error {
	if len(m.Entries) == 0 {
		return fmt.Errorf("%w: a ReleaseBatch of no entries", export.ErrBadRequest)
	}
	var errs []error
	for i := range m.Entries {
		if err := p.release(&m.Entries[i]); err != nil {
			errs = append(errs, err)
		}
	}
	if len(errs) > 0 {
		return batchError(errs, len(m.Entries))
	}
	ctx, cancel := bounded()
	defer cancel()
	return p.c.Send(ctx, &wire.ReleasedMsg{ReqID: m.ReqID}, -1)
}

// batchShown is how many of a batch's failures its Error names.
const batchShown = 8

// batchError says which entries of a batch of n failed: how many, and the first few.
// It wraps every failure, so the Error's code is the first's.
func batchError(errs []error, n int) error {
	shown := errs[:min(len(errs), batchShown)]
	more := ""
	if len(errs) > len(shown) {
		more = fmt.Sprintf("\n(and %d more)", len(errs)-len(shown))
	}
	return fmt.Errorf("%d of %d entries refused:\n%w%s", len(errs), n, errors.Join(shown...), more)
}

// release ends the grants m returns. A peer with a release event leaves the wait for
// its free to the buffer's free or reuse (*pool.Lease.EndAt): a release costs no CUDA
// call here, and the free usually finds the event completed and waits for nothing.
func (p *peer) release(m *wire.ReleaseMsg) error {
	// Held (shared) until the grants have ended: shut settles the completions and
	// hangs up, after which the peer may destroy its event, only once no End uses it.
	p.ending.RLock()
	defer p.ending.RUnlock()
	p.mu.Lock()
	entry, err := p.lookupLease(m.LeaseID)
	if err == nil && (m.Count == 0 || int(m.Count) > len(entry.grants)) {
		err = fmt.Errorf("%w: release of %d grants of lease %#x, which has %d", export.ErrBadRequest, m.Count, m.LeaseID, len(entry.grants))
	}
	if err == nil && m.Flags&wire.ReleaseRetain != 0 {
		err = p.retainLocked(entry)
	}
	if err != nil {
		p.mu.Unlock()
		return err
	}
	n := len(entry.grants) - int(m.Count)
	ending := entry.grants[n:]
	entry.grants = entry.grants[:n:n]
	p.grants -= len(ending)
	if n == 0 {
		delete(p.leases, entry.id)
		delete(p.byHeld, entry.held())
	}
	var ev cudart.Event
	var completion *pool.Completion
	if entry.buf != nil && m.Flags&wire.ReleaseNothingImported == 0 && p.hello.Flags&wire.HelloReleaseEvent != 0 {
		// Otherwise nothing to wait for: nothing imported, or a peer that synchronised
		// its free before it said Release.
		ev = p.releaseEvents[entry.buf.Device()]
		completion = p.completionLocked(entry.buf, ev)
	}
	p.mu.Unlock()
	if err := p.endGrants(entry, ending, completion, ev); err != nil {
		return err
	}
	p.ex.poke()
	return nil
}

// completionLocked returns the peer's release event ev on b's device as a Completion
// of b's pool; nil if it has none there, or once the connection is being shut (the
// grants then end waiting for ev at once, as the hang-up may take it away). Call with
// p.mu held.
func (p *peer) completionLocked(b *pool.Buffer, ev cudart.Event) *pool.Completion {
	if ev == 0 || p.closing {
		return nil
	}
	c := p.completions[b.Pool()]
	if c == nil {
		c = b.Pool().NewCompletion(ev, p.exited)
		p.completions[b.Pool()] = c
	}
	return c
}

// exited reports whether the peer's process is known to have exited.
func (p *peer) exited() bool {
	if p.proc == nil {
		return false
	}
	gone, err := p.proc.Exited()
	return gone && err == nil
}

// settleCompletions settles what the peer's released leases left the pools owing,
// before its release events can go: waited for on the pools' release streams, or
// (wait false: its process is gone, and its imports with it) dropped.
func (p *peer) settleCompletions(wait bool) {
	p.settling.Lock()
	defer p.settling.Unlock()
	p.mu.Lock()
	completions := p.completions
	p.completions = map[*pool.Pool]*pool.Completion{}
	p.mu.Unlock()
	for _, c := range completions {
		if err := c.Close(wait); err != nil {
			p.ex.log.Error("producer: settling the frees a peer's release event covers", "pid", p.pid(), "err", err)
		}
	}
}

// endGrants ends grants of entry, after completion if not nil, else after ev (0: at
// once). A grant whose end failed before it ended goes back to entry, so it can be
// ended later.
func (p *peer) endGrants(entry *lease, ls []*pool.Lease, completion *pool.Completion, ev cudart.Event) error {
	var errs []error
	for _, l := range ls {
		if l == nil {
			continue // a VMM allocation's grant: nothing to end
		}
		var err error
		if completion != nil {
			err = l.EndAt(completion)
		} else {
			err = l.End(ev)
		}
		if err == nil {
			continue
		}
		errs = append(errs, err)
		if !errors.Is(err, pool.ErrFreeFailed) && !errors.Is(err, pool.ErrLeaseEnded) {
			p.mu.Lock()
			entry.grants = append(entry.grants, l)
			p.grants++
			p.leases[entry.id], p.byHeld[entry.held()] = entry, entry
			p.mu.Unlock()
		}
	}
	return errors.Join(errs...)
}

// cleanup ends what the peer still holds once its connection is over, and forgets it.
// clean: the peer said Bye or the exporter is closing, so its release event covers what
// it freed; otherwise its process is gone and its imports with it, so nothing is
// waited for. It hangs up only once the pool's streams have been made to wait on the
// peer's release event: a peer that said Bye takes the hang-up as leave to destroy it.
func (p *peer) cleanup(clean bool) {
	p.dropRetentions(clean)
	p.stopExitWait()
	if p.proc != nil {
		_ = p.proc.Close() // cleanup: nothing is left to do if closing fails
	}
	p.mu.Lock()
	held := make([]*lease, 0, len(p.leases))
	for _, entry := range p.leases {
		held = append(held, entry)
	}
	p.leases, p.byHeld = map[uint64]*lease{}, map[any]*lease{}
	p.grants = 0
	p.left = true
	release := p.releaseEvents
	p.releaseEvents = map[int]cudart.Event{}
	p.mu.Unlock()
	for _, entry := range held {
		if entry.buf == nil {
			continue // a VMM allocation's: its grants hold nothing here
		}
		releaseEvent := cudart.Event(0)
		if clean {
			releaseEvent = release[entry.buf.Device()]
		}
		for _, l := range entry.grants {
			if err := l.End(releaseEvent); err != nil {
				p.ex.log.Error("producer: ending a lease of a departed peer", "pid", p.pid(), "err", err)
			}
		}
	}
	p.settleCompletions(clean)
	_ = p.c.Close() // cleanup: nothing is left to do if closing fails
	for dev, ev := range release {
		_ = p.ex.rt.EventDestroy(dev, ev) // cleanup: nothing is left to undo if it fails
	}
	p.ex.mu.Lock()
	delete(p.ex.peers, p)
	p.ex.mu.Unlock()
	p.ex.poke()
}
