package owner

import (
	"sync"

	"github.com/cudapool/cudapool/cudart"
	"github.com/cudapool/cudapool/export/consumer"
	"github.com/cudapool/cudapool/kv"
	"github.com/cudapool/cudapool/kv/internal/index"
	"github.com/cudapool/cudapool/pool"
)

// pageState is where a page is in its life: free → writing → sealing → sealed →
// (evicted) free; an aborted write goes writing → settling → free.
type pageState uint8

const (
	pageFree     pageState = iota
	pageWriting            // under a write lease (the owner's own, for a copy)
	pageSealing            // sealed by its writer, waiting for the writer's event
	pageSealed             // visible: in the hash index and the LRU list
	pageSettling           // to be freed once a release event has completed
)

// none marks the end of the LRU list.
const none = ^uint32(0)

// page is one entry of a slab's page table.
type page struct {
	hash       kv.Hash
	prev, next uint32 // LRU neighbours, for a sealed page: prev is more recent
	readers    uint32 // read leases holding it
	releasing  uint32 // release records naming it that have not settled
	state      pageState
	// parent is the sealed page before this one in its chain, where the owner knows it
	// (none otherwise), as it was at generation parentGen.
	parent    uint32
	parentGen uint32
	gen       uint32 // how many times the page was freed: a link to it names one life
}

// link names page p in its current life, for a child's parent link.
type link struct{ page, gen uint32 }

// noLink is no known parent.
var noLink = link{page: none}

// slab is one device's allocations (segments) and its page table. Everything but the fields set
// at Listen is guarded by the Owner's mu.
type slab struct {
	dev    int
	name   string // the slab's name (kvwire.SlabName); its segments' are SlabName(dev, i)
	pool   *pool.Pool
	bufs   []*pool.Buffer      // the segments, in order, where this process made them
	ms     []*consumer.Mapping // the segments, where they were adopted from a keeper (WithKeeper)
	bases  []cudart.DevicePtr  // their addresses
	ix     *index.Index        // the index file; nil: none
	stream cudart.Stream       // the owner's stream on dev: set-up and copies out of this slab
	copyMu sync.Mutex          // one copy at a time queued on stream
	done   cudart.Event        // recorded on stream after a copy (or at Close), asked until it completes

	pages      []page
	free       []uint32 // a stack of free pages
	index      map[kv.Hash]uint32
	head, tail uint32 // LRU list of sealed pages: head most recent
	stats      kv.DeviceStats
	tier       *hostTier // the device's host tier (hosttier.go), nil without one
	// lastFree is the sequence number of the latest eviction queued in the index: a
	// page it evicted is written only once the index has it (Owner.journaled).
	lastFree uint64
	// space is closed (and replaced) whenever pages may have become free or
	// evictable: the Allocs that wait for settling pages look again.
	space chan struct{}
}

// spaceLocked wakes the Allocs that wait for pages to settle.
func (s *slab) spaceLocked() {
	close(s.space)
	s.space = make(chan struct{})
}

// settlingLocked counts the pages that will be free or evictable once release events
// complete: aborted writes that settle, and sealed pages no reader holds whose
// releases are settling.
func (s *slab) settlingLocked() int {
	n := 0
	for i := range s.pages {
		pg := &s.pages[i]
		if pg.state == pageSettling || (pg.state == pageSealed && pg.readers == 0 && pg.releasing > 0) {
			n++
		}
	}
	return n
}

// reachableLocked counts the pages an Alloc could get without any lease ending: free,
// evictable, and settling.
func (s *slab) reachableLocked() int {
	n := len(s.free)
	for i := range s.pages {
		pg := &s.pages[i]
		if pg.state == pageSettling || (pg.state == pageSealed && pg.readers == 0) {
			n++
		}
	}
	return n
}

func newSlab(dev, pages int) *slab {
	s := &slab{dev: dev, pages: make([]page, pages), free: make([]uint32, pages), index: make(map[kv.Hash]uint32, pages), head: none, tail: none, space: make(chan struct{})}
	for i := range s.free {
		s.free[i] = uint32(pages - 1 - i) // page 0 on top
		s.pages[i].parent = none
	}
	return s
}

// unlink takes sealed page p out of the LRU list.
func (s *slab) unlink(p uint32) {
	if s.tier != nil {
		s.tier.unlinked(p)
	}
	lruRemove(&s.head, &s.tail, p, s.links)
}

// pushFront makes p the most recent page of the LRU list; p must not be in it.
func (s *slab) pushFront(p uint32) { lruPushFront(&s.head, &s.tail, p, s.links) }

// links are page p's LRU neighbours.
func (s *slab) links(p uint32) (prev, next *uint32) { return &s.pages[p].prev, &s.pages[p].next }

