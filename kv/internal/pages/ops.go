package pages

import (
	"fmt"
	"slices"

	"github.com/cudapool/cudapool/kv"
)

// copyJob is a copy in flight.
type copyJob struct {
	kind   CopyKind
	gpu    []uint32
	gens   []uint32 // a spill's: the generation of each GPU page when the copy began
	host   []uint32
	hashes []kv.Hash
	l      *lease // a restore's lease
	at     []int  // a restore's: where in l.pages each GPU page lies
	dead   bool   // a restore's holder died meanwhile
}

// --- pages changing state ---

// release makes GPU page p free, one generation on.
func (t *Table) release(p uint32) {
	t.leave(p)
	g := &t.g[p]
	if g.listed {
		t.gremove(p)
	}
	c := g.copy
	*g = blank(g.gen + 1)
	g.copy = c
	if int(p) < t.limit {
		t.free = append(t.free, p)
	}
	t.enter(p)
}

// setState moves GPU page p to state st, for lease id.
func (t *Table) setState(p uint32, st State, id LeaseID) {
	t.leave(p)
	t.g[p].state, t.g[p].lease = st, id
	t.enter(p)
}

// read adds d readers to sealed page p.
func (t *Table) read(p uint32, d int) {
	t.leave(p)
	t.g[p].readers = uint32(int(t.g[p].readers) + d)
	t.enter(p)
}

// settleRead adds d releases settling to sealed page p.
func (t *Table) settleRead(p uint32, d int) {
	t.leave(p)
	t.g[p].releasing = uint32(int(t.g[p].releasing) + d)
	t.enter(p)
}

// ref is page p's Ref in its current life.
func (t *Table) ref(p uint32) Ref { return Ref{p, t.g[p].gen} }

// alive says whether r names a sealed page in the life it was made in.
func (t *Table) alive(r Ref) bool {
	return r.Page < uint32(len(t.g)) && t.g[r.Page].gen == r.Gen && t.g[r.Page].state == Sealed
}

// evict takes listed GPU page p out of the index, journals it, and frees it. Its
// hash stays in the host tier where the page has a twin (the twin becomes the most
// recent host page, once filled if a spill fills it) or is given a host page and
// copied there (capture).
func (t *Table) evict(p uint32, capture *copyJob) {
	g := &t.g[p]
	h := g.hash
	delete(t.index, h)
	t.journal(Record{Kind: RecFree, Page: p})
	t.stats.Evictions++
	if tw := g.twin; tw != none {
		g.twin = none
		hp := &t.h[tw]
		t.hleave(tw)
		hp.gpu = none
		t.henter(tw)
		if hp.state == HostSealed {
			t.stats.Spilled++
		}
	} else if len(t.h) > 0 {
		if _, ok := t.hindex[h]; !ok {
			if hp, ok := t.takeHost(); ok {
				t.fill(hp, h, none, capture)
				capture.gpu, capture.gens = append(capture.gpu, p), append(capture.gens, g.gen)
			} else {
				t.stats.HostLost++
			}
		}
	}
	t.release(p)
}

// takeGPU takes n pages off the free stack, evicting the least recently used
// evictable pages first where the stack is short; the caller has checked that
// t.Evictable() >= n. It returns the copies a writer of the pages must wait for: the
// spill copies still reading them, the capture of evicted pages without a copy among
// them.
func (t *Table) takeGPU(n int) (pages []uint32, waits []CopyID) {
	capture := &copyJob{kind: Spill}
	for len(t.free) < n {
		t.evict(t.glru.tail, capture)
	}
	if len(capture.host) > 0 {
		t.startCopy(capture)
	}
	pages = make([]uint32, n)
	for i := range pages {
		p := t.free[len(t.free)-1]
		t.free = t.free[:len(t.free)-1]
		pages[i] = p
		if c := t.g[p].copy; c != 0 && !slices.Contains(waits, c) {
			waits = append(waits, c)
		}
	}
	return pages, waits
}

