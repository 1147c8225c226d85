package producer

import (
	"context"
	"errors"
	"fmt"

	"github.com/cudapool/cudapool/cudart"
	"github.com/cudapool/cudapool/export"
	"github.com/cudapool/cudapool/export/internal/wire"
	"github.com/cudapool/cudapool/pool"
)

// answerOpen grants the buffer an Open asks for and sends the Lease.
func (p *peer) answerOpen(m *wire.OpenMsg) error {
	pub, err := p.ex.lookup(m.Name)
	if err != nil {
		return err
	}
	ctx, cancel := bounded()
	defer cancel()
	l, pl, err := p.grant(ctx, pub, m.ReqID)
	if err != nil {
		return err
	}
	if err := p.c.Send(ctx, &l, -1); err != nil {
		p.releaseUnsent(l.LeaseID, pl)
		return err
	}
	return nil
}

// answerOpenBatch grants the buffers an OpenBatch asks for, all or none, and sends
// them in as few LeaseBatch frames as they fit in.
func (p *peer) answerOpenBatch(m *wire.OpenBatchMsg) error {
	ctx, cancel := bounded()
	defer cancel()
	leases := make([]wire.LeaseMsg, 0, len(m.Names))
	granted := make([]*pool.Lease, 0, len(m.Names))
	releaseFrom := func(from int) {
		for i := from; i < len(leases); i++ {
			p.releaseUnsent(leases[i].LeaseID, granted[i])
		}
	}
	for _, name := range m.Names {
		pub, err := p.ex.lookup(name)
		if err == nil {
			var l wire.LeaseMsg
			var pl *pool.Lease
			if l, pl, err = p.grant(ctx, pub, m.ReqID); err == nil {
				leases, granted = append(leases, l), append(granted, pl)
				continue
			}
		}
		releaseFrom(0)
		return fmt.Errorf("open %q of a batch of %d: %w", name, len(m.Names), err)
	}
	for start := 0; start < len(leases); {
		end, size := start, wire.LeaseBatchHeaderLen
		for end < len(leases) && (end == start || size+wire.LeaseLen+len(leases[end].Meta) <= wire.MaxPayload) {
			size += wire.LeaseLen + len(leases[end].Meta)
			end++
		}
		frame := &wire.LeaseBatchMsg{ReqID: m.ReqID, Leases: leases[start:end]}
		if end < len(leases) {
			frame.Flags = wire.LeaseBatchMore
		}
		if err := p.c.Send(ctx, frame, -1); err != nil {
			releaseFrom(start)
			return err
		}
		start = end
	}
	return nil
}

// grant leases pub's buffer to the peer and returns the Lease message, its pool handle
// sent first if this peer has not had it. A buffer the peer already holds is granted
// under the same id once more, to be released as many times. The pool lease it took
// is returned for releaseUnsent, should the message fail to go out.
func (p *peer) grant(ctx context.Context, pub *publication, reqID uint64) (wire.LeaseMsg, *pool.Lease, error) {
	if pub.alloc != nil {
		return p.grantVMM(ctx, pub, reqID)
	}
	b := pub.buf
	// Each grant holds its own pool lease: taking it is also the check that b was not
	// freed, so a freed buffer's record is never handed out (FACTS 3).
	pl, err := b.Lease()
	if err != nil {
		if errors.Is(err, pool.ErrFreed) {
			p.ex.dropFreed(pub)
			return wire.LeaseMsg{}, nil, fmt.Errorf("%w: %q: %w", export.ErrBufferGone, pub.name, err)
		}
		return wire.LeaseMsg{}, nil, fmt.Errorf("producer: lease %q: %w", pub.name, err)
	}
	msg, err := p.prepare(ctx, pub)
	if err != nil {
		_ = pl.End(0) // nothing was sent, so nothing was imported
		return wire.LeaseMsg{}, nil, err
	}
	msg.ReqID = reqID
	p.mu.Lock()
	defer p.mu.Unlock()
	if err := p.grantableLocked(); err != nil {
		_ = pl.End(0) // the Lease message was not sent, so nothing was imported
		return wire.LeaseMsg{}, nil, err
	}
	msg.LeaseID = p.recordGrantLocked(&lease{buf: b, bytes: b.Size(), record: msg.Record}, pl)
	return msg, pl, nil
}

