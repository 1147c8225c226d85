package pages_test

import (
	"encoding/binary"
	"errors"
	"flag"
	"fmt"
	"math/rand/v2"
	"slices"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/cudapool/cudapool/kv"
	"github.com/cudapool/cudapool/kv/internal/pages"
)

var (
	modelSeeds = flag.Int("model.seeds", 0, "TestModel: how many seeds to run (0: 300, fewer under the race detector)")
	modelSeed  = flag.Uint64("model.seed", 0, "TestModel: run this seed alone (replay a failure)")
	modelSteps = flag.Int("model.steps", 600, "TestModel: operations per seed")
	modelTrace = flag.Bool("model.trace", false, "TestModel: log every operation")
)

// chainHash is the hash of position i of chain c: a chain's pages are its prefix.
func chainHash(c, i int) kv.Hash {
	var h kv.Hash
	binary.LittleEndian.PutUint32(h[0:], uint32(c)+1)
	binary.LittleEndian.PutUint32(h[4:], uint32(i)+1)
	return h
}

// garbage is what a page holds that no finished writer wrote: a mark of lease id.
func garbage(id pages.LeaseID) kv.Hash {
	var h kv.Hash
	h[15] = 0xff
	binary.LittleEndian.PutUint64(h[8:], uint64(id))
	return h
}

// mlease is a lease as its holder knows it.
type mlease struct {
	id        pages.LeaseID
	slot      int
	write     bool
	pages     []uint32
	hashes    []kv.Hash // a read lease's; a sealing write lease's
	chain     int       // a write lease's: the chain it continues
	from      int       // and the position of its first page
	parent    pages.Ref
	delivered bool // its answer came: the holder uses it
	sealing   bool
	releasing bool
	lost      bool      // refused at a reattach: its writes may still land
	stranded  bool      // held across a restart, not re-declared yet
	asked     []kv.Hash // a match's hashes, while its restore runs
}

// reply is an answer the caller holds until its effects are done.
type reply struct {
	l     *mlease
	wait  pages.Seq
	await []pages.CopyID
}

// model is the reference: what every holder knows, the journal as written, and the
// memory of every page (which hash's bytes it holds), moved only by the writers'
// finished work and by copies.
type model struct {
	t           *testing.T
	r           *rand.Rand
	cfg         pages.Config
	rules       pages.Rules
	tab         *pages.Table
	holders     []pages.Holder
	starts      uint64
	leases      map[pages.LeaseID]*mlease
	replies     []reply
	inflight    map[pages.CopyID]pages.Copy
	done        map[pages.CopyID]bool
	records     []pages.Record
	durable     int
	gmem        []kv.Hash
	hmem        []kv.Hash
	mayWrite    map[uint32]*mlease // pages a live writer's work may still land on
	redeclare   map[int][]*mlease  // after a restart: what each slot re-declares
	chains      int
	restarts    int
	step        int
	lastSeq     pages.Seq // the latest record's number
	compactions int
	// held is how many pages' memory is held: Mapped, or more while the memory of
	// a shrink's pages waits for the journal (release) before it is given back.
	held    int
	pending bool      // memory waits to be released
	freeAt  pages.Seq // once the journal is durable through this
	shrinks int
}

// junk is what memory just mapped, or given back, holds.
var junk = kv.Hash{0xde, 0xad}

func newModel(t *testing.T, seed uint64, rules pages.Rules) *model {
	r := rand.New(rand.NewPCG(seed, seed^0x9e3779b97f4a7c15))
	cfg := pages.Config{Pages: 6 + r.IntN(20), HostPages: r.IntN(12), Epoch: 1}
	cfg.Bound = cfg.Pages + r.IntN(12)
	tab, err := pages.NewWith(cfg, rules)
	require.NoError(t, err)
	m := &model{t: t, r: r, cfg: cfg, rules: rules, tab: tab, leases: map[pages.LeaseID]*mlease{},
		inflight: map[pages.CopyID]pages.Copy{}, done: map[pages.CopyID]bool{},
		gmem: make([]kv.Hash, cfg.Bound), hmem: make([]kv.Hash, cfg.HostPages),
		mayWrite: map[uint32]*mlease{}, redeclare: map[int][]*mlease{}, chains: 2 + r.IntN(4), held: cfg.Pages}
	for range 3 {
		m.starts++
		m.holders = append(m.holders, pages.Holder{PID: uint32(100 + len(m.holders)), Start: m.starts})
	}
	return m
}

