package owner

import (
	"context"
	"errors"
	"fmt"

	"github.com/cudapool/cudapool/kv"
	"github.com/cudapool/cudapool/kv/internal/kvwire"
	"github.com/cudapool/cudapool/kv/internal/pages"
)

// elsewhereLocked says whether h is visible in a slab other than s, under o.mu.
func (o *Owner) elsewhereLocked(s *slab, h kv.Hash) bool {
	for _, other := range o.slabs {
		if other != s {
			if _, ok := other.tab.Lookup(h); ok {
				return true
			}
		}
	}
	return false
}

// piece is one page to copy into the replica's device: where it goes, and where it
// comes from.
type piece struct {
	dst  uint32
	src  *slab
	from uint32
	hash kv.Hash
}

// borrowed is a read lease of the owner's own on a source slab, for a copy.
type borrowed struct {
	s  *slab
	id pages.LeaseID
}

// matchAcross answers a Match whose run goes on in other devices' slabs. The owner,
// as a holder of its own, leases the pages of other devices' slabs for reading
// (Table.Match there) and as many pages of the replica's slab for writing (Alloc),
// copies them on a stream of their device, waits for the copy on the host, seals the
// copies (Seal, SealDone) and ends its source leases; then the run is the replica's
// slab's, and it is matched there. If the replica's slab has no room for the copies,
// the run ends before the first.
func (c *conn) matchAcross(h kvwire.Header, hashes []kv.Hash) error {
	o, s := c.o, c.s
	c.lock()
	var copies []piece
	for _, hh := range hashes {
		if _, ok := s.tab.Lookup(hh); ok {
			continue
		}
		found := false
		for _, other := range o.slabs {
			if p, ok := other.tab.Lookup(hh); ok && other != s {
				copies, found = append(copies, piece{src: other, from: p, hash: hh}), true
				break
			}
		}
		if !found {
			break
		}
	}
	// Hold the sources, so that none is evicted meanwhile, then find room for the
	// copies.
	var srcs []borrowed
	for _, other := range o.slabs {
		var hs []kv.Hash
		for _, pc := range copies {
			if pc.src == other {
				hs = append(hs, pc.hash)
			}
		}
		if len(hs) == 0 {
			continue
		}
		res, fx, err := other.tab.Match(o.self, hs)
		o.effectsLocked(other, fx)
		if err == nil && res.Lease != 0 {
			srcs = append(srcs, borrowed{other, res.Lease})
		}
	}
	id, dsts, fx, err := s.tab.Alloc(o.self, len(copies))
	if err != nil {
		o.giveBackLocked(srcs)
		return c.matchLocked(h.ID, hashes, c.runLocked(hashes))
	}
	for i := range copies {
		copies[i].dst = dsts[i]
	}
	seq := o.effectsLocked(s, fx)
	c.unlock()

	_, err = o.doEffects(s, fx, seq)
	if err == nil {
		err = o.copyRun(s, copies)
	}

	c.lock()
	o.giveBackLocked(srcs)
	hs := make([]kv.Hash, len(copies))
	for i, pc := range copies {
		hs[i] = pc.hash
	}
	if err == nil {
		var sfx pages.Effects
		if sfx, err = s.tab.Seal(o.self, id, hs, pages.NoRef); err == nil {
			o.effectsLocked(s, sfx)
			var v int
			v, _, sfx, err = s.tab.SealDone(id, true)
			o.effectsLocked(s, sfx)
			s.copied += uint64(v)
		}
	} else if s.tab.Release(o.self, id) == nil {
		rfx, _ := s.tab.ReleaseDone(id)
		o.effectsLocked(s, rfx)
	}
	if err != nil {
		c.unlock()
		return c.sendError(h.ID, fmt.Errorf("copying pages to device %d: %w", s.dev, err))
	}
	return c.matchLocked(h.ID, hashes, c.runLocked(hashes))
}

// giveBackLocked ends the owner's read leases srcs, under o.mu.
func (o *Owner) giveBackLocked(srcs []borrowed) {
	for _, b := range srcs {
		if b.s.tab.Release(o.self, b.id) == nil {
			fx, _ := b.s.tab.ReleaseDone(b.id)
			o.effectsLocked(b.s, fx)
		}
	}
}

// copyRun copies the pages of run that come from other slabs into s, every layer's K
// and V, on the stream of the source's device, and waits for the copies on the host.
// Pages that follow each other in both slabs are copied as one range.
func (o *Owner) copyRun(s *slab, run []piece) error {
	for i := 0; i < len(run); {
		src := run[i].src
		j := i + 1
		for j < len(run) && run[j].src == src {
			j++
		}
		if err := o.copyFrom(src, s, run[i:j]); err != nil {
			return err
		}
		i = j
	}
	return nil
}

// copyFrom copies pieces, all from src, into dst on src's stream and waits for them,
// until the owner closes: for each run of pages that follow each other in both slabs,
// one copy per tensor. The copy lock is held while the copies are queued, not while
// they run.
func (o *Owner) copyFrom(src, dst *slab, pieces []piece) error {
	src.copyMu.Lock()
	err := o.queueCopies(src, dst, pieces)
	if rerr := o.rt.EventRecord(src.dev, src.done, src.stream); rerr != nil {
		src.copyMu.Unlock()
		return errors.Join(err, rerr)
	}
	src.copyMu.Unlock()
	return errors.Join(err, o.waitDone(o.stopped, src)) // the copies queued before a failure end first
}

// waitStream waits, until ctx ends, for the work queued so far on s's stream.
func (o *Owner) waitStream(ctx context.Context, s *slab) error {
	s.copyMu.Lock()
	err := o.rt.EventRecord(s.dev, s.done, s.stream)
	s.copyMu.Unlock()
	if err != nil {
		return err
	}
	return o.waitDone(ctx, s)
}

// waitDone waits on the host until s's done event has completed or ctx ends (a later
// record of it, covering more, is waited for too).
func (o *Owner) waitDone(ctx context.Context, s *slab) error {
	err := o.waitEvent(ctx, s.dev, s.done)
	if err != nil && ctx.Err() != nil {
		return fmt.Errorf("%w: the owner's stream of device %d has not run: %w", kv.ErrClosed, s.dev, ctx.Err())
	}
	return err
}

// queueCopies queues the copies of pieces from src into dst on src's stream, under
// src's copy lock.
func (o *Owner) queueCopies(src, dst *slab, pieces []piece) error {
	g, layout := o.geo, o.layout
	for i := 0; i < len(pieces); {
		j := i + 1
		for j < len(pieces) && pieces[j].from == pieces[j-1].from+1 && pieces[j].dst == pieces[j-1].dst+1 {
			j++
		}
		n := uint64(j-i) * g.PageBytes()
		for l := range g.Layers {
			for _, part := range [2]kv.Part{kv.K, kv.V} {
				from := layout.Addr(src.bases, l, part, int(pieces[i].from))
				to := layout.Addr(dst.bases, l, part, int(pieces[i].dst))
				if err := o.rt.MemcpyDtoDAsync(src.dev, to, from, n, src.stream); err != nil {
					return err
				}
			}
		}
		i = j
	}
	return nil
}
