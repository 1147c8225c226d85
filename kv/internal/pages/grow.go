package pages

import (
	"fmt"
	"maps"
	"slices"
)

// Mapped is how many GPU pages t has: pages [0, Mapped) exist, their memory mapped
// by the caller. While a shrink is in progress it counts the pages being given back.
func (t *Table) Mapped() int { return len(t.g) }

// Shrinking says whether a shrink is in progress, and to how many pages.
func (t *Table) Shrinking() (to int, ok bool) { return t.limit, t.limit < len(t.g) }

// Grow makes pages [Mapped, to) free: the caller has mapped their memory before it
// calls. During a shrink, to counts from the shrink's target instead: the pages
// being given back below to are the table's again as they are (their leases and
// their bytes kept; those evicted already stay evicted), and the shrink now stops
// at to, or is over if to reaches Mapped. A page's generation goes on from its
// life before a shrink gave it back, so that no [Ref] of then names it now. Growth
// is not journaled: a restart is told how many pages are mapped then ([Restart]).
// ErrInput, with nothing changed, for to not above Mapped (or the shrink's
// target), or above the Bound.
func (t *Table) Grow(to int) error {
	if to <= t.limit || to > t.cfg.Bound {
		return fmt.Errorf("%w: grow to %d pages, the table has %d (%d once shrunk) of at most %d", ErrInput, to, len(t.g), t.limit, t.cfg.Bound)
	}
	from, back := len(t.g), min(to, len(t.g))
	for p := t.limit; p < back; p++ {
		t.leave(uint32(p))
	}
	old := t.limit
	t.limit = back
	var unheld []uint32 // sealed pages no one holds, waiting for Drain: listed again
	for p := back - 1; p >= old; p-- {
		if g := &t.g[p]; g.state == Sealed && g.readers == 0 && g.releasing == 0 {
			t.tally(uint32(p), 1)
			unheld = append(unheld, uint32(p))
			continue
		}
		t.enter(uint32(p))
		if t.g[p].state == Free {
			t.free = append(t.free, uint32(p))
		}
	}
	t.relist(unheld)
	if to > from {
		full := t.g[:cap(t.g)]
		if to > len(full) {
			full = append(full, make([]gpage, to-len(full))...)
		}
		t.g = full[:to]
		for p := to - 1; p >= from; p-- { // the lowest on top of the stack
			t.g[p] = blank(t.g[p].gen)
			t.free = append(t.free, uint32(p))
		}
		t.count[Free] += to - from
		t.limit = to
	}
	return nil
}

// relist puts unlisted sealed pages ps, counted already, back in the LRU list as
// the most recent pages, each more recent than its children among them, and then
// their ancestors more recent still, as a seal does: eviction takes a chain's
// leaves first.
func (t *Table) relist(ps []uint32) {
	in := make(map[uint32]bool, len(ps))
	for _, p := range ps {
		in[p] = true
	}
	depth := make(map[uint32]int, len(ps)) // how many of ps are above a page in its chain
	for _, p := range ps {
		for r := t.g[p].parent; t.alive(r) && in[r.Page] && depth[p] < len(ps); r = t.g[r.Page].parent {
			depth[p]++
		}
	}
	slices.SortStableFunc(ps, func(a, b uint32) int { return depth[b] - depth[a] }) // the deepest first: least recent
	for _, p := range ps {
		t.gpush(p)
	}
	for _, p := range ps {
		if r := t.g[p].parent; !t.alive(r) || !in[r.Page] {
			t.touchAncestors(r)
		}
	}
}