func (m *model) logf(f string, a ...any) {
	if *modelTrace {
		m.t.Logf("%d: "+f, append([]any{m.step}, a...)...)
	}
}

// failure is what fail panics with; run recovers it.
type failure struct{ err error }

func (m *model) fail(f string, a ...any) {
	panic(failure{fmt.Errorf("step %d: "+f, append([]any{m.step}, a...)...)})
}

// apply does an operation's effects: the records go to the journal, the copies in
// flight, the answer (if any) waits.
func (m *model) apply(fx pages.Effects, l *mlease) {
	m.logf("effects %+v", fx)
	for _, r := range fx.Records {
		if r.Seq != m.lastSeq+1 {
			m.fail("record %v numbered %d after %d", r.Kind, r.Seq, m.lastSeq)
		}
		m.lastSeq = r.Seq
		m.records = append(m.records, r)
		if r.Kind == pages.RecFree || r.Kind == pages.RecHostFree {
			m.checkNotHeld(r)
		}
	}
	for _, c := range fx.Copies {
		m.inflight[c.ID] = c
		if c.Kind == pages.Restore {
			for _, p := range c.GPU {
				m.checkKept(p, "restored into")
				m.checkFresh(p, "restored into", nil)
			}
		}
	}
	if l != nil {
		m.replies = append(m.replies, reply{l: l, wait: fx.Wait, await: fx.Await})
	}
}

// checkNotHeld fails if an eviction names a page a lease holds.
func (m *model) checkNotHeld(r pages.Record) {
	if r.Kind != pages.RecFree {
		return
	}
	for _, l := range m.leases {
		if !l.write && !l.lost && slices.Contains(l.pages, r.Page) {
			m.fail("page %d evicted under read lease %d", r.Page, l.id)
		}
	}
}

// checkFresh fails if page p, handed to a writer or a copy, is one a lease holds or
// a live writer may still write.
// checkKept fails if page p, just granted, is past the pages a shrink keeps.
func (m *model) checkKept(p uint32, what string) {
	if to, _ := m.tab.Shrinking(); int(p) >= to {
		m.fail("page %d %s, past the %d pages the table keeps", p, what, to)
	}
}

func (m *model) checkFresh(p uint32, what string, self *mlease) {
	if w, ok := m.mayWrite[p]; ok {
		m.fail("page %d %s while lease %d's writer may still write it", p, what, w.id)
	}
	for _, l := range m.leases {
		if l != self && !l.lost && slices.Contains(l.pages, p) && l.delivered {
			m.fail("page %d %s while lease %d holds it", p, what, l.id)
		}
	}
}

// checkUnread fails if a spill copy in flight (other than self) reads page p.
func (m *model) checkUnread(p uint32, what string, self pages.CopyID) {
	for id, c := range m.inflight {
		if id != self && c.Kind == pages.Spill && slices.Contains(c.GPU, p) {
			m.fail("page %d %s while spill copy %d reads it", p, what, id)
		}
	}
}

func (m *model) hashes(c, from, n int) []kv.Hash {
	hs := make([]kv.Hash, n)
	for i := range hs {
		hs[i] = chainHash(c, from+i)
	}
	return hs
}

func (m *model) pick(pred func(*mlease) bool) *mlease {
	var ls []*mlease
	for _, id := range slices.Sorted(mapsKeys(m.leases)) {
		if l := m.leases[id]; pred(l) {
			ls = append(ls, l)
		}
	}
	if len(ls) == 0 {
		return nil
	}
	return ls[m.r.IntN(len(ls))]
}