// takeHost takes a free host page, evicting the least recently used evictable one
// where none is free; ok is false if there is none.
func (t *Table) takeHost() (uint32, bool) {
	if len(t.hfree) == 0 {
		hp := t.hlru.tail
		if hp == none {
			return 0, false
		}
		t.hleave(hp)
		delete(t.hindex, t.h[hp].hash)
		t.journal(Record{Kind: RecHostFree, Page: hp})
		t.h[hp] = hpage{prev: t.h[hp].prev, next: t.h[hp].next, listed: t.h[hp].listed, gpu: none}
		t.henter(hp)
		t.hfree = append(t.hfree, hp)
		t.stats.HostEvictions++
	}
	hp := t.hfree[len(t.hfree)-1]
	t.hfree = t.hfree[:len(t.hfree)-1]
	return hp, true
}

// fill makes free host page hp filling with h, from GPU page gp (none: from a page
// evicted), as part of job.
func (t *Table) fill(hp uint32, h kv.Hash, gp uint32, job *copyJob) {
	t.hleave(hp)
	t.h[hp].state, t.h[hp].hash, t.h[hp].gpu = HostFilling, h, gp
	t.henter(hp)
	job.host, job.hashes = append(job.host, hp), append(job.hashes, h)
}

// hrelease makes host page hp free.
func (t *Table) hrelease(hp uint32) {
	t.hleave(hp)
	t.h[hp] = hpage{prev: t.h[hp].prev, next: t.h[hp].next, listed: t.h[hp].listed, gpu: none}
	t.henter(hp)
	t.hfree = append(t.hfree, hp)
}

// startCopy numbers job and asks for it in the effects, after every record so far.
func (t *Table) startCopy(job *copyJob) CopyID {
	t.nextCp++
	id := t.nextCp
	t.copies[id] = job
	if job.kind == Spill {
		for _, p := range job.gpu {
			t.g[p].copy = id
		}
	}
	for _, hp := range job.host {
		if t.h[hp].state == HostFilling {
			t.h[hp].copy = id
		}
	}
	t.fx.Copies = append(t.fx.Copies, Copy{ID: id, Kind: job.kind, GPU: slices.Clone(job.gpu), Host: slices.Clone(job.host), After: t.seq})
	return id
}

// publish makes sealing (or restored) page p visible under h with parent, or frees it
// if h is visible already; it returns the page that holds h.
func (t *Table) publish(p uint32, h kv.Hash, parent Ref) (uint32, bool) {
	if have, dup := t.index[h]; dup {
		t.stats.Duplicates++
		t.release(p)
		return have, false
	}
	t.leave(p)
	g := &t.g[p]
	g.state, g.hash, g.parent, g.lease = Sealed, h, parent, 0
	t.index[h] = p
	t.journal(Record{Kind: RecSeal, Page: p, Hash: h})
	t.stats.Seals++
	if hp, ok := t.hostHolds(h); ok && t.h[hp].gpu == none { // its bytes are on the host already
		t.hleave(hp)
		t.h[hp].gpu = p
		t.henter(hp)
		g.twin = hp
	}
	t.enter(p)
	return p, true
}

// hostHolds says which sealed host page holds h, without a lookup where there is no
// host tier.
func (t *Table) hostHolds(h kv.Hash) (uint32, bool) {
	if len(t.h) == 0 {
		return 0, false
	}
	hp, ok := t.hindex[h]
	return hp, ok
}

// maxAncestors bounds the walk of touchAncestors.
const maxAncestors = 1 << 16

// touchAncestors makes the listed ancestors of a chain, from parent up, the most
// recent pages, the root most recent of all.
func (t *Table) touchAncestors(parent Ref) {
	var chain []uint32
	for r := parent; t.alive(r) && len(chain) < maxAncestors; r = t.g[r.Page].parent {
		chain = append(chain, r.Page)
	}
	for _, p := range chain {
		t.gtouch(p)
	}
}

// --- operations ---

