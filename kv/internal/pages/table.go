// Package pages owns the page table of one device of a KV page pool, as a pure state
// machine in the manner of etcd's raft: no CUDA, no sockets, no files, no goroutines,
// no clocks. A [Table] keeps the device's GPU pages, its host-tier pages, one LRU order
// across both tiers, the hash index, the leases and the restart state. Each operation
// changes the table and returns [Effects]: records to journal, in order, each with a
// sequence number; the sequence number the reply must wait for; copies to make; and
// copies the reply must wait for. The caller performs them outside its lock and
// reports each completion with another operation ([Table.CopyDone], [Table.SealDone],
// [Table.ReleaseDone], [Table.HolderDead]).
//
// # The caller
//
// The owner holds one lock around each operation of a device's table and performs
// the Effects after it, outside the lock: it queues the records in the journal in
// Seq order (a record queued is one a restart sees once it is on disk), starts each
// copy once the journal is on disk through its After and the copies it names in Wait
// have completed, and answers the replica only once the journal is on disk through
// Wait and the copies in Await have completed. It reports a copy's end with CopyDone,
// a seal's or release's point reached (its notifier) with SealDone or ReleaseDone, a
// replica's exit with HolderDead, and, after a restart, each replica's re-declared
// leases with Reattach and Declared, and the grace's end with CloseWindow. An
// operation that answers ErrWait or ErrSettling is asked again once the window has
// closed or pages have settled. Caps (leases, pages per replica) are the caller's:
// Load says what a holder holds.
//
// # Pages
//
// A GPU page is free, writing (under a write lease, or the table's own restore
// copy), sealing (sealed by its writer, its work not yet completed), sealed (visible:
// in the hash index, read by any number of read leases) or settling (to be freed once
// its writer's work has completed). A host page is free, filling (a spill copy in
// flight into it) or sealed; a sealed host page is the twin of a sealed GPU page of
// the same hash, or the only copy of its hash; restores that read it pin it. Every
// page carries a generation, one more each time it is freed: a [Ref] names a page in
// one life, so a stale reference never names a reused page.
//
// # One LRU
//
// Eviction takes the least recently used page no one holds: the evictable sealed GPU
// pages (no reader, no release settling) form a list, head most recent, and the host
// pages that are the only copy of their hash and that no restore reads form a second
// one. The GPU list followed by the host list is one LRU order: an evicted GPU page
// with a host twin becomes the most recent host page. A page leaves its list while it
// is held and goes back to the head when the last holder lets go, the deepest page of
// a lease first, so that a parent stays more recent than its child and eviction takes
// a chain's leaves first (callers lease runs from a chain's root). Eviction,
// allocation and every count are O(1) or O(pages asked), a spill's pick O(the pages
// it looks ahead), a seal's touch of its ancestors O(the chain); nothing walks the
// slab but [Table.Snapshot] and [Table.Check].
//
// # Devices
//
// A table is one device's. A copy between devices is the owner's own work, as a
// holder of its own (its process): a read lease of the source pages on the source's
// table (Match), a write lease of as many pages on the destination's (Alloc), the
// copy, then Seal and SealDone on the destination and Release and ReleaseDone on the
// source. An owner that dies mid-copy leaves both leases stranded under a holder that
// is dead, which its successor ends ([Table.HolderDead]).
//
// # Capacity
//
// The GPU pages are those of the memory the caller has mapped: pages [0,
// [Table.Mapped]), from Config.Pages up to Config.Bound. [Table.Grow] adds pages,
// free, once the caller has mapped their memory; an Alloc that finds no room
// answers ErrNoSpace, upon which the caller may grow the table and ask again.
// Growth is not journaled: [Restart] is told how many pages are mapped, and drops
// what the journal says of pages past them.
//
// [Table.Shrink] starts giving back the last pages, so that the caller can
// release their memory: from then on none of them is allocated, restored into or
// matched; those sealed and unheld are evicted at once (copied to the host tier
// where it has room), the rest once their leases end (a lease is never taken,
// stranded ones included) and their copies complete: the caller polls
// [Table.Drain], which evicts those that have come free and says how many are
// still in use, and then [Table.Shrunk]; once it answers, Mapped is the smaller
// count, and the memory may go once the journal is durable through the sequence
// number it gives. Only Shrink and Drain evict a page given back, so no other
// operation asks for a copy it did not before. A restart mid-shrink forgets it:
// the caller maps what it still holds and shrinks again.
//
// # Journal and restart
//
// Records are journaled in the order an operation returns them. An eviction
// (RecFree) is in the journal before its page is handed out (the reply waits for its
// sequence number); a host page is journaled sealed (RecHostSeal) only once the copy
// into it has completed, and evicted (RecHostFree) before a copy refills it (the copy
// waits). Every lease is journaled when granted (RecLeased, before the reply) and
// when it ends (RecEnd): a write lease ends only once its writer's work has completed
// or the writer is dead, never at its seal, and its end goes before its pages' seals.
//
// [Restart] rebuilds a table from the journaled records exactly: the sealed pages,
// the host pages, and each lease granted and not ended, as a stranded lease of its
// holder (a process: pid and start time): a write lease's pages out of reach, a read
// lease's held. A stranded lease is its holder's again when that holder reattaches it
// with the same pages and hashes ([Table.Reattach]), however late; it ends when the
// holder is dead ([Table.HolderDead]) or declares that it has re-declared all it
// holds ([Table.Declared]): no page of a write lease from before the restart is
// reused while its writer may still write it. Until the reattach window closes
// ([Table.CloseWindow], or every holder expected back declared or died), Alloc and
// Match, and so every restore, answer [ErrWait].
package pages

