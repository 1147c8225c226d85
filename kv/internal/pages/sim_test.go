package pages_test

import (
	"container/heap"
	"encoding/binary"
	"errors"
	"flag"
	"fmt"
	"math/rand/v2"
	"os"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/cudapool/cudapool/kv"
	"github.com/cudapool/cudapool/kv/internal/pages"
)

// The deterministic simulation of a pool (FoundationDB-style): one process, one
// seeded scheduler, virtual time. A simulated owner drives the page table and
// performs its effects: a journal that loses its unflushed tail when the owner dies
// (a flush in progress may leave part of it), GPU and host memory of every page,
// copies that take time and complete in seeded order, replies sent only once their
// records are durable and their copies done. Replica processes match chains of
// hashes and check every byte of every page they read against what its writer wrote
// ((hash, layer) determines it); writers allocate the rest of a chain, queue its
// writes on a slow stream and seal, often before the writes have landed. Writers,
// readers and the owner are killed at random points; the owner restarts from its
// journal with a reattach window and a grace; replicas reconnect, some late, and
// re-declare their leases. The slab is elastic: the owner maps chunks of pages as
// Allocs find no room and, at random, gives the last chunks back (Shrink, polled
// with Shrunk); their memory is released (junk from then on) once the journal is
// durable through what Shrunk says, and memory mapped again is junk too. A restart
// maps the memory still held. A seed replays exactly.

var (
	simSeeds    = flag.Int("sim.seeds", 0, "TestSim: seeds to run (0: a few, or as many as CUDAPOOL_SIM_DURATION allows)")
	simSeed     = flag.Uint64("sim.seed", 0, "TestSim: run this seed alone (replay a failure)")
	simFirst    = flag.Uint64("sim.first", 1, "TestSim: the first seed")
	simRules    = flag.String("sim.rules", "", "TestSim: rules to turn off, comma-separated: nostrand, endatseal, restoreinwindow, shrinktakes")
	simVerbose  = flag.Bool("sim.trace", false, "TestSim: log the simulation's events")
	simDuration = os.Getenv("CUDAPOOL_SIM_DURATION")
)

const (
	simLayers   = 4
	simChains   = 10
	simChainLen = 6
	simWriters  = 3
	simReaders  = 2
	simGrace    = 400 // ticks the window waits for late replicas
	simTicks    = 60000
)

// piece is what a page holds at layer for hash h: its writer writes it, a copy moves it.
func piece(h kv.Hash, layer int) uint64 {
	return binary.LittleEndian.Uint64(h[:8]) ^ binary.LittleEndian.Uint64(h[8:])*0x9e3779b97f4a7c15 ^ uint64(layer+1)<<56
}

// --- the scheduler ---

type event struct {
	at  int64
	seq uint64
	fn  func()
}

type queue []*event

func (q queue) Len() int { return len(q) }
func (q queue) Less(i, j int) bool {
	return q[i].at < q[j].at || q[i].at == q[j].at && q[i].seq < q[j].seq
}
func (q queue) Swap(i, j int) { q[i], q[j] = q[j], q[i] }
func (q *queue) Push(x any)   { *q = append(*q, x.(*event)) }
func (q *queue) Pop() any {
	old := *q
	e := old[len(old)-1]
	*q = old[:len(old)-1]
	return e
}

// simStats is what a run counted.
type simStats struct {
	seeds, restarts, replicaKills, ticks                  int
	killSealing, killSpilling, killRestoring, killJournal int
	pieces, wrong, matched, sealed, restores, spills      int
	lost, lostHeld, lateReattach, compactions             int
	grows, shrinks, shrunk, givenBack, killShrinking      int
	givenHeld                                             int // pages given back that a replica held
	firstWrong, firstGiven                                string
}

func (a *simStats) add(b simStats) {
	a.seeds += b.seeds
	a.restarts += b.restarts
	a.replicaKills += b.replicaKills
	a.ticks += b.ticks
	a.killSealing += b.killSealing
	a.killSpilling += b.killSpilling
	a.killRestoring += b.killRestoring
	a.killJournal += b.killJournal
	a.pieces += b.pieces
	a.wrong += b.wrong
	a.matched += b.matched
	a.sealed += b.sealed
	a.restores += b.restores
	a.spills += b.spills
	a.lost += b.lost
	a.lostHeld += b.lostHeld
	a.lateReattach += b.lateReattach
	a.compactions += b.compactions
	a.grows += b.grows
	a.shrinks += b.shrinks
	a.shrunk += b.shrunk
	a.givenBack += b.givenBack
	a.killShrinking += b.killShrinking
	a.givenHeld += b.givenHeld
	if a.firstWrong == "" {
		a.firstWrong = b.firstWrong
	}
	if a.firstGiven == "" {
		a.firstGiven = b.firstGiven
	}
}