// grantVMM is grant of a VMM allocation: its chunks go to the peer first unless they
// went before, and the grant holds no pool lease (nil in the ledger), as the peer's
// import holds the memory. Whether the peer may hold one more grant is asked before
// the chunks go too, so that a peer at its limit is sent nothing.
func (p *peer) grantVMM(ctx context.Context, pub *publication, reqID uint64) (wire.LeaseMsg, *pool.Lease, error) {
	p.mu.Lock()
	err := p.grantableLocked()
	p.mu.Unlock()
	if err != nil {
		return wire.LeaseMsg{}, nil, err
	}
	msg, err := p.prepareVMM(ctx, pub)
	if err != nil {
		return wire.LeaseMsg{}, nil, err
	}
	msg.ReqID = reqID
	p.mu.Lock()
	defer p.mu.Unlock()
	if err := p.grantableLocked(); err != nil {
		return wire.LeaseMsg{}, nil, err
	}
	msg.LeaseID = p.recordGrantLocked(&lease{alloc: pub.alloc, bytes: pub.alloc.size}, nil)
	return msg, nil, nil
}

// grantableLocked says why the peer may not be granted one more lease, or nil. Call
// with p.mu held.
func (p *peer) grantableLocked() error {
	if p.left || p.awaitingExit {
		return p.goneErr()
	}
	if p.grants >= p.ex.opts.maxGrants {
		return fmt.Errorf("%w: pid %d holds %d grants, the most one connection may; release some first", export.ErrTooManyGrants, p.pid(), p.grants)
	}
	return nil
}

// recordGrantLocked records grant pl (nil for a VMM allocation's) of what l holds,
// under the peer's lease on it, made from l if it has none, and returns the lease id.
// Call with p.mu held.
func (p *peer) recordGrantLocked(l *lease, pl *pool.Lease) uint64 {
	entry := p.byHeld[l.held()]
	if entry == nil {
		p.issued++
		p.space.noteIssued(p.issued)
		entry = l
		entry.id = p.space.keys.seal(p.id, p.issued)
		p.leases[entry.id] = entry
		p.byHeld[l.held()] = entry
	}
	entry.grants = append(entry.grants, pl)
	entry.bytes, entry.record = l.bytes, l.record
	p.grants++
	return entry.id
}

// push grants pub's buffer to the peer unasked and sends it as a Push.
func (p *peer) push(ctx context.Context, pub *publication) error {
	l, pl, err := p.grant(ctx, pub, 0)
	if err != nil {
		return err
	}
	if err := p.c.Send(ctx, &wire.PushMsg{LeaseMsg: l, Name: pub.name}, -1); err != nil {
		p.releaseUnsent(l.LeaseID, pl)
		return err
	}
	return nil
}

// prepare makes everything a Lease message for pub refers to: the record, the pool
// handle on the peer's side, the release event on this side. LeaseID and ReqID are
// left to the caller.
func (p *peer) prepare(ctx context.Context, pub *publication) (wire.LeaseMsg, error) {
	b := pub.buf
	rec, err := b.ExportRecord()
	if err != nil {
		if errors.Is(err, pool.ErrFreed) {
			return wire.LeaseMsg{}, fmt.Errorf("%w: %q: %w", export.ErrBufferGone, pub.name, err)
		}
		return wire.LeaseMsg{}, fmt.Errorf("producer: %q: %w", pub.name, fabricErr(b.Pool(), err))
	}
	poolID, err := p.sendPool(ctx, b.Pool())
	if err != nil {
		return wire.LeaseMsg{}, err
	}
	msg := wire.LeaseMsg{PoolID: poolID, BufferID: b.ID(), Size: b.Size(), Offset: pub.offset, Length: pub.length,
		Meta: pub.meta, Record: rec}
	if err := p.readyFields(pub, &msg); err != nil {
		return wire.LeaseMsg{}, err
	}
	if p.hello.Flags&wire.HelloReleaseEvent != 0 {
		if _, err := p.releaseEvent(b.Device()); err != nil {
			return wire.LeaseMsg{}, err
		}
	}
	return msg, nil
}

