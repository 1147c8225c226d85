package owner

import (
	"context"
	"slices"
	"sync/atomic"
	"time"

	"github.com/cudapool/cudapool/cudart"
	"github.com/cudapool/cudapool/kv"
	"github.com/cudapool/cudapool/kv/internal/kvwire"
)

// record is work that waits for one record of a replica's event: a seal's pages to
// make visible (or, if the writer dies first, to free), pages to free (an aborted write
// lease, the pages a seal left without a hash) and read pages whose release settles.
type record struct {
	s        *slab
	seal     []uint32 // pages to publish under hashes
	hashes   []kv.Hash
	free     []uint32 // pages to free
	released []uint32 // sealed pages whose release settles
	// wait is the request to answer once the seal is settled (a Seal with FlagWait).
	wait    uint32
	waiting bool
	// Set when settled.
	done               bool
	visible, duplicate int
}

// event is a replica's IPC event as the owner opened it, with the records that wait for
// it in the order they came. A later record of the event covers earlier ones: the
// replica records it on one stream.
type event struct {
	c        *conn
	ev       cudart.Event // 0 for the zero handle: nothing to wait for
	pending  []*record    // guarded by Owner.mu
	appended uint64       // records ever appended; guarded by Owner.mu
	settled  uint64       // records ever settled; guarded by Owner.mu
	polled   bool         // in Owner.polling; guarded by Owner.mu
	failed   atomic.Bool  // a query failed, and that was logged
}

// settle applies rec under o.mu: seal pages become visible if publish (else they are
// freed: their writer died first), the rest are freed or their release settles.
func (o *Owner) settle(rec *record, publish bool) {
	s := rec.s
	if publish {
		// Deepest first, so that the parent is the more recent in the LRU list.
		for i := len(rec.seal) - 1; i >= 0; i-- {
			if s.publish(rec.seal[i], rec.hashes[i]) {
				rec.visible++
			} else {
				rec.duplicate++
			}
		}
	} else {
		for _, p := range rec.seal {
			s.release(p)
		}
	}
	for _, p := range rec.free {
		s.release(p)
	}
	for _, p := range rec.released {
		s.pages[p].releasing--
	}
	s.j.flush()
	rec.done = true
}

// append queues rec behind e, under o.mu, and returns how many records e will have had
// once it is there: a query of e that says complete settles that many.
func (e *event) append(rec *record) uint64 {
	e.pending = append(e.pending, rec)
	e.appended++
	return e.appended
}

// settleUpTo settles e's records up to the upTo'th ever appended, under o.mu, and
// returns the answers owed to Seals that waited.
func (o *Owner) settleUpTo(e *event, upTo uint64, publish bool, owed []answer) []answer {
	k := 0
	for e.settled < upTo && k < len(e.pending) {
		rec := e.pending[k]
		o.settle(rec, publish)
		if rec.waiting {
			owed = append(owed, answer{c: e.c, id: rec.wait, sealed: kvwire.Sealed{Visible: uint32(rec.visible), Duplicates: uint32(rec.duplicate)}, dead: !publish})
		}
		e.settled++
		k++
	}
	n := copy(e.pending, e.pending[k:])
	clear(e.pending[n:])
	e.pending = e.pending[:n]
	if n == 0 && e.c.idle != nil {
		o.signalIdle(e.c)
	}
	return owed
}

// answer is a reply owed to a Seal that waited, sent once o.mu is released.
type answer struct {
	c      *conn
	id     uint32
	sealed kvwire.Sealed
	dead   bool // the writer died: nobody to answer
}

// send sends owed, each on a goroutine of its own: the poller never waits for a
// replica that does not read.
func (o *Owner) send(owed []answer) {
	for _, a := range owed {
		if !a.dead {
			go a.c.sendSealed(a.id, a.sealed)
		}
	}
}