func (m *model) alloc() {
	slot := m.r.IntN(len(m.holders))
	n := 1 + m.r.IntN(4)
	id, got, fx, err := m.tab.Alloc(m.holders[slot], n)
	switch {
	case m.tab.Window() && !errors.Is(err, pages.ErrWait):
		m.fail("alloc in the window: %v", err)
	case errors.Is(err, pages.ErrWait) && !m.tab.Window():
		m.fail("alloc waits with no window")
	case err != nil:
		if !errors.Is(err, pages.ErrNoSpace) && !errors.Is(err, pages.ErrSettling) && !errors.Is(err, pages.ErrWait) {
			m.fail("alloc: %v", err)
		}
		return
	}
	m.logf("alloc slot %d: lease %d pages %v", slot, id, got)
	for _, p := range got {
		m.checkKept(p, "allocated")
		m.checkFresh(p, "allocated", nil)
	}
	l := &mlease{id: id, slot: slot, write: true, pages: got, chain: m.r.IntN(m.chains), parent: pages.NoRef}
	// Continue a chain this holder reads, where it holds a run of it: as a replica
	// that matched a prefix seals what follows.
	if rl := m.pick(func(o *mlease) bool {
		return o.slot == slot && !o.write && o.delivered && !o.releasing && !o.lost && isPrefix(o.hashes)
	}); rl != nil && m.r.IntN(2) == 0 {
		last := len(rl.pages) - 1
		_, _, gen := m.tab.Page(rl.pages[last])
		l.chain, l.from, l.parent = hashChain(rl.hashes[0]), last+1, pages.Ref{Page: rl.pages[last], Gen: gen}
	}
	m.leases[id] = l
	m.apply(fx, l)
}

func hashChain(h kv.Hash) int { return int(binary.LittleEndian.Uint32(h[0:])) - 1 }

// isPrefix says whether hs is a chain's first len(hs) hashes, each once.
func isPrefix(hs []kv.Hash) bool {
	for i, h := range hs {
		if h != chainHash(hashChain(hs[0]), i) {
			return false
		}
	}
	return true
}

func (m *model) seal() {
	l := m.pick(func(l *mlease) bool {
		return l.write && l.delivered && !l.sealing && !l.releasing && !l.lost && !l.stranded
	})
	if l == nil {
		return
	}
	if l.hashes == nil { // a lease re-sealed after a restart keeps its hashes
		l.hashes = m.hashes(l.chain, l.from, m.r.IntN(len(l.pages)+1))
	}
	fx, err := m.tab.Seal(m.holders[l.slot], l.id, l.hashes, l.parent)
	if err != nil {
		m.fail("seal of lease %d: %v", l.id, err)
	}
	l.sealing = true
	m.logf("seal lease %d pages %v hashes %d parent %v", l.id, l.pages, len(l.hashes), l.parent)
	m.apply(fx, nil)
}

// sealDone: the writer's work lands (each sealed page holds its hash's bytes), then
// the table settles the seal.
func (m *model) sealDone() {
	l := m.pick(func(l *mlease) bool { return l.sealing && !l.lost && !l.stranded })
	if l == nil {
		return
	}
	for i, h := range l.hashes {
		m.gmem[l.pages[i]] = h
	}
	m.logf("seal done lease %d", l.id)
	_, _, fx, err := m.tab.SealDone(l.id, true)
	if err != nil {
		m.fail("seal done of lease %d: %v", l.id, err)
	}
	m.endWrite(l)
	m.apply(fx, nil)
}

func (m *model) endWrite(l *mlease) {
	for _, p := range l.pages {
		if m.mayWrite[p] == l {
			delete(m.mayWrite, p)
		}
	}
	delete(m.leases, l.id)
}

func (m *model) match() {
	slot := m.r.IntN(len(m.holders))
	c := m.r.IntN(m.chains)
	hashes := m.hashes(c, 0, 1+m.r.IntN(6))
	if m.r.IntN(8) == 0 { // a hash listed twice
		hashes = append(hashes, hashes[m.r.IntN(len(hashes))])
	}
	res, fx, err := m.tab.Match(m.holders[slot], hashes)
	switch {
	case m.tab.Window() && !errors.Is(err, pages.ErrWait) && !m.rules.RestoreInWindow:
		m.fail("match in the window: %v", err)
	case err != nil:
		if !errors.Is(err, pages.ErrWait) {
			m.fail("match: %v", err)
		}
		return
	}
	m.logf("match slot %d chain %d: %+v", slot, c, res)
	if res.Lease == 0 {
		m.apply(fx, nil)
		return
	}
	l := &mlease{id: res.Lease, slot: slot, pages: res.Pages}
	m.leases[l.id] = l
	for _, p := range res.Pages {
		m.checkKept(p, "matched")
	}
	if res.Pending {
		l.chain, l.asked = c, hashes
		m.apply(fx, nil)
		return
	}
	l.hashes = hashes[:len(res.Pages)]
	m.apply(fx, l)
}

