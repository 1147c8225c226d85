package owner

import (
	"context"
	"errors"
	"fmt"

	"github.com/cudapool/cudapool/kv"
	"github.com/cudapool/cudapool/kv/internal/kvwire"
)

// elsewhereLocked says whether h is visible in a slab other than s, under o.mu.
func (o *Owner) elsewhereLocked(s *slab, h kv.Hash) bool {
	for _, other := range o.slabs {
		if other != s {
			if _, ok := other.index[h]; ok {
				return true
			}
		}
	}
	return false
}

// piece is one page of a match run: where it is on the replica's device, and for a
// page to copy, where it comes from.
type piece struct {
	dst  uint32
	src  *slab // nil: visible on the replica's device already
	from uint32
}

// matchAcross answers a Match whose run goes on in other devices' slabs: it takes the
// run (pages visible on the replica's device, or on another device), allocates pages
// on the replica's device for those of other devices, copies them on a stream of their
// device, waits for the copy on the host, seals the copies and leases the whole run.
// If the replica's slab has no room for the copies, the run ends before the first.
func (c *conn) matchAcross(h kvwire.Header, hashes []kv.Hash) error {
	o, s := c.o, c.s
	if !o.awaitResumed() {
		return c.refuse(h.ID, fmt.Errorf("%w: the owner is closing", kv.ErrClosed))
	}
	o.mu.Lock()
	run := make([]piece, 0, len(hashes))
	copies := 0
	for _, hh := range hashes {
		if p, ok := s.index[hh]; ok {
			run = append(run, piece{dst: p})
			continue
		}
		var src *slab
		var from uint32
		for _, other := range o.slabs {
			if p, ok := other.index[hh]; ok && other != s {
				src, from = other, p
				break
			}
		}
		if src == nil {
			break
		}
		run = append(run, piece{src: src, from: from})
		copies++
	}
	// Hold every page of the run (readers), so that none is evicted meanwhile, then
	// find room for the copies.
	for _, pc := range run {
		if pc.src == nil {
			s.pages[pc.dst].readers++
		} else {
			pc.src.pages[pc.from].readers++
		}
	}
	evictions := s.stats.Evictions
	dsts, ok := s.take(copies, make([]uint32, 0, copies))
	var wait uint64 // the evictions' records, in the index before the copies overwrite the pages
	if s.stats.Evictions != evictions {
		wait = s.lastFree
	}
	if !ok {
		cut := 0
		for cut < len(run) && run[cut].src == nil {
			cut++
		}
		o.unholdLocked(s, run[cut:])
		run, copies, dsts = run[:cut], 0, nil
	}
	k := 0
	for i := range run {
		if run[i].src != nil {
			run[i].dst = dsts[k]
			k++
		}
	}
	o.mu.Unlock()

	err := o.journaled(o.stopped, wait)
	if err == nil {
		err = o.copyRun(s, run)
	}

	o.mu.Lock()
	pages := make([]uint32, 0, len(run))
	for i, pc := range run {
		if pc.src == nil {
			pages = append(pages, pc.dst)
			continue
		}
		pc.src.pages[pc.from].readers--
		if err != nil {
			s.release(pc.dst)
			continue
		}
		// Another copy (or a seal) may have made the hash visible here meanwhile.
		if p, dup := s.index[hashes[i]]; dup {
			s.release(pc.dst)
			s.pages[p].readers++
			pages = append(pages, p)
			continue
		}
		parent := noLink
		if len(pages) > 0 {
			parent = s.linkOf(pages[len(pages)-1])
		}
		s.publish(pc.dst, hashes[i], parent)
		s.pages[pc.dst].readers++
		s.stats.Copied++
		pages = append(pages, pc.dst)
	}
	if err != nil {
		for _, p := range pages {
			s.pages[p].readers--
		}
		o.mu.Unlock()
		return c.sendError(h.ID, fmt.Errorf("copying pages to device %d: %w", s.dev, err))
	}
	for _, p := range pages {
		s.pages[p].readers-- // leaseRunLocked takes the reader back
	}
	return c.answerMatchLocked(h.ID, hashes, pages)
}

// unholdLocked drops the readers matchAcross took on run, under o.mu.
func (o *Owner) unholdLocked(s *slab, run []piece) {
	for _, pc := range run {
		if pc.src == nil {
			s.pages[pc.dst].readers--
		} else {
			pc.src.pages[pc.from].readers--
		}
	}
}

// copyRun copies the pages of run that come from other slabs into s, every layer's K
// and V, on the stream of the source's device, and waits for the copies on the host.
// Pages that follow each other in both slabs are copied as one range.
func (o *Owner) copyRun(s *slab, run []piece) error {
	for i := 0; i < len(run); {
		src := run[i].src
		if src == nil {
			i++
			continue
		}
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
	g, segs := o.geo, o.segs
	for i := 0; i < len(pieces); {
		j := i + 1
		for j < len(pieces) && pieces[j].from == pieces[j-1].from+1 && pieces[j].dst == pieces[j-1].dst+1 {
			j++
		}
		n := uint64(j-i) * g.PageBytes()
		for l := range g.Layers {
			for _, part := range [2]kv.Part{kv.K, kv.V} {
				from := segs.Addr(src.bases, l, part, int(pieces[i].from))
				to := segs.Addr(dst.bases, l, part, int(pieces[i].dst))
				if err := o.rt.MemcpyDtoDAsync(src.dev, to, from, n, src.stream); err != nil {
					return err
				}
			}
		}
		i = j
	}
	return nil
}