// Alloc grants h a write lease of n pages: free pages first, then the least recently
// used evictable ones, evicted. The reply waits for the effects (the evictions
// journaled, pages copied out to the host tier). On failure nothing changed: ErrWait
// in the reattach window, ErrSettling where pages that settle would do, else
// ErrNoSpace (the caller may map more and [Table.Grow] the table, up to its
// Bound); ErrInput for n above the Bound.
func (t *Table) Alloc(h Holder, n int) (LeaseID, []uint32, Effects, error) {
	switch {
	case n < 1 || n > t.cfg.Bound:
		return 0, nil, Effects{}, fmt.Errorf("%w: %d pages asked, the table has at most %d", ErrInput, n, t.cfg.Bound)
	case t.window:
		return 0, nil, Effects{}, fmt.Errorf("%w: an alloc of %d pages", ErrWait, n)
	case t.Evictable() < n && t.Reachable() >= n:
		return 0, nil, Effects{}, fmt.Errorf("%w: %d pages asked, %d free or evictable, %d once pages settle", ErrSettling, n, t.Evictable(), t.Reachable())
	case t.Evictable() < n:
		return 0, nil, Effects{}, fmt.Errorf("%w: %d pages asked, %d free or evictable, %d once pages settle", ErrNoSpace, n, t.Evictable(), t.Reachable())
	}
	pages, waits := t.takeGPU(n)
	l := t.newLease(h, true, pages, nil)
	for _, p := range pages {
		t.setState(p, Writing, l.id)
	}
	t.journal(leaseRecord(l))
	t.must()
	t.fx.Await = waits
	return l.id, slices.Clone(pages), t.effects(), nil
}

// Seal ends h's write lease id's writing: its first len(hashes) pages are to be
// visible under hashes, the first continuing the chain at parent (NoRef: none), the
// rest freed, once the writer's work has completed ([Table.SealDone]). Until then the
// pages are out of reach and the lease is h's. ErrStale for a lease that is not h's
// held write lease, ErrInput for more hashes than pages; nothing changed then.
func (t *Table) Seal(h Holder, id LeaseID, hashes []kv.Hash, parent Ref) (Effects, error) {
	l, err := t.find(h, id, held)
	if err == nil && !l.write {
		err = fmt.Errorf("%w: lease %d is a read lease", ErrStale, id)
	}
	if err == nil && len(hashes) > len(l.pages) {
		err = fmt.Errorf("%w: %d hashes for a lease of %d pages", ErrInput, len(hashes), len(l.pages))
	}
	if err != nil {
		return Effects{}, err
	}
	l.state, l.hashes, l.parent = sealing, slices.Clone(hashes), parent
	for i, p := range l.pages {
		st := Settling
		if i < len(hashes) {
			st = Sealing
		}
		t.setState(p, st, l.id)
	}
	if t.rules.endAtSeal {
		t.journal(Record{Kind: RecEnd, Lease: id})
	}
	return t.effects(), nil
}

// SealDone settles sealed lease id once its writer's work has completed (published)
// or its writer is dead (not published): the pages become visible (those whose hash
// is visible already are freed, duplicates), or are freed. It returns how many became
// visible and how many were duplicates. ErrStale, with nothing changed, for a lease
// that is not sealing.
func (t *Table) SealDone(id LeaseID, published bool) (visible, dups int, fx Effects, err error) {
	l, ok := t.leases[id]
	if !ok || l.state != sealing {
		return 0, 0, Effects{}, fmt.Errorf("%w: lease %d is not sealing", ErrStale, id)
	}
	t.settleSeal(l, published, &visible, &dups)
	return visible, dups, t.effects(), nil
}