func (m *model) release() {
	l := m.pick(func(l *mlease) bool { return l.delivered && !l.sealing && !l.releasing && !l.lost && !l.stranded })
	if l == nil {
		return
	}
	m.logf("release lease %d", l.id)
	if err := m.tab.Release(m.holders[l.slot], l.id); err != nil {
		m.fail("release of lease %d: %v", l.id, err)
	}
	l.releasing = true
}

func (m *model) releaseDone() {
	l := m.pick(func(l *mlease) bool { return l.releasing && !l.lost && !l.stranded })
	if l == nil {
		return
	}
	m.logf("release done lease %d", l.id)
	fx, err := m.tab.ReleaseDone(l.id)
	if err != nil {
		m.fail("release done of lease %d: %v", l.id, err)
	}
	m.endWrite(l)
	m.apply(fx, nil)
}

// copyDone completes (or fails) a copy that may have started: its memory moves as
// it completes.
func (m *model) copyDone() {
	var ready []pages.CopyID
	for _, id := range slices.Sorted(mapsKeys(m.inflight)) {
		if m.startable(m.inflight[id]) {
			ready = append(ready, id)
		}
	}
	if len(ready) == 0 {
		return
	}
	c := m.inflight[ready[m.r.IntN(len(ready))]]
	ok := m.r.IntN(20) != 0
	m.logf("copy done %+v ok %v", c, ok)
	m.land(c, ok)
	res, fx, err := m.tab.CopyDone(c.ID, ok)
	if err != nil {
		m.fail("copy %d done: %v", c.ID, err)
	}
	if c.Kind == pages.Restore {
		l := m.pendingRestore(res)
		m.apply(fx, l)
		return
	}
	m.apply(fx, nil)
}

func (m *model) startable(c pages.Copy) bool {
	if c.After > m.durableSeq() {
		return false
	}
	for _, w := range c.Wait {
		if !m.done[w] {
			return false
		}
	}
	return true
}

// land moves a copy's bytes.
func (m *model) land(c pages.Copy, ok bool) {
	delete(m.inflight, c.ID)
	m.done[c.ID] = true
	if !ok {
		return
	}
	for i, gp := range c.GPU {
		if c.Kind == pages.Restore {
			m.checkUnread(gp, "restored into", c.ID)
		}
		if c.Kind == pages.Spill {
			m.hmem[c.Host[i]] = m.gmem[gp]
		} else {
			m.gmem[gp] = m.hmem[c.Host[i]]
		}
	}
}

// pendingRestore finds the match lease a restore answered.
func (m *model) pendingRestore(res pages.MatchResult) *mlease {
	for _, id := range slices.Sorted(mapsKeys(m.leases)) {
		l := m.leases[id]
		if l.write || l.delivered || l.hashes != nil {
			continue
		}
		if res.Lease == 0 {
			continue
		}
		if l.id == res.Lease {
			l.pages = res.Pages
			l.hashes = l.asked[:len(res.Pages)]
			return l
		}
	}
	return nil
}

// dropEmptyRestores forgets matches whose restore ended with no lease.
func (m *model) dropEmptyRestores() {
	for id, l := range m.leases {
		if _, ok := m.tab.Lease(id); !ok && !l.write && !l.delivered && l.hashes == nil {
			delete(m.leases, id)
		}
	}
}

func (m *model) flush() { m.durable += m.r.IntN(len(m.records) - m.durable + 1) }

// durableSeq is the number of the last record on disk.
func (m *model) durableSeq() pages.Seq {
	if m.durable == 0 {
		return 0
	}
	return m.records[m.durable-1].Seq
}

// compact rewrites a journal that is all on disk as the table's snapshot, its last
// record numbered as the table's latest.
func (m *model) compact() {
	if m.durable != len(m.records) {
		return
	}
	m.records = append(m.tab.Snapshot(), pages.Record{Kind: pages.RecEnd, Seq: m.tab.Seq()})
	m.durable = len(m.records)
	m.compactions++
}