import (
	"fmt"

	"github.com/cudapool/cudapool/kv"
)

// none marks no page: the end of a list, no twin.
const none = ^uint32(0)

// Holder names a process across pid reuse: its pid and its start time. The table
// compares holders and nothing else.
type Holder struct {
	PID   uint32
	Start uint64
}

func (h Holder) String() string { return fmt.Sprintf("pid %d (start %d)", h.PID, h.Start) }

// LeaseID names a lease; the table issues Epoch<<40 + Offset + k*Stride (Config), so
// that an id of an epoch before, or of another device's table, is never issued.
type LeaseID uint64

// Epoch is the epoch a lease id was issued in.
func (id LeaseID) Epoch() uint64 { return uint64(id) >> 40 }

// Ref names GPU page Page in one life: Gen is how many times it had been freed.
type Ref struct{ Page, Gen uint32 }

// NoRef is no page.
var NoRef = Ref{Page: none}

// Seq is a journal record's sequence number, from 1; 0 is no record.
type Seq uint64

// CopyID names a copy the table asked for.
type CopyID uint64

// State is where a GPU page is in its life.
type State uint8

// The states of a GPU page.
const (
	Free State = iota
	Writing
	Sealing
	Sealed
	Settling
	nStates
)

var stateNames = [...]string{"free", "writing", "sealing", "sealed", "settling"}

func (s State) String() string {
	if int(s) < len(stateNames) {
		return stateNames[s]
	}
	return fmt.Sprintf("state(%d)", uint8(s))
}

// HostState is where a host page is in its life.
type HostState uint8

// The states of a host page.
const (
	HostFree HostState = iota
	HostFilling
	HostSealed
	nHostStates
)

type gpage struct {
	hash               kv.Hash
	prev, next         uint32 // LRU neighbours while in the list: prev is more recent
	readers, releasing uint32
	state              State
	listed             bool
	parent             Ref    // the sealed page before this one in its chain, or NoRef
	gen                uint32 // how many times the page was freed
	twin               uint32 // the host page holding (or being filled with) its bytes, or none
	lease              LeaseID
	// copy is the spill copy reading the page, 0 if none: it outlives the page's
	// life, and whoever takes the page next waits for it.
	copy CopyID
}

type hpage struct {
	hash       kv.Hash
	prev, next uint32
	state      HostState
	listed     bool
	gpu        uint32 // the sealed GPU page it twins (or is filled from), or none
	pins       uint32 // restores reading it
	copy       CopyID // filling: the copy that fills it
}

// list is a doubly linked list of a table's pages by index, head most recent.
type list struct {
	head, tail uint32
	n          int
}