func (a simStats) String() string {
	return fmt.Sprintf("%d seeds, %d owner restarts (%d with seals pending, %d mid-spill, %d mid-restore, %d with an unflushed journal, %d mid-shrink), %d replica kills, %d compactions; %d grows, %d shrinks (%d over, %d pages given back, %d of them held); %d pages matched, %d sealed, %d restored, %d spilled; %d pieces checked (%d bytes), %d wrong bytes; %d leases lost (%d in use), %d late reattaches",
		a.seeds, a.restarts, a.killSealing, a.killSpilling, a.killRestoring, a.killJournal, a.killShrinking, a.replicaKills, a.compactions,
		a.grows, a.shrinks, a.shrunk, a.givenBack, a.givenHeld,
		a.matched, a.sealed, a.restores, a.spills, a.pieces, 8*a.pieces, 8*a.wrong, a.lost, a.lostHeld, a.lateReattach)
}

type sim struct {
	r     *rand.Rand
	now   int64
	q     queue
	seq   uint64
	rules pages.Rules
	st    simStats
	trace func(string, ...any)

	cfg   pages.Config
	chunk int // pages mapped or given back at once
	// held is how many pages' memory is held (what a restart maps): Mapped, or
	// more while memory given back waits for the journal (release, freeAt).
	held    int
	release bool
	freeAt  pages.Seq
	gmem    [][simLayers]uint64
	hmem    [][simLayers]uint64
	journal []pages.Record // what the journal file holds
	durable int            // of which this many are on disk
	owner   *sowner        // nil while down
	reps    []*srep
	chains  [simChains][simChainLen]kv.Hash
	starts  uint64
	err     error // an invariant of the table broke
	stop    bool  // a wrong byte was read
}

// durableSeq is the sequence number of the last record on disk.
func (s *sim) durableSeq() pages.Seq { return s.journal[s.durable-1].Seq }

func (s *sim) after(d int64, fn func()) {
	s.seq++
	heap.Push(&s.q, &event{at: s.now + d, seq: s.seq, fn: fn})
}

func (s *sim) delay(lo, hi int) int64 { return int64(lo + s.r.IntN(hi-lo+1)) }

// --- the owner ---

type sowner struct {
	s       *sim
	tab     *pages.Table
	copies  map[pages.CopyID]*scopy
	done    map[pages.CopyID]bool
	replies []sreply
	waiting []func() // requests that wait for the window or for pages to settle
	tips    map[pages.Holder]tip
	// restoring are the matches whose restore copy is in flight, by copy.
	restoring map[pages.CopyID]*restoreReply
	flushAt   bool // a flush is scheduled
}

// tip is a holder's latest match: a seal that continues it links to its last page.
type tip struct {
	next kv.Hash
	ref  pages.Ref
}

type scopy struct {
	c       pages.Copy
	started bool
}

type sreply struct {
	wait  pages.Seq
	await []pages.CopyID
	send  func()
}

func (s *sim) startOwner() {
	rec, err := pages.Replay(s.journal[:s.durable])
	if err != nil {
		s.err = fmt.Errorf("replay: %w", err)
		return
	}
	s.journal = s.journal[:s.durable]
	s.cfg.Epoch++
	s.cfg.Pages, s.release = s.held, false // the memory held is mapped again
	tab, err := pages.RestartWith(s.cfg, rec, s.rules)
	if err != nil {
		s.err = fmt.Errorf("restart: %w", err)
		return
	}
	o := &sowner{s: s, tab: tab, copies: map[pages.CopyID]*scopy{}, done: map[pages.CopyID]bool{},
		tips: map[pages.Holder]tip{}, restoring: map[pages.CopyID]*restoreReply{}}
	s.owner = o
	s.trace("owner up, epoch %d: %d sealed, %d host, %d grants, window %v", s.cfg.Epoch, len(rec.Sealed), len(rec.Host), len(rec.Leases), tab.Window())
	// The predecessor's replicas that have exited are dead now.
	for _, h := range tab.Expected() {
		if !s.alive(h) {
			o.do(tab.HolderDead(h))
		}
	}
	if tab.Window() {
		s.after(simGrace, func() {
			if s.owner == o && o.tab.Window() {
				s.trace("grace over: window closed")
				o.tab.CloseWindow()
				o.retry()
			}
		})
	}
	o.spiller()
	o.shrinker()
	for _, r := range s.reps {
		if r.alive {
			r.reconnectLater()
		}
	}
}

func (s *sim) alive(h pages.Holder) bool {
	for _, r := range s.reps {
		if r.alive && r.holder == h {
			return true
		}
	}
	return false
}

// do performs effects: records to the journal (a flush later), copies started once
// they may, replies sent once their records are durable and copies done.
func (o *sowner) do(fx pages.Effects) {
	s := o.s
	if !fx.Empty() {
		s.trace("t=%d effects %+v", s.now, fx)
	}
	for _, r := range fx.Records {
		if last := s.journal[len(s.journal)-1].Seq; r.Seq != last+1 && s.err == nil {
			s.err = fmt.Errorf("record %v numbered %d after %d", r.Kind, r.Seq, last)
		}
		s.journal = append(s.journal, r)
	}
	for _, c := range fx.Copies {
		o.copies[c.ID] = &scopy{c: c}
	}
	if len(fx.Records) > 0 && !o.flushAt {
		o.flushAt = true
		s.after(s.delay(1, 30), func() {
			if s.owner == o {
				o.flushAt = false
				s.durable = len(s.journal)
				o.released()
				o.compact()
				o.progress()
			}
		})
	}
	o.progress()
}