// deliver sends the answers whose effects are done: a write lease's pages may now be
// written, a read lease's read.
func (m *model) deliver() {
	keep := m.replies[:0]
	for _, rp := range m.replies {
		ready := rp.wait <= m.durableSeq()
		for _, c := range rp.await {
			ready = ready && m.done[c]
		}
		if !ready || m.leases[rp.l.id] != rp.l {
			if m.leases[rp.l.id] == rp.l {
				keep = append(keep, rp)
			}
			continue
		}
		rp.l.delivered = true
		m.logf("deliver lease %d", rp.l.id)
		if rp.l.write {
			for _, p := range rp.l.pages {
				m.checkFresh(p, "written", rp.l)
				m.checkUnread(p, "written", 0)
				m.mayWrite[p] = rp.l
				m.gmem[p] = garbage(rp.l.id)
			}
		}
	}
	m.replies = keep
}

func (m *model) spill() {
	_, fx, _ := m.tab.PickSpill(1+m.r.IntN(8), 1+m.r.IntN(4))
	m.apply(fx, nil)
}

// grow maps more pages, up to the Bound; during a shrink, it may take back pages
// given back. Memory waiting to be released is released first.
func (m *model) grow() {
	from, _ := m.tab.Shrinking()
	if from == m.cfg.Bound || m.pending {
		return
	}
	to := from + 1 + m.r.IntN(m.cfg.Bound-from)
	m.logf("grow to %d", to)
	if err := m.tab.Grow(to); err != nil {
		m.fail("grow to %d: %v", to, err)
	}
	for p := m.held; p < to; p++ {
		m.gmem[p] = junk
	}
	m.held = max(m.held, to)
}

// shrink starts giving back pages.
func (m *model) shrink() {
	from, _ := m.tab.Shrinking()
	if from < 2 {
		return
	}
	to := from - 1 - m.r.IntN((from+1)/2)
	to = max(to, 1)
	m.logf("shrink to %d", to)
	fx, err := m.tab.Shrink(to)
	if err != nil {
		m.fail("shrink to %d: %v", to, err)
	}
	m.apply(fx, nil)
}

// shrunk evicts the pages given back that have come free (now and then) and ends
// a shrink whose pages are free; their memory is released once the journal is
// durable through what Shrunk says.
func (m *model) shrunk() {
	left := -1
	if m.r.IntN(2) == 0 {
		var fx pages.Effects
		fx, left = m.tab.Drain()
		m.logf("drain: %d left", left)
		m.apply(fx, nil)
	}
	to, wait, err := m.tab.Shrunk()
	if _, ok := m.tab.Shrinking(); left == 0 && ok && err != nil {
		m.fail("shrunk with none left in use: %v", err)
	}
	switch {
	case errors.Is(err, pages.ErrInUse), errors.Is(err, pages.ErrInput):
		return
	case err != nil:
		m.fail("shrunk: %v", err)
	}
	m.logf("shrunk to %d, release after %d", to, wait)
	m.shrinks++
	m.pending, m.freeAt = true, wait
}

// released gives back the memory of the pages past Mapped once the journal allows.
func (m *model) released() {
	if !m.pending || m.freeAt > m.durableSeq() {
		return
	}
	m.logf("memory of pages %d..%d released", m.tab.Mapped(), m.held)
	for p := m.tab.Mapped(); p < m.held; p++ {
		m.gmem[p] = junk
	}
	m.held, m.pending = m.tab.Mapped(), false
}

func (m *model) die() {
	slot := m.r.IntN(len(m.holders))
	m.logf("slot %d dies", slot)
	fx := m.tab.HolderDead(m.holders[slot])
	for _, id := range slices.Sorted(mapsKeys(m.leases)) {
		if l := m.leases[id]; l.slot == slot {
			m.endWrite(l)
		}
	}
	delete(m.redeclare, slot)
	m.starts++
	m.holders[slot] = pages.Holder{PID: m.holders[slot].PID, Start: m.starts}
	m.apply(fx, nil)
}