// Config is what a table is of.
type Config struct {
	// Pages are the GPU pages mapped at the start (at a restart: mapped now), at
	// least 1; Bound is the most the table grows to ([Table.Grow]), 0: Pages.
	Pages, Bound int
	HostPages    int    // host-tier pages; 0: no host tier
	Epoch        uint64 // the epoch of the lease ids this table issues, at least 1
	// Stride and Offset make the lease ids of an owner's tables (one per device)
	// apart: this table issues Epoch<<40 + Offset + k*Stride, k = 1, 2, ...; the zero
	// values are 1 and 0.
	Stride, Offset uint64
}

// Table is one device's page table. It is not safe for concurrent use: its caller
// holds one lock around each operation.
type Table struct {
	cfg    Config
	g      []gpage
	h      []hpage
	free   []uint32 // free GPU pages, a stack
	hfree  []uint32 // free host pages, a stack
	glru   list
	hlru   list
	index  map[kv.Hash]uint32 // sealed GPU pages
	hindex map[kv.Hash]uint32 // sealed host pages

	leases  map[LeaseID]*lease
	holders map[Holder]*holder
	next    LeaseID

	copies map[CopyID]*copyJob
	nextCp CopyID
	seq    Seq

	window   bool
	expected map[Holder]int // holders with stranded leases: their replicas yet to declare

	// limit is where the pages given back start: pages [limit, len(g)) are
	// drained for a shrink ([Table.Shrink]); limit == len(g) when none is.
	limit int

	count  [nStates]int
	hcount [nHostStates]int
	// Of the draining pages: how many are in each state, and of the sealed ones,
	// those no reader holds.
	dcount  [nStates]int
	dunread int
	// Of the sealed GPU pages: those a reader holds, those with a release settling,
	// those no reader holds (evictable now or once their releases settle).
	leased, releasing, unread int
	twins, pinned             int
	nstranded                 int
	stats                     Counters

	rules rules
	fx    Effects // what the operation in progress returns
}

// rules are the restart contract's rules, each on in every table; a test turns one
// off to show the defect it prevents (export_test.go).
type rules struct {
	noStrand        bool // a stranded lease's pages are free once the window closes
	restoreInWindow bool // a Match's restore does not wait for the window
	endAtSeal       bool // a write lease's End is journaled at its seal
	shrinkTakes     bool // a shrink ends the leases of the pages it gives back
}

// Counters count what the table did since it was made.
type Counters struct {
	Hits, Misses, Evictions, Seals, Duplicates         uint64
	Spills, Spilled, Restores, HostEvictions, HostLost uint64
}

// New makes the table of a first start: every page free, no window.
func New(cfg Config) (*Table, error) {
	cfg.Stride = max(cfg.Stride, 1)
	if cfg.Bound == 0 {
		cfg.Bound = cfg.Pages
	}
	if cfg.Pages < 1 || cfg.Bound < cfg.Pages || cfg.Bound >= int(none-1) || cfg.HostPages < 0 || cfg.HostPages >= int(none-1) || cfg.Epoch < 1 || cfg.Epoch >= 1<<23 ||
		cfg.Stride > 1<<20 || cfg.Offset >= cfg.Stride {
		return nil, fmt.Errorf("%w: %d GPU pages of at most %d, %d host pages, epoch %d, lease ids %d apart from %d", ErrInput, cfg.Pages, cfg.Bound, cfg.HostPages, cfg.Epoch, cfg.Stride, cfg.Offset)
	}
	t := &Table{cfg: cfg, g: make([]gpage, cfg.Pages), h: make([]hpage, cfg.HostPages),
		index: make(map[kv.Hash]uint32), hindex: make(map[kv.Hash]uint32),
		leases: make(map[LeaseID]*lease), holders: make(map[Holder]*holder),
		copies: make(map[CopyID]*copyJob), expected: make(map[Holder]int),
		glru: list{head: none, tail: none}, hlru: list{head: none, tail: none},
		next: LeaseID(cfg.Epoch<<40 + cfg.Offset)}
	t.free = make([]uint32, cfg.Pages)
	for i := range t.g {
		t.g[i] = blank(0)
		t.free[i] = uint32(cfg.Pages - 1 - i) // page 0 on top
	}
	t.hfree = make([]uint32, cfg.HostPages)
	for i := range t.h {
		t.h[i] = hpage{prev: none, next: none, gpu: none}
		t.hfree[i] = uint32(cfg.HostPages - 1 - i)
	}
	t.count[Free] = cfg.Pages
	t.limit = cfg.Pages
	t.hcount[HostFree] = cfg.HostPages
	return t, nil
}