// reply sends an answer once fx's records are durable and its copies done.
func (o *sowner) reply(fx pages.Effects, send func()) {
	o.replies = append(o.replies, sreply{wait: fx.Wait, await: fx.Await, send: send})
	o.do(fx)
}

// progress starts the copies that may start and sends the replies that may go.
func (o *sowner) progress() {
	s := o.s
	for _, id := range slices.Sorted(mapsKeys(o.copies)) {
		c := o.copies[id]
		if c.started || c.c.After > s.durableSeq() || slices.ContainsFunc(c.c.Wait, func(w pages.CopyID) bool { return !o.done[w] }) {
			continue
		}
		c.started = true
		s.after(s.delay(5, 60), func() {
			if s.owner == o {
				o.copyDone(c)
			}
		})
	}
	keep := o.replies[:0]
	var send []func()
	for _, rp := range o.replies {
		if rp.wait <= s.durableSeq() && !slices.ContainsFunc(rp.await, func(w pages.CopyID) bool { return !o.done[w] }) {
			send = append(send, rp.send)
		} else {
			keep = append(keep, rp)
		}
	}
	o.replies = keep
	for _, f := range send {
		s.after(s.delay(1, 5), f)
	}
}

// land moves a copy's bytes; at a crash, some layers only.
func (s *sim) land(c pages.Copy, partial bool) {
	for i, gp := range c.GPU {
		for l := range simLayers {
			if partial && s.r.IntN(2) == 0 {
				continue
			}
			if c.Kind == pages.Spill {
				s.hmem[c.Host[i]][l] = s.gmem[gp][l]
			} else {
				s.gmem[gp][l] = s.hmem[c.Host[i]][l]
			}
		}
	}
}

func (o *sowner) copyDone(c *scopy) {
	s := o.s
	ok := s.r.IntN(50) != 0
	if ok {
		s.land(c.c, false)
	}
	delete(o.copies, c.c.ID)
	o.done[c.c.ID] = true
	s.trace("t=%d copy done %+v ok %v", s.now, c.c, ok)
	res, fx, err := o.tab.CopyDone(c.c.ID, ok)
	o.check(err)
	if c.c.Kind == pages.Spill {
		s.st.spills += len(c.c.GPU)
	} else if ok {
		s.st.restores += len(c.c.GPU)
	}
	if c.c.Kind == pages.Restore {
		if r := o.restoring[c.c.ID]; r != nil {
			delete(o.restoring, c.c.ID)
			o.reply(fx, func() { r.rep.matched(r.inc, r.hashes, res) })
			o.noteTip(r.rep.holder, r.hashes, res)
			o.retry()
			return
		}
	}
	o.do(fx)
	o.retry()
}

func (o *sowner) check(err error) {
	if err != nil && o.s.err == nil {
		o.s.err = err
	}
	if err := o.tab.Check(); err != nil && o.s.err == nil {
		o.s.err = err
	}
}

// spiller copies ahead now and then.
func (o *sowner) spiller() {
	s := o.s
	s.after(s.delay(20, 80), func() {
		if s.owner != o {
			return
		}
		_, fx, _ := o.tab.PickSpill(8, 4)
		o.do(fx)
		o.check(nil)
		o.spiller()
	})
}

// grow maps chunks for an Alloc of n pages that found no room, up to the Bound:
// always when no shrink is in progress (taking back pages given back), now and
// then during one, never while memory waits to be released.
func (o *sowner) grow(n int) bool {
	s := o.s
	limit, shrinking := o.tab.Shrinking()
	if s.release || limit >= s.cfg.Bound || shrinking && s.r.IntN(4) != 0 {
		return false
	}
	to := min(s.cfg.Bound, limit+s.chunk*((n+s.chunk-1)/s.chunk))
	s.trace("t=%d grow to %d", s.now, to)
	o.check(o.tab.Grow(to))
	for p := s.held; p < to; p++ {
		s.gmem[p] = garble(p)
	}
	s.held = max(s.held, to)
	s.st.grows++
	return true
}

// garble is what memory just mapped, or given back, holds.
func garble(p int) [simLayers]uint64 {
	var j [simLayers]uint64
	for l := range j {
		j[l] = 0xdead0000_00000000 | uint64(p)<<8 | uint64(l)
	}
	return j
}

// shrinker gives the last chunks back now and then, and polls the shrink.
func (o *sowner) shrinker() {
	s := o.s
	s.after(s.delay(200, 2500), func() {
		if s.owner != o {
			return
		}
		limit, shrinking := o.tab.Shrinking()
		if !shrinking && !s.release && limit > s.chunk {
			to := max(s.chunk, limit-s.chunk*(1+s.r.IntN(3)))
			fx, err := o.tab.Shrink(to)
			s.trace("t=%d shrink to %d: %v", s.now, to, err)
			o.check(err)
			s.st.shrinks++
			o.do(fx)
			o.check(nil)
			o.poll()
		}
		o.shrinker()
	})
}