// crash kills the owner: copies in flight land or not, the journal keeps what was
// durable, answers not sent are never sent, and a new table is made from the journal.
func (m *model) crash() {
	for _, id := range slices.Sorted(mapsKeys(m.inflight)) {
		m.land(m.inflight[id], m.r.IntN(2) == 0 && m.startable(m.inflight[id]))
	}
	m.logf("crash: %d of %d records durable", m.durable, len(m.records))
	m.records = m.records[:m.durable]
	m.replies = nil
	clear(m.done) // the next table numbers its copies from 1 again
	rec, err := pages.Replay(m.records)
	if err != nil {
		m.fail("replay: %v", err)
	}
	m.lastSeq = rec.Seq
	m.cfg.Epoch++
	m.cfg.Pages = m.held // the memory held is mapped again, the shrink forgotten
	m.pending = false
	tab, err := pages.RestartWith(m.cfg, rec, m.rules)
	if err != nil {
		m.fail("restart: %v", err)
	}
	m.tab = tab
	m.restarts++
	m.checkJournaled(rec)
	granted := map[pages.LeaseID]bool{}
	for _, g := range rec.Leases {
		granted[g.Lease] = true
	}
	clear(m.redeclare)
	for _, id := range slices.Sorted(mapsKeys(m.leases)) {
		l := m.leases[id]
		if !l.delivered || l.lost {
			if !l.lost {
				delete(m.leases, id) // never answered: its holder never knew it
			}
			continue
		}
		if !granted[id] && !l.releasing {
			m.fail("delivered lease %d is not in the journal", id)
		}
		l.stranded = true
		m.redeclare[l.slot] = append(m.redeclare[l.slot], l)
	}
}

// checkJournaled checks that the restarted table holds exactly what the journal says,
// replayed here independently.
func (m *model) checkJournaled(rec pages.Recovered) {
	gpu, host := map[uint32]kv.Hash{}, map[uint32]kv.Hash{}
	for _, r := range m.records {
		switch r.Kind {
		case pages.RecSeal:
			gpu[r.Page] = r.Hash
		case pages.RecFree:
			delete(gpu, r.Page)
		case pages.RecHostSeal:
			host[r.Page] = r.Hash
		case pages.RecHostFree:
			delete(host, r.Page)
		}
	}
	st := m.tab.Stats()
	if st.Sealed != len(gpu) || st.HostSealed != len(host) {
		m.fail("restart: %d sealed and %d host pages, the journal has %d and %d", st.Sealed, st.HostSealed, len(gpu), len(host))
	}
	for p, h := range gpu {
		if got, ok := m.tab.Lookup(h); !ok || got != p {
			m.fail("restart: hash of page %d not at it", p)
		}
	}
	for p, h := range host {
		if got, ok := m.tab.HostLookup(h); !ok || got != p {
			m.fail("restart: hash of host page %d not at it", p)
		}
	}
	for _, g := range rec.Leases {
		if info, ok := m.tab.Lease(g.Lease); !ok || !info.Stranded || info.Holder != g.Holder {
			m.fail("restart: grant %d not stranded", g.Lease)
		}
	}
}

// reattach: a slot's replica re-declares what it held, then says it has.
func (m *model) reattach() {
	var slots []int
	for s := range m.redeclare {
		slots = append(slots, s)
	}
	if len(slots) == 0 {
		return
	}
	slices.Sort(slots)
	slot := slots[m.r.IntN(len(slots))]
	for _, l := range m.redeclare[slot] {
		var hashes []kv.Hash
		if !l.write {
			hashes = l.hashes
		}
		err := m.tab.Reattach(m.holders[slot], l.id, l.write, l.pages, hashes)
		m.logf("reattach slot %d lease %d: %v", slot, l.id, err)
		if err != nil {
			if !l.releasing {
				m.fail("reattach of delivered lease %d refused: %v", l.id, err)
			}
			if l.write && !l.releasing {
				l.lost = true // its work may still land
			} else {
				m.endWrite(l)
			}
			continue
		}
		// Back as it was granted: a sealing lease is sealed again, a release made again.
		l.sealing, l.stranded = false, false
		if l.releasing {
			l.releasing = false
		}
	}
	delete(m.redeclare, slot)
	m.apply(m.tab.Declared(m.holders[slot]), nil)
}