// touch makes sealed pages ps the most recent, ps[0] first of all: callers pass a run
// in prefix order, so that a parent is always more recent than its children and
// eviction takes leaves first.
func (s *slab) touch(ps []uint32) {
	for i := len(ps) - 1; i >= 0; i-- {
		if s.head == ps[i] {
			continue
		}
		s.unlink(ps[i])
		s.pushFront(ps[i])
	}
}

// evictable says whether sealed page p may be evicted: no reader holds it and no
// reader's release of it is still settling.
func (s *slab) evictable(p uint32) bool {
	pg := &s.pages[p]
	return pg.readers == 0 && pg.releasing == 0
}

// take leases n pages for writing: free pages first, then the least recent evictable
// sealed pages, evicted. It takes all n or, with ok false, none. Evicted pages are
// free in the index once s.lastFree is written: the caller waits for it
// (Owner.journaled) before the pages are written.
func (s *slab) take(n int, dst []uint32) ([]uint32, bool) {
	short := n - len(s.free)
	var victims []uint32
	if short > 0 {
		victims = make([]uint32, 0, short)
		for p := s.tail; p != none && len(victims) < short; p = s.pages[p].prev {
			if s.evictable(p) {
				victims = append(victims, p)
			}
		}
		if len(victims) < short {
			return dst, false
		}
		for _, p := range victims {
			s.evict(p)
		}
	}
	for range n {
		p := s.free[len(s.free)-1]
		s.free = s.free[:len(s.free)-1]
		s.pages[p].state = pageWriting
		dst = append(dst, p)
	}
	return dst, true
}

// evict takes sealed page p out of the index and the LRU list, to free.
func (s *slab) evict(p uint32) {
	pg := &s.pages[p]
	if s.tier != nil {
		s.tier.evicted(p, pg.hash)
	}
	delete(s.index, pg.hash)
	s.unlink(p)
	s.lastFree = s.ix.Free(s.dev, p)
	s.stats.Evictions++
	s.release(p)
}

// release makes p free.
func (s *slab) release(p uint32) {
	s.pages[p] = page{prev: none, next: none, parent: none, gen: s.pages[p].gen + 1}
	s.free = append(s.free, p)
}

// linkOf is page p's link in its current life.
func (s *slab) linkOf(p uint32) link { return link{p, s.pages[p].gen} }

// alive says whether l still names a sealed page in the life it was made in.
func (s *slab) alive(l link) bool {
	return l.page != none && s.pages[l.page].gen == l.gen && s.pages[l.page].state == pageSealed
}

// maxAncestors bounds the walk of touchAncestors: the longest chain whose parents a
// seal keeps more recent than it.
const maxAncestors = 1 << 16

// touchAncestors makes the known ancestors of a chain, from its page at parent up,
// more recent than everything else, the root most recent: after a seal of pages that
// continue a matched prefix, so that eviction still takes the chain's leaves first.
func (s *slab) touchAncestors(parent link, scratch []uint32) []uint32 {
	chain := scratch[:0]
	for l := parent; s.alive(l) && len(chain) < maxAncestors; {
		chain = append(chain, l.page)
		pg := &s.pages[l.page]
		l = link{pg.parent, pg.parentGen}
	}
	for _, p := range chain { // deepest first: the root ends up at the head
		if s.head != p {
			s.unlink(p)
			s.pushFront(p)
		}
	}
	return chain
}

// publish makes sealing page p visible under its hash, or frees it if the hash is
// visible already (a duplicate); it reports which.
func (s *slab) publish(p uint32, h kv.Hash, parent link) (visible bool) {
	if _, dup := s.index[h]; dup {
		s.stats.Duplicates++
		s.release(p)
		return false
	}
	pg := &s.pages[p]
	pg.state, pg.hash = pageSealed, h
	pg.parent, pg.parentGen = parent.page, parent.gen
	s.index[h] = p
	s.pushFront(p)
	s.stats.Seals++
	s.ix.Seal(s.dev, p, h)
	if s.tier != nil {
		s.tier.wake()
	}
	return true
}

// lookup is the longest run of hashes, from the first, visible in s, appended to dst.
func (s *slab) lookup(hashes []kv.Hash, dst []uint32) []uint32 {
	for _, h := range hashes {
		p, ok := s.index[h]
		if !ok {
			break
		}
		dst = append(dst, p)
	}
	return dst
}

// snapshot counts s's pages by state.
func (s *slab) snapshot() kv.DeviceStats {
	st := s.stats
	st.Device, st.Pages = s.dev, len(s.pages)
	for i := range s.pages {
		pg := &s.pages[i]
		switch pg.state {
		case pageFree:
			st.Free++
		case pageWriting:
			st.Writing++
		case pageSealing:
			st.Sealing++
		case pageSealed:
			st.Sealed++
			if pg.readers > 0 {
				st.Leased++
			}
			if pg.releasing > 0 {
				st.Releasing++
			}
		case pageSettling:
			st.Settling++
		}
	}
	return st
}
