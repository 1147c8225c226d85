package owner

import (
	"sync/atomic"

	"github.com/cudapool/cudapool/cudart"
	"github.com/cudapool/cudapool/kv/internal/kvwire"
	"github.com/cudapool/cudapool/kv/internal/pages"
)

// record is work that waits for one record of a replica's event: a sealed write
// lease to settle (its pages made visible, or, if the writer dies first, freed) and
// leases released whose pages settle (Table.SealDone, Table.ReleaseDone).
type record struct {
	s        *slab
	seal     pages.LeaseID   // the lease sealed, 0 if none
	released []pages.LeaseID // the leases released
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
	watched  bool         // its waiter runs (Owner.waitFor); guarded by Owner.mu
	orphan   bool         // its connection ended while its waiter ran; guarded by Owner.mu
	failed   atomic.Bool  // a query failed, and that was logged
}

// settle applies rec under o.mu: the sealed lease's pages become visible if publish
// (else they are freed: their writer died first), the released leases end. A lease
// the table no longer holds (its holder was declared dead after a restart) is skipped.
func (o *Owner) settle(rec *record, publish bool) {
	s := rec.s
	if rec.seal != 0 {
		if v, d, fx, err := s.tab.SealDone(rec.seal, publish); err == nil {
			rec.visible, rec.duplicate = v, d
			o.effectsLocked(s, fx)
		}
	}
	for _, id := range rec.released {
		if fx, err := s.tab.ReleaseDone(id); err == nil {
			o.effectsLocked(s, fx)
		}
	}
	rec.done = true
	s.spaceLocked()
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
			owed = append(owed, answer{c: e.c, id: rec.wait, sealed: kvwire.Sealed{Visible: uint32(rec.visible), Duplicates: uint32(rec.duplicate)}, dead: !publish, seq: o.ix.Queued()})
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
	dead   bool   // the writer died: nobody to answer
	seq    uint64 // the seal's records: it is answered once the index has them
}

// send sends owed, each on a goroutine of its own once the index has its records: a
// waiter never waits for a replica that does not read, nor for the index.
func (o *Owner) send(owed []answer) {
	for _, a := range owed {
		if !a.dead {
			go func() {
				_ = o.journaled(o.stopped, a.seq) // visible already: an index that failed, or a close, was said elsewhere
				a.c.sendSealed(a.id, a.sealed)
			}()
		}
	}
}

// query says whether e's latest record has completed, or its replica's process has
// exited (dead). It asks the process before and after the query: a query's answer
// counts only if the process was alive after it, so that no answer about an event
// whose process had died is used, and a process seen dead before is not queried at
// all. (Between the two answers the process may die; the query is then of a dying
// process's event, and its answer is dropped. What the driver does with such a query
// is not measured, docs/FACTS.md 24.) A query that fails says neither; it is logged
// once per event.
func (o *Owner) query(e *event) (done, dead bool) {
	if e.ev == 0 {
		return true, false
	}
	if e.c.exited() {
		return false, true
	}
	o.queries.Add(1)
	ok, err := o.rt.EventQuery(e.c.s.dev, e.ev)
	if e.c.exited() {
		return false, true
	}
	if err != nil {
		if !e.failed.Swap(true) {
			o.log.Warn("kv: querying a replica's event failed; its pages wait for the replica's exit", "pid", e.c.cred.PID, "err", err)
		}
		return false, false
	}
	return ok, false
}

// sync waits, on the host, until e's latest record has completed, or reports that its
// replica's process has exited (dead), with the same checks of the process as query.
// On driver 580 the wait spins a CPU for as long as the replica's work runs, although
// the replica creates its events with cudart.EventBlockingSync (docs/FACTS.md 24): an
// owner spends a CPU per event with records pending, none when idle. A wait that fails
// says neither; it is logged once per event.
func (o *Owner) sync(e *event) (done, dead bool) {
	if e.ev == 0 {
		return true, false
	}
	if e.c.exited() {
		return false, true
	}
	o.waits.Add(1)
	err := o.rt.EventSynchronize(e.c.s.dev, e.ev)
	if e.c.exited() {
		return false, true
	}
	if err != nil {
		if !e.failed.Swap(true) {
			o.log.Warn("kv: waiting for a replica's event failed; its pages wait for the replica's exit", "pid", e.c.cred.PID, "err", err)
		}
		return false, false
	}
	return true, false
}