// check is every invariant, after every step.
func (m *model) check() {
	if err := m.tab.Check(); err != nil {
		m.fail("%v", err)
	}
	if err := pages.LeavesFirst(m.tab); err != nil {
		m.fail("%v", err)
	}
	for p, l := range m.mayWrite {
		if w := pages.Writer(m.tab, p); w != l.id {
			st, _, _ := m.tab.Page(p)
			m.fail("page %d, which lease %d's writer may still write, is %s under lease %d", p, l.id, st, w)
		}
	}
	for _, id := range slices.Sorted(mapsKeys(m.leases)) {
		l := m.leases[id]
		if l.write || !l.delivered || l.lost {
			continue
		}
		for i, p := range l.pages {
			st, h, _ := m.tab.Page(p)
			if st != pages.Sealed || h != l.hashes[i] || pages.Readers(m.tab, p) == 0 && !l.releasing {
				m.fail("page %d of read lease %d is %s under %v", p, l.id, st, h)
			}
			if m.gmem[p] != l.hashes[i] {
				m.fail("page %d of read lease %d holds %v's bytes, not %v's", p, l.id, m.gmem[p], l.hashes[i])
			}
		}
	}
}

// run runs steps operations and returns the first invariant that broke.
func (m *model) run(steps int) (err error) {
	defer func() {
		if r := recover(); r != nil {
			f, ok := r.(failure)
			if !ok {
				panic(r)
			}
			err = f.err
		}
	}()
	for m.step = 0; m.step < steps; m.step++ {
		switch k := m.r.IntN(106); {
		case k < 14:
			m.alloc()
		case k < 24:
			m.seal()
		case k < 34:
			m.sealDone()
		case k < 48:
			m.match()
		case k < 56:
			m.release()
		case k < 64:
			m.releaseDone()
		case k < 74:
			m.copyDone()
		case k < 79:
			m.flush()
		case k < 80:
			m.compact()
		case k < 88:
			m.deliver()
		case k < 92:
			m.spill()
		case k < 94:
			m.die()
		case k < 96:
			m.crash()
		case k < 99:
			m.reattach()
		case k < 100:
			m.tab.CloseWindow()
		case k < 101:
			m.grow()
		case k < 103:
			m.shrink()
		default:
			m.shrunk()
		}
		m.released()
		m.dropEmptyRestores()
		m.check()
	}
	return nil
}

// TestModel runs random operation sequences against the reference model, checking
// every invariant after every step. A failure names its seed: -model.seed=N replays it.
func TestModel(t *testing.T) {
	seeds := []uint64{*modelSeed}
	n := *modelSeeds
	if n == 0 {
		n = 300 / slowdown
	}
	if *modelSeed == 0 {
		seeds = seeds[:0]
		for s := range n {
			seeds = append(seeds, uint64(s)+1)
		}
	}
	restarts, compactions, shrinks := 0, 0, 0
	for _, seed := range seeds {
		m := newModel(t, seed, pages.Rules{})
		if err := m.run(*modelSteps); err != nil {
			t.Fatalf("seed %d: %v\nreplay: go test ./kv/internal/pages -run 'TestModel$' -model.seed=%d -model.trace", seed, err, seed)
		}
		restarts += m.restarts
		compactions += m.compactions
		shrinks += m.shrinks
	}
	t.Logf("%d seeds, %d restarts, %d compactions, %d shrinks", len(seeds), restarts, compactions, shrinks)
}

func mapsKeys[K comparable, V any](m map[K]V) func(func(K) bool) {
	return func(yield func(K) bool) {
		for k := range m {
			if !yield(k) {
				return
			}
		}
	}
}

// TestModelRules shows that the model catches a table without each restart rule: a
// write lease's pages free at a restart (NoStrand), its end journaled at its seal
// (EndAtSeal), a shrink that ends the leases of the pages it gives back
// (ShrinkTakes). Each finds a failing seed among the first few hundred.
func TestModelRules(t *testing.T) {
	for _, c := range []struct {
		name  string
		rules pages.Rules
	}{{"NoStrand", pages.Rules{NoStrand: true}}, {"EndAtSeal", pages.Rules{EndAtSeal: true}}, {"ShrinkTakes", pages.Rules{ShrinkTakes: true}}} {
		t.Run(c.name, func(t *testing.T) {
			for seed := uint64(1); seed <= 2000; seed++ {
				if err := newModel(t, seed, c.rules).run(*modelSteps); err != nil {
					t.Logf("seed %d fails without the rule: %v", seed, err)
					return
				}
			}
			t.Fatal("no seed of 2000 fails without the rule")
		})
	}
}