// Config is what t is of: Pages as it was made (see [Table.Mapped]), Bound set.
func (t *Table) Config() Config { return t.cfg }

// blank is a free GPU page in its life gen.
func blank(gen uint32) gpage {
	return gpage{prev: none, next: none, parent: NoRef, twin: none, gen: gen}
}

// --- counting: every change of a page goes between leave and enter ---

// leave takes GPU page p out of the counts, before a change.
func (t *Table) leave(p uint32) { t.tally(p, -1) }

// enter puts GPU page p back into the counts after a change, and into the LRU list
// (at its head) or out of it as its state now says.
func (t *Table) enter(p uint32) {
	t.tally(p, 1)
	g := &t.g[p]
	want := g.state == Sealed && g.readers == 0 && g.releasing == 0 && int(p) < t.limit // not given back
	switch {
	case want && !g.listed:
		t.gpush(p)
	case !want && g.listed:
		t.gremove(p)
	}
}

func (t *Table) tally(p uint32, d int) {
	g := &t.g[p]
	t.count[g.state] += d
	drain := int(p) >= t.limit
	if drain {
		t.dcount[g.state] += d
	}
	if g.state == Sealed {
		if g.readers > 0 {
			t.leased += d
		} else {
			t.unread += d
			if drain {
				t.dunread += d
			}
		}
		if g.releasing > 0 {
			t.releasing += d
		}
	}
}

// hleave and henter are leave and enter for host page p: the host list holds the
// sealed host pages that twin no GPU page and that no restore reads.
func (t *Table) hleave(p uint32) { t.htally(p, -1) }

func (t *Table) henter(p uint32) {
	t.htally(p, 1)
	h := &t.h[p]
	want := h.state == HostSealed && h.gpu == none && h.pins == 0
	switch {
	case want && !h.listed:
		t.hpush(p)
	case !want && h.listed:
		t.hremove(p)
	}
}

func (t *Table) htally(p uint32, d int) {
	h := &t.h[p]
	t.hcount[h.state] += d
	if h.state == HostSealed && h.gpu != none {
		t.twins += d
	}
	if h.pins > 0 {
		t.pinned += d
	}
}

// --- the two LRU lists ---

// push makes p, in no list, the head of l; links are an entry's neighbours.
func (l *list) push(p uint32, links func(uint32) (prev, next *uint32)) {
	prev, next := links(p)
	*prev, *next = none, l.head
	if l.head != none {
		hp, _ := links(l.head)
		*hp = p
	} else {
		l.tail = p
	}
	l.head = p
	l.n++
}

// remove takes p out of l.
func (l *list) remove(p uint32, links func(uint32) (prev, next *uint32)) {
	prev, next := links(p)
	if *prev != none {
		_, n := links(*prev)
		*n = *next
	} else {
		l.head = *next
	}
	if *next != none {
		pp, _ := links(*next)
		*pp = *prev
	} else {
		l.tail = *prev
	}
	*prev, *next = none, none
	l.n--
}

func (t *Table) glinks(p uint32) (prev, next *uint32) { return &t.g[p].prev, &t.g[p].next }
func (t *Table) hlinks(p uint32) (prev, next *uint32) { return &t.h[p].prev, &t.h[p].next }

func (t *Table) gpush(p uint32)   { t.glru.push(p, t.glinks); t.g[p].listed = true }
func (t *Table) gremove(p uint32) { t.glru.remove(p, t.glinks); t.g[p].listed = false }
func (t *Table) hpush(p uint32)   { t.hlru.push(p, t.hlinks); t.h[p].listed = true }
func (t *Table) hremove(p uint32) { t.hlru.remove(p, t.hlinks); t.h[p].listed = false }