// poll evicts the pages given back that have come free and asks whether the
// shrink is over, now and then, until it is (or a grow took its pages back).
func (o *sowner) poll() {
	s := o.s
	s.after(s.delay(5, 30), func() {
		if s.owner != o {
			return
		}
		if _, ok := o.tab.Shrinking(); !ok {
			return // grown back
		}
		fx, left := o.tab.Drain()
		o.do(fx)
		o.check(nil)
		if left > 0 {
			o.poll()
			return
		}
		to, wait, err := o.tab.Shrunk()
		o.check(err)
		s.trace("t=%d shrunk to %d, release after %d", s.now, to, wait)
		for _, r := range s.reps {
			for _, l := range r.leases {
				// A lease held (not sealed or released: those the table settles once
				// the holder's work is done) is in use.
				if r.alive && l.state == lHeld && slices.ContainsFunc(l.pages, func(p uint32) bool { return int(p) >= to }) {
					s.st.givenHeld++
					if s.st.firstGiven == "" {
						s.st.firstGiven = fmt.Sprintf("t=%d: shrunk to %d pages while replica %d holds lease %d of pages %v", s.now, to, r.idx, l.id, l.pages)
					}
				}
			}
		}
		s.st.shrunk++
		s.release, s.freeAt = true, wait
		o.released()
	})
}

// released releases the memory given back once the journal is durable through
// what Shrunk said.
func (o *sowner) released() {
	s := o.s
	if !s.release || s.freeAt > s.durableSeq() {
		return
	}
	to := o.tab.Mapped()
	s.trace("t=%d memory of pages %d..%d released", s.now, to, s.held)
	for p := to; p < s.held; p++ {
		s.gmem[p] = garble(p)
	}
	s.st.givenBack += s.held - to
	s.held, s.release = to, false
}

// compact rewrites the journal as a snapshot once it has grown, atomically: the
// snapshot's last record carries the table's sequence number, and the records that
// follow go on from it.
func (o *sowner) compact() {
	s := o.s
	if len(s.journal) < 8*s.cfg.Pages || s.durable != len(s.journal) {
		return
	}
	snap := append(o.tab.Snapshot(), pages.Record{Kind: pages.RecEnd}) // an end of no lease: the mark
	for i := range snap {
		snap[i].Seq = 0
	}
	snap[len(snap)-1].Seq = o.tab.Seq()
	s.journal = snap
	s.durable = len(s.journal)
	s.st.compactions++
}

// retry runs the requests that waited: the window may have closed, pages settled.
func (o *sowner) retry() {
	w := o.waiting
	o.waiting = nil
	for _, f := range w {
		f()
	}
}

// noteTip remembers a holder's latest match, for the parent of its next seal.
func (o *sowner) noteTip(h pages.Holder, hashes []kv.Hash, res pages.MatchResult) {
	if n := len(res.Pages); n > 0 && n < len(hashes) {
		_, _, gen := o.tab.Page(res.Pages[n-1])
		o.tips[h] = tip{next: hashes[n], ref: pages.Ref{Page: res.Pages[n-1], Gen: gen}}
	}
}

// --- requests, as the owner serves them ---

func (o *sowner) match(r *srep, inc int, hashes []kv.Hash) {
	res, fx, err := o.tab.Match(r.holder, hashes)
	if errors.Is(err, pages.ErrWait) {
		o.waiting = append(o.waiting, func() { o.match(r, inc, hashes) })
		return
	}
	o.check(err)
	if res.Pending {
		i := slices.IndexFunc(fx.Copies, func(c pages.Copy) bool { return c.Kind == pages.Restore })
		o.restoring[fx.Copies[i].ID] = &restoreReply{rep: r, inc: inc, hashes: hashes}
		o.do(fx)
		return
	}
	o.noteTip(r.holder, hashes, res)
	o.s.trace("t=%d match by %d: %+v", o.s.now, r.idx, res)
	o.reply(fx, func() { r.matched(inc, hashes, res) })
}

type restoreReply struct {
	rep    *srep
	inc    int
	hashes []kv.Hash
}

func (o *sowner) alloc(r *srep, inc, n int, hashes []kv.Hash) {
	id, pgs, fx, err := o.tab.Alloc(r.holder, n)
	switch {
	case errors.Is(err, pages.ErrWait), errors.Is(err, pages.ErrSettling):
		o.waiting = append(o.waiting, func() { o.alloc(r, inc, n, hashes) })
		return
	case errors.Is(err, pages.ErrNoSpace):
		if o.grow(n) {
			o.alloc(r, inc, n, hashes)
			return
		}
		o.s.after(1, func() { r.noSpace(inc) })
		return
	}
	o.check(err)
	o.s.trace("t=%d alloc by %d: lease %d pages %v", o.s.now, r.idx, id, pgs)
	o.reply(fx, func() { r.leased(inc, id, pgs, hashes) })
}