// readyFields gives msg pub's ready event; for a peer on a byte stream, where IPC
// events do not cross hosts, it waits for the producer's writes instead.
func (p *peer) readyFields(pub *publication, msg *wire.LeaseMsg) error {
	if p.remote() {
		if err := p.ex.rt.EventSynchronize(pub.ready.dev, pub.ready.ev); err != nil {
			return fmt.Errorf("producer: %q: wait for the producer's writes: %w", pub.name, err)
		}
		return nil
	}
	msg.Flags |= wire.LeaseReadyEvent
	msg.Ready = pub.ready.handle
	return nil
}

// sendPool sends p's handle to the peer unless it already has it, and returns the
// pool's wire id.
func (p *peer) sendPool(ctx context.Context, pl *pool.Pool) (uint64, error) {
	id := p.ex.poolID(pl)
	if err := p.poolLock.Acquire(ctx, 1); err != nil {
		return 0, fmt.Errorf("producer: send pool %s: %w", pl.Name(), err)
	}
	defer p.poolLock.Release(1)
	if p.sent[pl] {
		return id, nil
	}
	ht := pl.HandleType()
	switch {
	case ht == cudart.HandleTypePosixFD && !p.c.CanPassFDs():
		return 0, fmt.Errorf("%w: a POSIX fd pool cannot travel on a byte stream; use a FABRIC pool", export.ErrHandleType)
	case p.hello.HandleTypes&uint32(ht) == 0:
		return 0, fmt.Errorf("%w: the peer imports %#x, the pool is %v", export.ErrHandleType, p.hello.HandleTypes, ht)
	}
	h, err := pl.ExportHandle()
	if err != nil {
		return 0, fmt.Errorf("producer: pool %s: %w", pl.Name(), fabricErr(pl, err))
	}
	ph := &wire.PoolHandleMsg{PoolID: id, HandleType: ht, Device: p.ex.deviceUUID(pl.Device()), MaxSize: pl.MaxSize()}
	fd := -1
	if ht == cudart.HandleTypeFabric {
		ph.Fabric = h.Fabric
	} else {
		fd = h.FD // the pool owns it; sendmsg duplicates it into the peer
	}
	if err := p.c.Send(ctx, ph, fd); err != nil {
		return 0, err
	}
	p.sent[pl] = true
	return id, nil
}

func (ex *Exporter) deviceUUID(dev int) cudart.UUID {
	if dev >= 0 && dev < len(ex.devices) {
		return ex.devices[dev]
	}
	return cudart.UUID{}
}

// releaseEvent returns the peer's release event opened on dev, opening it the first
// time (0.29 ms on the measured host, so not on the release path). Once the peer's
// connection is gone it opens nothing: cleanup would never destroy it.
func (p *peer) releaseEvent(dev int) (cudart.Event, error) {
	p.mu.Lock()
	defer p.mu.Unlock()
	if ev, ok := p.releaseEvents[dev]; ok {
		return ev, nil
	}
	if p.left || p.awaitingExit {
		// No grant follows (see grant), and an event opened after cleanup took the
		// peer's would never be destroyed.
		return 0, p.goneErr()
	}
	if p.proc != nil {
		// An event of a process that has exited is gone with it: opening it would use
		// it after its owner's exit. Its socket may outlive it (a child holds it), so
		// the connection alone does not tell; the process handle does.
		if exited, err := p.proc.Exited(); exited || err != nil {
			return 0, fmt.Errorf("%w: pid %d has exited", p.goneErr(), p.pid())
		}
	}
	ev, err := p.ex.rt.IpcOpenEventHandle(dev, p.hello.ReleaseEvent)
	if err != nil {
		return 0, fmt.Errorf("producer: open pid %d's release event: %w", p.pid(), err)
	}
	p.releaseEvents[dev] = ev
	return ev, nil
}