func (t *Table) settleSeal(l *lease, published bool, visible, dups *int) {
	n := len(l.hashes)
	t.dropLease(l)
	if !t.rules.endAtSeal {
		// Before the seals: a journal that has a seal of the lease's page has its end,
		// and a restart never finds a write lease over a sealed page.
		t.journal(Record{Kind: RecEnd, Lease: l.id})
	}
	if published {
		got := make([]uint32, n)
		parent := l.parent
		if !t.alive(parent) {
			parent = NoRef
		}
		for i := range n {
			p, fresh := t.publish(l.pages[i], l.hashes[i], parent)
			got[i] = p
			parent = t.ref(p)
			if fresh {
				*visible++
			} else {
				*dups++
			}
		}
		for i := n - 1; i >= 0; i-- { // the first page most recent
			t.gtouch(got[i])
		}
		if n > 0 { // then its ancestors (a duplicate's own), more recent still
			t.touchAncestors(t.g[got[0]].parent)
		}
	} else {
		for _, p := range l.pages[:n] {
			t.release(p)
		}
	}
	for _, p := range l.pages[n:] {
		t.release(p)
	}
}

// Release ends h's lease id once the holder's work on it has completed
// ([Table.ReleaseDone]): a read lease's pages are neither evicted nor reused, a
// write lease's not reused, until then. ErrStale, with nothing changed, for a lease
// that is not h's, or not held (sealing, releasing, restoring, stranded).
func (t *Table) Release(h Holder, id LeaseID) error {
	l, err := t.find(h, id, held)
	if err != nil {
		return err
	}
	l.state = releasing
	for i := len(l.pages) - 1; i >= 0; i-- {
		p := l.pages[i]
		if l.write {
			t.setState(p, Settling, l.id)
			continue
		}
		t.leave(p)
		t.g[p].readers--
		t.g[p].releasing++
		t.enter(p)
	}
	return nil
}

// ReleaseDone ends released lease id: its holder's work on the pages has completed.
// ErrStale, with nothing changed, for a lease that is not releasing.
func (t *Table) ReleaseDone(id LeaseID) (Effects, error) {
	l, ok := t.leases[id]
	if !ok || l.state != releasing {
		return Effects{}, fmt.Errorf("%w: lease %d is not releasing", ErrStale, id)
	}
	t.settleRelease(l)
	return t.effects(), nil
}

func (t *Table) settleRelease(l *lease) {
	for i := len(l.pages) - 1; i >= 0; i-- { // the first page ends up the most recent
		if l.write {
			t.release(l.pages[i])
		} else {
			t.settleRead(l.pages[i], -1)
		}
	}
	t.dropLease(l)
	t.journal(Record{Kind: RecEnd, Lease: l.id})
}

// MatchResult is a Match's answer: lease Lease of Pages, the longest run of the hashes
// asked for, from the first, visible in the GPU tier or restored from the host tier.
// Pending says a restore copy is in flight: the answer comes from [Table.CopyDone].
// Lease 0 leases nothing.
type MatchResult struct {
	Lease   LeaseID
	Pages   []uint32
	Pending bool
}

// Match grants h a read lease of the longest run of hashes, from the first, that the
// GPU tier holds or the host tier does. Host-tier pages are restored into GPU pages
// taken as Alloc takes them (if the GPU tier has no room, the run ends before the
// first); the answer then waits for the copy, and the lease is granted at
// [Table.CopyDone]. The reply waits for the effects. A hash listed twice is leased
// twice (its page counts two readers, until the lease ends). ErrWait in the reattach
// window, with nothing changed.
func (t *Table) Match(h Holder, hashes []kv.Hash) (MatchResult, Effects, error) {
	if t.window && !t.rules.restoreInWindow {
		return MatchResult{}, Effects{}, fmt.Errorf("%w: a match of %d hashes", ErrWait, len(hashes))
	}
	run, hosts := t.matchRun(hashes)
	t.stats.Hits += uint64(len(run))
	t.stats.Misses += uint64(len(hashes) - len(run))
	pages := make([]uint32, len(run))
	for i, s := range run {
		pages[i] = s.gpu
	}
	if len(run) == 0 {
		return MatchResult{}, Effects{}, nil
	}
	l := t.newLease(h, false, pages, slices.Clone(hashes[:len(run)]))
	for i := len(run) - 1; i >= 0; i-- {
		if run[i].gpu != none {
			t.read(run[i].gpu, 1) // held, so that the pages taken below are not these
		}
	}
	if hosts == 0 {
		t.journal(leaseRecord(l))
		t.must()
		return MatchResult{Lease: l.id, Pages: slices.Clone(pages)}, t.effects(), nil
	}
	t.startRestore(l, run, hashes, hosts)
	return MatchResult{Lease: l.id, Pending: true}, t.effects(), nil
}