func (o *sowner) seal(r *srep, inc int, l *rlease, pos int) {
	parent := pages.NoRef
	if t, ok := o.tips[r.holder]; ok && len(l.hashes) > 0 && t.next == l.hashes[0] {
		parent = t.ref
	}
	fx, err := o.tab.Seal(r.holder, l.id, l.hashes, parent)
	o.s.trace("t=%d seal by %d of %d pages %v parent %v: %v", o.s.now, r.idx, l.id, l.pages, parent, err)
	if err != nil {
		o.s.trace("seal of %d refused: %v", l.id, err)
		o.s.after(1, func() { r.sealed(inc, l, false) })
		return
	}
	o.do(fx)
	o.check(nil)
	// The owner waits for the replica's event: its stream past pos.
	r.onStream(pos, func() {
		if o.s.owner != o {
			return
		}
		if _, ok := o.tab.Lease(l.id); !ok {
			return // the writer died first: HolderDead settled it
		}
		o.s.trace("t=%d seal done %d", o.s.now, l.id)
		v, _, fx, err := o.tab.SealDone(l.id, true)
		o.check(err)
		o.s.st.sealed += v
		o.reply(fx, func() { r.sealed(inc, l, true) })
		o.retry()
	})
}

func (o *sowner) release(r *srep, inc int, l *rlease, pos int) {
	o.s.trace("t=%d release by %d of %d", o.s.now, r.idx, l.id)
	if err := o.tab.Release(r.holder, l.id); err != nil {
		o.s.trace("release of %d refused: %v", l.id, err)
		o.s.after(1, func() { r.released(inc, l) })
		return
	}
	o.check(nil)
	// The release's event: the replica's stream past pos (its reads are
	// synchronous here; an aborted write's writes are not).
	r.onStream(pos, func() {
		if o.s.owner != o {
			return
		}
		if _, ok := o.tab.Lease(l.id); !ok {
			return
		}
		fx, err := o.tab.ReleaseDone(l.id)
		o.check(err)
		o.reply(fx, func() { r.released(inc, l) })
		o.retry()
	})
}

func (o *sowner) reattach(r *srep, inc int, ls []*rlease) {
	kept := make([]bool, len(ls))
	for i, l := range ls {
		var hashes []kv.Hash
		if !l.write {
			hashes = l.hashes
		}
		err := o.tab.Reattach(r.holder, l.id, l.write, l.pages, hashes)
		kept[i] = err == nil
		if err != nil {
			o.s.trace("reattach of %d lost: %v", l.id, err)
		}
	}
	if !o.tab.Window() && len(ls) > 0 {
		o.s.st.lateReattach++
	}
	fx := o.tab.Declared(r.holder)
	o.check(nil)
	o.reply(fx, func() { r.reattached(inc, ls, kept) })
	o.retry()
}

func (o *sowner) dead(h pages.Holder) {
	o.do(o.tab.HolderDead(h))
	o.check(nil)
	o.retry()
}

// --- replicas ---

type leaseState int

const (
	lHeld leaseState = iota
	lSealSent
	lReleaseSent
	lLost
)

type rlease struct {
	id     pages.LeaseID
	write  bool
	pages  []uint32
	hashes []kv.Hash
	state  leaseState
	reads  int // piece reads still to do
	then   func()
}

type srep struct {
	s      *sim
	idx    int
	writer bool
	alive  bool
	inc    int // incarnation: events of an earlier one are dropped
	holder pages.Holder
	conn   uint64 // the owner epoch it is connected to, 0: none
	leases map[pages.LeaseID]*rlease
	// The stream: writes queued land in order, one after another.
	queued, landed int
	lastLand       int64
	waits          map[int][]func()
	busy           bool // a task runs
}

func (s *sim) newRep(idx int, writer bool) *srep {
	s.starts++
	r := &srep{s: s, idx: idx, writer: writer, alive: true, holder: pages.Holder{PID: uint32(1000 + idx), Start: s.starts},
		leases: map[pages.LeaseID]*rlease{}, waits: map[int][]func(){}}
	return r
}

// valid says an event of incarnation inc on connection epoch may act.
func (r *srep) valid(inc int) bool { return r.alive && r.inc == inc }

// send delivers fn to the owner the replica is connected to, after a while.
func (r *srep) send(fn func(o *sowner)) {
	s, o, epoch := r.s, r.s.owner, r.conn
	s.after(s.delay(1, 8), func() {
		if s.owner == o && o != nil && epoch == s.cfg.Epoch && r.conn == epoch {
			fn(o)
		}
	})
}

// queueWrite queues a write of page p's layer on the stream: it lands later, after
// every write queued before it.
func (r *srep) queueWrite(p uint32, layer int, v uint64) {
	s, inc := r.s, r.inc
	r.queued++
	r.lastLand = max(r.lastLand, s.now) + s.delay(1, 25)
	s.after(r.lastLand-s.now, func() {
		if !r.valid(inc) {
			return // a dead process's writes never land
		}
		s.gmem[p][layer] = v
		r.landed++
		if fns, ok := r.waits[r.landed]; ok { // writes land one by one: one position at a time
			delete(r.waits, r.landed)
			for _, f := range fns {
				f()
			}
		}
	})
}