// gtouch makes listed page p the most recent.
func (t *Table) gtouch(p uint32) {
	if t.g[p].listed && t.glru.head != p {
		t.gremove(p)
		t.gpush(p)
	}
}

// --- stats ---

// Stats is a snapshot of a table's counts, each O(1).
type Stats struct {
	Pages, Bound                                 int // mapped now, and the most
	Free, Writing, Sealing, Sealed, Settling     int
	Leased, Releasing, Evictable                 int
	HostPages, HostFree, HostFilling, HostSealed int
	Twins, Pinned, HostEvictable                 int
	Leases, Stranded                             int
	Window                                       bool
	Counters
}

// Stats counts t's pages by state, in O(1).
func (t *Table) Stats() Stats {
	st := Stats{Pages: len(t.g), Bound: t.cfg.Bound, Free: t.count[Free], Writing: t.count[Writing], Sealing: t.count[Sealing],
		Sealed: t.count[Sealed], Settling: t.count[Settling], Leased: t.leased, Releasing: t.releasing,
		Evictable: t.glru.n, HostPages: len(t.h), HostFree: t.hcount[HostFree], HostFilling: t.hcount[HostFilling],
		HostSealed: t.hcount[HostSealed], Twins: t.twins, Pinned: t.pinned, HostEvictable: t.hlru.n,
		Leases: len(t.leases), Stranded: t.nstranded, Window: t.window, Counters: t.stats}
	return st
}

// Reachable is how many pages an Alloc could get without any lease ending: free,
// evictable, and those that settle, none of those a shrink gives back. O(1).
func (t *Table) Reachable() int {
	return t.count[Free] + t.count[Settling] + t.unread - t.dcount[Free] - t.dcount[Settling] - t.dunread
}

// Evictable is how many pages an Alloc could get now: free and evictable, none of
// those a shrink gives back. O(1).
func (t *Table) Evictable() int { return len(t.free) + t.glru.n }

// Window says whether the reattach window is open.
func (t *Table) Window() bool { return t.window }

// Page is GPU page p's state and hash (meaningful once sealing), and its
// generation; a page not mapped ([Table.Mapped]) is free, of no hash.
func (t *Table) Page(p uint32) (State, kv.Hash, uint32) {
	if int(p) >= len(t.g) {
		return Free, kv.Hash{}, 0
	}
	g := &t.g[p]
	return g.state, g.hash, g.gen
}

// Lookup says which sealed GPU page holds h.
func (t *Table) Lookup(h kv.Hash) (uint32, bool) {
	p, ok := t.index[h]
	return p, ok
}

// HostLookup says which sealed host page holds h.
func (t *Table) HostLookup(h kv.Hash) (uint32, bool) {
	p, ok := t.hindex[h]
	return p, ok
}

// Ref is GPU page p's Ref in its current life: a seal's parent; NoRef for a page
// not mapped.
func (t *Table) Ref(p uint32) Ref {
	if int(p) >= len(t.g) {
		return NoRef
	}
	return t.ref(p)
}

// Fill sets st's page counts and counters from t, in O(1), and its host tier's where
// st.Host is set; the rest (bytes, times, the copy path, Hits by other means) is the
// caller's.
func (t *Table) Fill(st *kv.DeviceStats) {
	st.Pages, st.Free, st.Writing, st.Sealing = len(t.g), t.count[Free], t.count[Writing], t.count[Sealing]
	st.Sealed, st.Settling, st.Leased, st.Releasing = t.count[Sealed], t.count[Settling], t.leased, t.releasing
	st.Hits, st.Misses, st.Evictions, st.Seals, st.Duplicates = t.stats.Hits, t.stats.Misses, t.stats.Evictions, t.stats.Seals, t.stats.Duplicates
	if h := st.Host; h != nil {
		h.Pages, h.Free, h.Filling, h.Sealed, h.Twins = len(t.h), t.hcount[HostFree], t.hcount[HostFilling], t.hcount[HostSealed], t.twins
		h.Spills, h.Restores, h.Spilled, h.Lost, h.Evictions = t.stats.Spills, t.stats.Restores, t.stats.Spilled, t.stats.HostLost, t.stats.HostEvictions
	}
}