// matchStep is one hash of a match's run: the GPU page that holds it, or else the
// host page that does (the other is none).
type matchStep struct{ gpu, host uint32 }

// matchRun returns the longest run of hashes, from the first, that the GPU tier
// (below the limit) or the host tier holds, and how many of its steps are on the
// host. If the GPU tier has no room for the host steps, beyond the run's own listed
// pages that the lease takes out of reach, the run ends before its first host step.
// It changes nothing.
func (t *Table) matchRun(hashes []kv.Hash) (run []matchStep, hosts int) {
	run = make([]matchStep, 0, len(hashes))
	for _, hh := range hashes {
		if p, ok := t.index[hh]; ok {
			if int(p) >= t.limit {
				break // given back: matched no more
			}
			run = append(run, matchStep{p, none})
		} else if hp, ok := t.hostHolds(hh); ok {
			run = append(run, matchStep{none, hp})
			hosts++
		} else {
			break
		}
	}
	if hosts == 0 {
		return run, 0
	}
	listed := 0 // pages of the run that the lease takes out of reach
	for _, s := range run {
		if s.gpu != none && t.g[s.gpu].listed {
			listed++
		}
	}
	if t.Evictable()-listed >= hosts {
		return run, hosts
	}
	for i, s := range run { // no room: the run ends before its first host page
		if s.host != none {
			return run[:i], 0
		}
	}
	return run, 0 // not reached: hosts > 0
}

// startRestore pins the host pages of run (hosts of them, hashes its hashes), takes
// as many GPU pages, written under read lease l, and starts the restore copy: l is
// restoring until [Table.CopyDone], and the copy's effect waits for what the pages
// taken wait for. The GPU tier has room ([Table.matchRun] made sure).
func (t *Table) startRestore(l *lease, run []matchStep, hashes []kv.Hash, hosts int) {
	job := &copyJob{kind: Restore, l: l}
	for i, s := range run {
		if s.host != none {
			t.hleave(s.host)
			t.h[s.host].pins++
			t.henter(s.host)
			job.host, job.hashes = append(job.host, s.host), append(job.hashes, hashes[i])
		}
	}
	dsts, waits := t.takeGPU(hosts)
	k := 0
	for i, s := range run {
		if s.host != none {
			l.pages[i] = dsts[k]
			t.setState(dsts[k], Writing, l.id)
			job.at = append(job.at, i)
			k++
		}
	}
	job.gpu = dsts
	l.state = restoring
	l.copy = t.startCopy(job)
	c := &t.fx.Copies[len(t.fx.Copies)-1]
	c.Wait = waits
}

// CopyDone reports that copy id has completed (ok) or failed. A spill's host pages
// are journaled sealed (or freed); a restore's GPU pages become visible (or are
// freed, and its match ends before the first) and its lease is granted: res is the
// match's answer, to be sent once the effects are done (Lease 0: the match leases
// nothing, or its holder died). ErrInput, with nothing changed, for a copy not in
// flight.
func (t *Table) CopyDone(id CopyID, ok bool) (res MatchResult, fx Effects, err error) {
	job, found := t.copies[id]
	if !found {
		return MatchResult{}, Effects{}, fmt.Errorf("%w: copy %d is not in flight", ErrInput, id)
	}
	delete(t.copies, id)
	if job.kind == Spill {
		t.spillDone(id, job, ok)
		return MatchResult{}, t.effects(), nil
	}
	res = t.restoreDone(job, ok)
	return res, t.effects(), nil
}