// onStream runs fn once every write queued before pos has landed.
func (r *srep) onStream(pos int, fn func()) {
	if r.landed >= pos {
		r.s.after(0, fn)
		return
	}
	r.waits[pos] = append(r.waits[pos], fn)
}

// task starts the replica's next piece of work, after a pause.
func (r *srep) task() {
	s, inc := r.s, r.inc
	r.busy = true
	s.after(s.delay(1, 40), func() {
		if !r.valid(inc) || r.conn == 0 {
			r.busy = false
			return
		}
		c := s.r.IntN(simChains)
		n := 1 + s.r.IntN(simChainLen)
		hashes := slices.Clone(s.chains[c][:n])
		r.send(func(o *sowner) { o.match(r, inc, hashes) })
	})
}

func (r *srep) idle() {
	r.busy = false
	if r.conn != 0 && len(r.leases) == 0 {
		r.task()
	}
}

// matched reads every piece of the run over a while, checking each, then writes
// what follows (a writer) and releases.
func (r *srep) matched(inc int, hashes []kv.Hash, res pages.MatchResult) {
	if !r.valid(inc) {
		return
	}
	s := r.s
	s.st.matched += len(res.Pages)
	var rl *rlease
	if res.Lease != 0 {
		rl = &rlease{id: res.Lease, pages: res.Pages, hashes: hashes[:len(res.Pages)]}
		r.leases[rl.id] = rl
		r.readAll(rl)
	}
	rest := hashes[len(res.Pages):]
	if r.writer && len(rest) > 0 {
		n := min(len(rest), 4)
		r.send(func(o *sowner) { o.alloc(r, inc, n, slices.Clone(rest[:n])) })
		return
	}
	r.finish(rl)
}

// readAll schedules a read of every piece of rl's pages, each checked.
func (r *srep) readAll(l *rlease) {
	s, inc := r.s, r.inc
	l.reads = len(l.pages) * simLayers
	for i, p := range l.pages {
		for layer := range simLayers {
			s.after(s.delay(1, 60), func() {
				if !r.valid(inc) || l.state == lLost {
					return
				}
				s.st.pieces++
				if got, want := s.gmem[p][layer], piece(l.hashes[i], layer); got != want {
					s.st.wrong++
					if s.st.firstWrong == "" {
						s.stop = true // the run ends here: a replay's trace ends at the wrong byte
						s.st.firstWrong = fmt.Sprintf("t=%d: replica %d read page %d layer %d of lease %d: %#x, its writer wrote %#x", s.now, r.idx, p, layer, l.id, got, want)
					}
				}
				if l.reads--; l.reads == 0 && l.then != nil {
					f := l.then
					l.then = nil
					f()
				}
			})
		}
	}
}

// finish releases read lease l (nil: none) once its reads are done.
func (r *srep) finish(l *rlease) {
	if l == nil {
		r.idle()
		return
	}
	inc := r.inc
	rel := func() {
		if !r.valid(inc) || l.state == lLost {
			return
		}
		l.state = lReleaseSent
		r.sendRelease(inc, l)
	}
	if l.reads == 0 {
		rel()
	} else {
		l.then = rel
	}
}

func (r *srep) noSpace(inc int) {
	if !r.valid(inc) {
		return
	}
	for _, id := range slices.Sorted(mapsKeys(r.leases)) {
		if l := r.leases[id]; !l.write && l.state == lHeld {
			r.finish(l)
			return
		}
	}
	r.idle()
}

// leased writes the pages (queued on the stream) and seals, often before the
// writes have landed; now and then it aborts instead.
func (r *srep) leased(inc int, id pages.LeaseID, pgs []uint32, hashes []kv.Hash) {
	if !r.valid(inc) {
		return
	}
	s := r.s
	l := &rlease{id: id, write: true, pages: pgs, hashes: hashes}
	r.leases[id] = l
	for i, p := range pgs {
		for layer := range simLayers {
			r.queueWrite(p, layer, piece(hashes[i], layer))
		}
	}
	s.after(s.delay(0, 30), func() {
		if !r.valid(inc) || l.state != lHeld {
			return
		}
		if s.r.IntN(10) == 0 {
			l.state = lReleaseSent
			r.sendRelease(inc, l)
			return
		}
		r.sealNow(l)
	})
}

func (r *srep) sendRelease(inc int, l *rlease) {
	pos := r.queued
	r.send(func(o *sowner) { o.release(r, inc, l, pos) })
}

func (r *srep) sealNow(l *rlease) {
	inc, pos := r.inc, r.queued
	l.state = lSealSent
	r.send(func(o *sowner) { o.seal(r, inc, l, pos) })
}

func (r *srep) sealed(inc int, l *rlease, ok bool) {
	if !r.valid(inc) || r.leases[l.id] != l {
		return
	}
	delete(r.leases, l.id)
	r.afterWrite()
}