// waitFor settles e's records as e's records complete: one goroutine per event with
// records pending, blocked in the driver's wait (sync) while the replica's work runs,
// so that pages become visible as soon as the writer's work has completed and an owner
// with nothing pending runs nothing. It returns once e has no records pending, its
// connection was lost (its records then wait for the process's exit), a wait failed,
// or the owner closes; the event is destroyed here if its connection ended meanwhile.
func (o *Owner) waitFor(e *event) {
	defer o.waiters.Done()
	var owed []answer
	for {
		o.mu.Lock()
		if len(e.pending) == 0 || e.c.lost || o.closed || e.failed.Load() {
			e.watched = false
			o.destroyOrphanLocked(e)
			o.mu.Unlock()
			return
		}
		upTo := e.appended
		o.mu.Unlock()
		done, dead := o.sync(e)
		o.mu.Lock()
		switch {
		case dead:
			owed = o.exitedLocked(e.c, owed)
		case done:
			owed = o.settleUpTo(e, upTo, true, owed)
		}
		o.mu.Unlock()
		o.send(owed)
		clear(owed)
		owed = owed[:0]
	}
}

// destroyOrphanLocked destroys e, under o.mu, if its connection has ended while e's
// waiter was in the driver's wait (destroyEvents left it to the waiter), and closes the
// handle on the connection's process after its last such event.
func (o *Owner) destroyOrphanLocked(e *event) {
	if e.orphan {
		e.orphan = false
		o.destroyEvent(e)
		if e.c.orphans--; e.c.orphans == 0 && e.c.proc != nil {
			_ = e.c.proc.Close() // cleanup: nothing is left to do if closing fails
		}
	}
}

// Pace counts the owner's calls about replicas' events since it started: Queries
// (cudaEventQuery, one at each seal and release) and Waits (cudaEventSynchronize, one
// per event for each run of records that was pending when the wait began), and how
// many waits are in flight now (Waiting). An owner with nothing pending makes none.
type Pace struct {
	Queries, Waits uint64
	Waiting        int
	// AllocWaits counts the Allocs that waited for pages to settle.
	AllocWaits uint64
}

// Pace is a snapshot of the owner's event calls.
func (o *Owner) Pace() Pace {
	o.mu.Lock()
	n := o.waiting
	o.mu.Unlock()
	return Pace{Queries: o.queries.Load(), Waits: o.waits.Load(), Waiting: n, AllocWaits: o.allocWaits.Load()}
}

// enqueue starts e's waiter (waitFor) if it has none, under o.mu.
func (o *Owner) enqueue(e *event) {
	if !e.watched && !o.closed {
		e.watched = true
		o.waiting++
		o.waiters.Add(1)
		go func() {
			o.waitFor(e)
			o.mu.Lock()
			o.waiting--
			o.mu.Unlock()
		}()
	}
}

// takeDeadLocked takes the connections that ended off o.dead, under o.mu, with what
// destroyEvents is to destroy of each: an event whose waiter is in the driver's wait is
// left to the waiter, which destroys it when the wait returns (and the handle on the
// process, which the waiter asks, after the last such event): no event or handle is
// closed while a call uses it.
func (o *Owner) takeDeadLocked() []doomed {
	var ds []doomed
	for _, c := range o.dead {
		d := doomed{c: c}
		for _, e := range c.events {
			if e.watched {
				e.orphan = true
				c.orphans++
				continue
			}
			d.events = append(d.events, e)
		}
		d.closeProc = c.proc != nil && c.orphans == 0
		ds = append(ds, d)
	}
	clear(o.dead)
	o.dead = o.dead[:0]
	return ds
}

// doomed is what destroyEvents destroys of a connection that ended.
type doomed struct {
	c         *conn
	events    []*event
	closeProc bool
}

// destroyEvents destroys what takeDeadLocked took, without o.mu, so that thousands of
// events stall nobody: nothing else uses those events or handles any more.
func (o *Owner) destroyEvents(ds []doomed) {
	for _, d := range ds {
		for _, e := range d.events {
			o.destroyEvent(e)
		}
		if d.closeProc {
			_ = d.c.proc.Close() // cleanup: nothing is left to do if closing fails
		}
	}
}

// destroyEvent destroys e's driver event, if it has one.
func (o *Owner) destroyEvent(e *event) {
	if e.ev != 0 {
		if err := o.rt.EventDestroy(e.c.s.dev, e.ev); err != nil {
			o.log.Debug("kv: destroying a replica's event", "pid", e.c.cred.PID, "err", err)
		}
		e.ev = 0
	}
}