func (t *Table) spillDone(id CopyID, job *copyJob, ok bool) {
	for _, gp := range job.gpu {
		if t.g[gp].copy == id {
			t.g[gp].copy = 0
		}
	}
	for i, hp := range job.host {
		gp := job.gpu[i]
		twin := gp != none && t.g[gp].gen == job.gens[i] && t.g[gp].state == Sealed && t.g[gp].twin == hp
		_, dup := t.hindex[job.hashes[i]]
		if !ok || dup {
			if twin {
				t.g[gp].twin = none
			}
			if !ok {
				t.stats.HostLost++
			}
			t.hrelease(hp)
			continue
		}
		t.hleave(hp)
		h := &t.h[hp]
		h.state, h.copy = HostSealed, 0
		if !twin {
			h.gpu = none
			t.stats.Spilled++
		}
		t.hindex[h.hash] = hp
		t.journal(Record{Kind: RecHostSeal, Page: hp, Hash: h.hash})
		t.henter(hp)
		t.stats.Spills++
	}
}

func (t *Table) restoreDone(job *copyJob, ok bool) MatchResult {
	l := job.l
	for _, hp := range job.host {
		t.hleave(hp)
		t.h[hp].pins--
		t.henter(hp)
	}
	cut := len(l.pages)
	if !ok {
		cut = job.at[0]
	}
	for k, i := range job.at {
		p := l.pages[i]
		if !ok {
			t.release(p)
			continue
		}
		parent := NoRef
		if i > 0 {
			parent = t.ref(l.pages[i-1])
		}
		got, fresh := t.publish(p, job.hashes[k], parent) // a fresh page twins its host page
		if fresh {
			t.stats.Restores++
		}
		l.pages[i] = got
		t.read(got, 1)
	}
	// Let go of what the lease does not keep, deepest first: a failed copy's run
	// past its cut, and the whole run of a holder that died meanwhile.
	keep := cut
	if job.dead {
		keep = 0
	}
	for i := len(l.pages) - 1; i >= keep; i-- {
		if !ok && i >= cut && slices.Contains(job.at, i) {
			continue // freed above
		}
		t.read(l.pages[i], -1)
	}
	if job.dead {
		return MatchResult{}
	}
	t.holders[l.holder].pages -= len(l.pages) - cut
	l.pages, l.hashes = l.pages[:cut], l.hashes[:cut]
	l.state = held
	if cut == 0 {
		t.dropLease(l)
		return MatchResult{}
	}
	t.journal(leaseRecord(l))
	t.must()
	return MatchResult{Lease: l.id, Pages: slices.Clone(l.pages)}
}

// PickSpill copies ahead into the host tier the least recently used evictable GPU
// pages that have no host copy, up to batch of them among the ahead least recent, so
// that evicting them later is free: it takes host pages (evicting the least recent
// evictable host pages where none is free) and asks for one copy. A page whose hash
// the host tier holds already is linked to it without a copy. ok is false if there is
// nothing to copy. It costs O(ahead).
func (t *Table) PickSpill(ahead, batch int) (c Copy, fx Effects, ok bool) {
	if len(t.h) == 0 {
		return Copy{}, Effects{}, false
	}
	job := &copyJob{kind: Spill}
	seen := 0
	for p := t.glru.tail; p != none && seen < ahead && len(job.gpu) < batch; p = t.g[p].prev {
		seen++
		g := &t.g[p]
		if g.twin != none {
			continue
		}
		if hp, held := t.hindex[g.hash]; held {
			if t.h[hp].gpu == none {
				t.hleave(hp)
				t.h[hp].gpu = p
				t.henter(hp)
				g.twin = hp
			}
			continue
		}
		hp, got := t.takeHost()
		if !got {
			break
		}
		t.fill(hp, g.hash, p, job)
		g.twin = hp
		job.gpu, job.gens = append(job.gpu, p), append(job.gens, g.gen)
	}
	if len(job.gpu) == 0 {
		return Copy{}, t.effects(), false
	}
	t.startCopy(job)
	c = t.fx.Copies[len(t.fx.Copies)-1]
	return c, t.effects(), true
}