// afterWrite releases the read lease the write continued, if any.
func (r *srep) afterWrite() {
	for _, id := range slices.Sorted(mapsKeys(r.leases)) {
		if l := r.leases[id]; !l.write && l.state == lHeld {
			r.finish(l)
			return
		}
	}
	if len(r.leases) == 0 {
		r.idle()
	}
}

func (r *srep) released(inc int, l *rlease) {
	if !r.valid(inc) || r.leases[l.id] != l {
		return
	}
	delete(r.leases, l.id)
	if l.write {
		r.afterWrite()
		return
	}
	if len(r.leases) == 0 {
		r.idle()
	}
}

// gone: the owner died; the replica notices, and reconnects once one is up.
func (r *srep) gone() {
	r.conn = 0
}

// reconnectLater dials the new owner after a while, some replicas after the grace,
// and re-declares every lease it holds.
func (r *srep) reconnectLater() {
	s, inc := r.s, r.inc
	d := s.delay(1, 60)
	if s.r.IntN(6) == 0 {
		d = simGrace + s.delay(1, 200) // late
	}
	s.after(d, func() {
		if !r.valid(inc) || s.owner == nil || r.conn == s.cfg.Epoch {
			return
		}
		r.conn = s.cfg.Epoch
		ls := make([]*rlease, 0, len(r.leases))
		for _, id := range slices.Sorted(mapsKeys(r.leases)) {
			if l := r.leases[id]; l.state != lLost {
				ls = append(ls, l)
			}
		}
		r.send(func(o *sowner) { o.reattach(r, inc, ls) })
	})
}

// reattached goes on with what was kept: seals and releases sent again, reads go
// on; what was lost is dropped (a lost write lease's writes may still land).
func (r *srep) reattached(inc int, ls []*rlease, kept []bool) {
	if !r.valid(inc) {
		return
	}
	for i, l := range ls {
		if r.leases[l.id] != l {
			continue
		}
		if !kept[i] {
			if l.state == lHeld {
				r.s.st.lostHeld++ // neither sealed nor released: its holder still uses it
			}
			l.state = lLost
			r.s.st.lost++
			delete(r.leases, l.id)
			continue
		}
		switch {
		case l.write && (l.state == lSealSent || l.state == lHeld):
			r.sealNow(l)
		case l.write:
			r.sendRelease(inc, l)
		case l.state == lReleaseSent || l.reads == 0:
			r.finish(l)
		default:
			r.finish(l) // once its reads are done
		}
	}
	if len(r.leases) == 0 {
		r.idle()
	}
}

// kill kills replica r: its stream's writes stop, its connection ends; the owner
// learns of its exit a little later; a new process takes its place later still.
func (s *sim) killReplica(r *srep) {
	s.st.replicaKills++
	s.trace("replica %d (%v) killed", r.idx, r.holder)
	r.alive = false
	h := r.holder
	s.after(s.delay(1, 20), func() {
		if s.owner != nil {
			s.owner.dead(h)
		}
	})
	s.after(s.delay(20, 200), func() {
		nr := s.newRep(r.idx, r.writer)
		s.reps[r.idx] = nr
		if s.owner != nil {
			nr.conn = s.cfg.Epoch
			nr.task()
		}
	})
}

// killOwner kills the owner at this instant: copies in flight land in part or not,
// a flush in flight leaves part of the unflushed tail, answers not sent are lost.
func (s *sim) killOwner() {
	o := s.owner
	st := o.tab.Stats()
	s.st.restarts++
	if st.Sealing > 0 {
		s.st.killSealing++
	}
	if st.HostFilling > 0 {
		s.st.killSpilling++
	}
	if len(o.restoring) > 0 {
		s.st.killRestoring++
	}
	if _, ok := o.tab.Shrinking(); ok || s.release {
		s.st.killShrinking++
	}
	if s.durable < len(s.journal) {
		s.st.killJournal++
		s.durable += s.r.IntN(len(s.journal) - s.durable + 1)
	}
	for _, id := range slices.Sorted(mapsKeys(o.copies)) {
		if c := o.copies[id]; c.started {
			s.land(c.c, true)
		}
	}
	s.trace("owner killed: %d of %d records durable", s.durable, len(s.journal))
	s.owner = nil
	for _, r := range s.reps {
		r.gone()
	}
	s.after(s.delay(10, 100), s.startOwner)
}

func newSim(seed uint64, rules pages.Rules, trace func(string, ...any)) *sim {
	r := rand.New(rand.NewPCG(seed, seed*0x9e3779b97f4a7c15+1))
	s := &sim{r: r, rules: rules, trace: trace, journal: []pages.Record{{Kind: pages.RecEnd, Seq: 1}}, durable: 1}
	s.chunk = 2 + r.IntN(4)
	bound := 24 + r.IntN(24)
	s.cfg = pages.Config{Pages: max(s.chunk, bound/2/s.chunk*s.chunk), Bound: bound, HostPages: 8 + r.IntN(16), Epoch: 0}
	s.held = s.cfg.Pages
	s.gmem = make([][simLayers]uint64, bound)
	s.hmem = make([][simLayers]uint64, s.cfg.HostPages)
	for c := range simChains {
		for i := range simChainLen {
			s.chains[c][i] = chainHash(c, i)
		}
	}
	for i := range simWriters + simReaders {
		s.reps = append(s.reps, s.newRep(i, i < simWriters))
	}
	return s
}