// query says whether e's latest record has completed, or its replica's process has
// exited (dead): it asks the process first, so that no event of a dead process is
// used. (A process that dies between the two answers has its event queried after its
// exit: the driver answers such a query, never completing it, and the software device
// reports it. The poller leaves alone the events of connections that hung up, which a
// dying process's do first.) A query that fails says neither; it is logged once per
// event.
func (o *Owner) query(e *event) (done, dead bool) {
	if e.ev == 0 {
		return true, false
	}
	if e.c.exited() {
		return false, true
	}
	ok, err := o.rt.EventQuery(e.c.s.dev, e.ev)
	if err != nil {
		if e.c.exited() {
			return false, true
		}
		if !e.failed.Swap(true) {
			o.log.Warn("kv: querying a replica's event failed; its pages wait for the replica's exit", "pid", e.c.cred.PID, "err", err)
		}
		return false, false
	}
	return ok, false
}

// wake tells the poller that there is new work.
func (o *Owner) wake() {
	select {
	case o.wakeCh <- struct{}{}:
	default:
	}
}

// Poller backoff: it asks the pending events again after 10 µs, doubling to 1 ms while
// nothing completes.
const (
	pollMin = 10 * time.Microsecond
	pollMax = time.Millisecond
)

// poll settles the records that wait for events, until ctx ends.
func (o *Owner) poll(ctx context.Context) {
	defer close(o.pollDone)
	backoff := pollMin
	timer := time.NewTimer(time.Hour)
	defer timer.Stop()
	type target struct {
		e    *event
		upTo uint64
	}
	type result struct{ done, dead bool }
	var targets []target
	var results []result
	var owed []answer
	var dead []*conn
	for {
		o.mu.Lock()
		dead = append(dead[:0], o.dead...)
		clear(o.dead)
		o.dead = o.dead[:0]
		targets = targets[:0]
		kept := o.polling[:0]
		for _, e := range o.polling {
			if len(e.pending) == 0 {
				e.polled = false
				continue
			}
			kept = append(kept, e)
			if e.c.lost {
				// Its process is exiting or gone: its records wait for the exit,
				// which drops them, instead of a query of an event that may die
				// between the pidfd's answer and the query's.
				continue
			}
			targets = append(targets, target{e, e.appended})
		}
		clear(o.polling[len(kept):])
		o.polling = kept
		o.mu.Unlock()
		o.destroyEvents(dead)
		clear(dead)

		if len(targets) == 0 {
			backoff = pollMin
			select {
			case <-o.wakeCh:
				continue
			case <-ctx.Done():
				return
			}
		}
		progress := false
		results = slices.Grow(results[:0], len(targets))[:len(targets)]
		for i, t := range targets {
			results[i].done, results[i].dead = o.query(t.e)
		}
		o.mu.Lock()
		for i, t := range targets {
			switch r := results[i]; {
			case r.dead:
				owed = o.exitedLocked(t.e.c, owed)
				progress = true
			case r.done:
				owed = o.settleUpTo(t.e, t.upTo, true, owed)
				progress = true
			}
		}
		o.mu.Unlock()
		o.send(owed)
		clear(owed)
		owed = owed[:0]
		if progress {
			backoff = pollMin
		} else {
			backoff = min(2*backoff, pollMax)
		}
		timer.Reset(backoff)
		select {
		case <-timer.C:
		case <-o.wakeCh:
		case <-ctx.Done():
			return
		}
	}
}

// enqueue puts e on the poller's list, under o.mu.
func (o *Owner) enqueue(e *event) {
	if !e.polled {
		e.polled = true
		o.polling = append(o.polling, e)
	}
}

// destroyEvents destroys the events of connections that ended (taken off o.dead) and
// closes the handles on their processes, without o.mu (so that thousands of events
// stall nobody), from the poller alone (or once it has stopped): no query of them is
// in flight then, and none comes, as they have nothing pending.
func (o *Owner) destroyEvents(dead []*conn) {
	for _, c := range dead {
		for _, e := range c.events {
			if e.ev != 0 {
				if err := o.rt.EventDestroy(c.s.dev, e.ev); err != nil {
					o.log.Debug("kv: destroying a replica's event", "pid", c.cred.PID, "err", err)
				}
			}
		}
		if c.proc != nil {
			_ = c.proc.Close() // cleanup: nothing is left to do if closing fails
		}
	}
}