// Shrink starts giving back pages [to, Mapped) (or, during a shrink, [to, its
// target)), so that the caller can release their memory: from now on none of them
// is allocated, restored into or matched (a Match's run ends before one; a seal of
// a hash one of them holds is a duplicate). Each that is sealed and that no lease
// holds is evicted now, the least recent first, its bytes copied to the host tier
// where the host tier has a page to spare (evicting the least recent host pages,
// as an Alloc's eviction does) or lost. Each that a lease holds (read, write,
// sealing, settling, restoring, and stranded leases from before a restart) is left
// to its lease: once the lease ends, the page is free, or sealed and unheld until
// [Table.Drain] evicts it; a page a copy reads or fills is free once the copy
// completes. Allocs and restores meanwhile have the pages below to only: they
// answer ErrNoSpace (or ErrSettling) where those do not suffice, as a table of to
// pages would; the caller may grow back instead ([Table.Grow]). [Table.Shrunk]
// ends the shrink once the pages are all free. The effects are the evictions'
// records and copies. Shrink costs O(the pages given back + the GPU LRU list).
// ErrInput, with nothing changed, for to below 1 or not below Mapped (or the
// shrink's target).
func (t *Table) Shrink(to int) (Effects, error) {
	if to < 1 || to >= t.limit {
		return Effects{}, fmt.Errorf("%w: shrink to %d pages, the table has %d (%d once shrunk)", ErrInput, to, len(t.g), t.limit)
	}
	var lru []uint32 // the evictable pages given back, the least recent first
	for p := t.glru.tail; p != none; p = t.g[p].prev {
		if int(p) >= to {
			lru = append(lru, p)
		}
	}
	old := t.limit
	for p := to; p < old; p++ {
		t.leave(uint32(p))
	}
	t.limit = to
	for p := to; p < old; p++ {
		t.enter(uint32(p)) // out of the LRU list
	}
	t.free = slices.DeleteFunc(t.free, func(p uint32) bool { return int(p) >= to })
	if t.rules.shrinkTakes { // the defect: a lease's pages taken from under it
		for _, id := range slices.Sorted(maps.Keys(t.leases)) {
			if l := t.leases[id]; l.state != restoring && slices.ContainsFunc(l.pages, func(p uint32) bool { return int(p) >= to }) {
				t.endDead(l)
			}
		}
	}
	capture := &copyJob{kind: Spill}
	for _, p := range lru {
		t.evictGiven(p, capture)
	}
	t.drain(capture) // under the rule: the pages of the leases it ended
	return t.effects(), nil
}

// Drain evicts, as Shrink does, the pages given back that have become sealed and
// unheld since (their leases ended), and says how many pages given back are still
// in use: leased, read or filled by a copy (the copies it asks for included). The
// caller calls it during a shrink, after leases end and copies complete, performs
// its effects, and calls [Table.Shrunk] once none is in use. It costs O(the pages
// given back); it does nothing without a shrink in progress.
func (t *Table) Drain() (Effects, int) {
	t.drain(&copyJob{kind: Spill})
	return t.effects(), t.inUse()
}

// drain evicts the sealed and unheld pages given back into capture, then asks for
// capture if it copies any.
func (t *Table) drain(capture *copyJob) {
	for p := t.limit; p < len(t.g); p++ {
		t.evictGiven(uint32(p), capture)
	}
	if len(capture.host) > 0 {
		t.startCopy(capture)
	}
}

// evictGiven evicts page p, given back, if it is sealed and unheld.
func (t *Table) evictGiven(p uint32, capture *copyJob) {
	if g := &t.g[p]; g.state == Sealed && g.readers == 0 && g.releasing == 0 {
		t.evict(p, capture)
	}
}

// inUse is how many pages given back are not free, or are read by a copy.
func (t *Table) inUse() int {
	n := 0
	for p := t.limit; p < len(t.g); p++ {
		if t.g[p].state != Free || t.g[p].copy != 0 {
			n++
		}
	}
	return n
}

// Shrunk ends the shrink in progress once every page it gives back is free and no
// copy reads it: Mapped becomes the shrink's target, which it returns, with wait,
// the sequence number through which the journal must be durable before the
// caller releases the pages' memory or maps other memory in their place (so that
// no restart finds a seal of one of them). It costs O(the pages given back).
// ErrInUse, with the count of pages still in use, while a lease holds one, a copy
// reads one, or one waits for [Table.Drain]: ask again once leases end and copies
// complete; ErrInput with no shrink in progress. Nothing changes on failure.
func (t *Table) Shrunk() (to int, wait Seq, err error) {
	if t.limit == len(t.g) {
		return 0, 0, fmt.Errorf("%w: no shrink in progress", ErrInput)
	}
	if n := t.inUse(); n > 0 {
		return 0, 0, fmt.Errorf("%w: %d of the %d pages given back", ErrInUse, n, len(t.g)-t.limit)
	}
	for p := t.limit; p < len(t.g); p++ {
		t.leave(uint32(p))
	}
	t.g = t.g[:t.limit] // kept past len: their generations go on if they come back
	return t.limit, t.seq, nil
}