// run simulates ticks of virtual time and returns what it counted, or the first
// invariant the table broke.
func (s *sim) run(ticks int64) (simStats, error) {
	s.startOwner()
	// Chaos: owner and replica kills at random times.
	var chaos func()
	chaos = func() {
		s.after(s.delay(100, 1500), func() {
			switch {
			case s.r.IntN(3) == 0 && s.owner != nil:
				s.killOwner()
			default:
				if r := s.reps[s.r.IntN(len(s.reps))]; r.alive {
					s.killReplica(r)
				}
			}
			chaos()
		})
	}
	chaos()
	for len(s.q) > 0 && s.err == nil && !s.stop {
		e := heap.Pop(&s.q).(*event)
		if e.at > ticks {
			break
		}
		s.now = e.at
		e.fn()
		for _, r := range s.reps {
			if r.alive && r.conn != 0 && !r.busy && len(r.leases) == 0 {
				r.task()
			}
		}
	}
	s.st.seeds, s.st.ticks = 1, int(s.now)
	return s.st, s.err
}

func parseRules(spec string) (pages.Rules, error) {
	var r pages.Rules
	for _, w := range strings.Split(spec, ",") {
		switch strings.TrimSpace(w) {
		case "":
		case "nostrand":
			r.NoStrand = true
		case "endatseal":
			r.EndAtSeal = true
		case "restoreinwindow":
			r.RestoreInWindow = true
		case "shrinktakes":
			r.ShrinkTakes = true
		default:
			return r, fmt.Errorf("unknown rule %q", w)
		}
	}
	return r, nil
}

// TestSim runs the simulation over a few seeds (-sim.seeds=N or
// CUDAPOOL_SIM_DURATION=10m for more; -sim.seed=N replays one, -sim.trace logs it):
// every piece every replica reads must be what its writer wrote, and the table must
// keep its invariants through every kill and restart.
func TestSim(t *testing.T) {
	rules, err := parseRules(*simRules)
	if err != nil {
		t.Fatal(err)
	}
	var until time.Time
	n := *simSeeds
	if simDuration != "" {
		d, err := time.ParseDuration(simDuration)
		if err != nil {
			t.Fatalf("CUDAPOOL_SIM_DURATION: %v", err)
		}
		until = time.Now().Add(d)
		if n == 0 {
			n = 1 << 62
		}
	}
	if n == 0 {
		n = 16 / slowdown
	}
	first := *simFirst
	if *simSeed != 0 {
		first, n = *simSeed, 1
	}
	var total simStats
	for i := range n {
		seed := first + uint64(i)
		trace := func(string, ...any) {}
		if *simVerbose {
			trace = func(f string, a ...any) { t.Logf(f, a...) }
		}
		s := newSim(seed, rules, trace)
		st, err := s.run(simTicks)
		total.add(st)
		if err != nil {
			t.Fatalf("seed %d: the table broke: %v\nreplay: go test ./kv/internal/pages -run 'TestSim$' -sim.seed=%d -sim.trace", seed, err, seed)
		}
		if st.lostHeld > 0 && rules == (pages.Rules{}) {
			t.Fatalf("seed %d: %d leases in use lost at a reattach\nreplay: go test ./kv/internal/pages -run 'TestSim$' -sim.seed=%d -sim.trace", seed, st.lostHeld, seed)
		}
		if st.wrong > 0 || st.givenHeld > 0 {
			t.Fatalf("seed %d: %d wrong bytes, %d leases held over pages given back; first: %s; %s\nreplay: go test ./kv/internal/pages -run 'TestSim$' -sim.seed=%d -sim.trace",
				seed, 8*st.wrong, st.givenHeld, st.firstWrong, st.firstGiven, seed)
		}
		if !until.IsZero() && time.Now().After(until) {
			break
		}
	}
	t.Logf("seeds %d..%d: %v", first, first+uint64(total.seeds)-1, total)
}

// TestSimReplays runs a seed twice, with and without a rule, and requires the same
// events, in the same order, with the same figures: a failing seed replays exactly.
func TestSimReplays(t *testing.T) {
	for _, r := range []pages.Rules{{}, {NoStrand: true}} {
		var runs [2]strings.Builder
		var stats [2]simStats
		for i := range runs {
			s := newSim(5, r, func(f string, a ...any) { fmt.Fprintf(&runs[i], f+"\n", a...) })
			stats[i], _ = s.run(simTicks / 4)
		}
		require.NotZero(t, runs[0].Len())
		require.Equal(t, runs[0].String(), runs[1].String(), "rules %+v", r)
		require.Equal(t, stats[0], stats[1])
	}
}
