package pages

import (
	"cmp"
	"fmt"
	"maps"
	"slices"

	"github.com/cudapool/cudapool/kv"
)

// PageHash is a page and the hash it holds.
type PageHash struct {
	Page uint32
	Hash kv.Hash
}

// Recovered is the state a journal describes: what [Restart] rebuilds.
type Recovered struct {
	Sealed []PageHash // sealed GPU pages, least recent first
	Host   []PageHash // sealed host pages, least recent first
	Leases []Record   // leases granted and not ended, by id
	// Replicas counts, by holder, the connections (replicas) each holder had: each
	// declares on its own ([Table.Declared]). A holder with leases and no count here
	// had one. Replay leaves it nil: the caller's attach records say.
	Replicas map[Holder]int
	// Seq is the last record's sequence number: the table numbers on from it.
	Seq Seq
}

// Replay applies records, in order, to an empty state: the sealed pages are those
// sealed and not freed since, the host pages likewise, the leases those granted and not ended. A
// record that does not fit what came before (a page sealed twice, a page freed that
// is not sealed, a lease granted twice) is an ErrJournal.
func Replay(records []Record) (Recovered, error) {
	type at struct {
		hash kv.Hash
		seq  int
	}
	gpu, host := map[uint32]at{}, map[uint32]at{}
	leases := map[LeaseID]Record{}
	for i, r := range records {
		var err error
		switch r.Kind {
		case RecSeal, RecHostSeal:
			m := gpu
			if r.Kind == RecHostSeal {
				m = host
			}
			if _, dup := m[r.Page]; dup {
				err = fmt.Errorf("%w: record %d seals page %d, sealed already", ErrJournal, i, r.Page)
			}
			m[r.Page] = at{r.Hash, i}
		case RecFree, RecHostFree:
			m := gpu
			if r.Kind == RecHostFree {
				m = host
			}
			if _, ok := m[r.Page]; !ok {
				err = fmt.Errorf("%w: record %d frees page %d, not sealed", ErrJournal, i, r.Page)
			}
			delete(m, r.Page)
		case RecLeased:
			if _, dup := leases[r.Lease]; dup {
				err = fmt.Errorf("%w: record %d grants lease %d again", ErrJournal, i, r.Lease)
			}
			leases[r.Lease] = r
		case RecEnd:
			delete(leases, r.Lease) // an end may outlive its lease's record in a compaction
		default:
			err = fmt.Errorf("%w: record %d is of kind %d", ErrJournal, i, r.Kind)
		}
		if err != nil {
			return Recovered{}, err
		}
	}
	order := func(m map[uint32]at) []PageHash {
		out := make([]PageHash, 0, len(m))
		for _, p := range slices.SortedFunc(maps.Keys(m), func(a, b uint32) int { return cmp.Compare(m[a].seq, m[b].seq) }) {
			out = append(out, PageHash{p, m[p].hash})
		}
		return out
	}
	var rec Recovered
	rec.Sealed, rec.Host = order(gpu), order(host)
	for _, r := range records { // a snapshot's records carry no number but its last
		rec.Seq = max(rec.Seq, r.Seq)
	}
	if rec.Seq == 0 {
		rec.Seq = Seq(len(records))
	}
	for _, id := range slices.Sorted(maps.Keys(leases)) {
		rec.Leases = append(rec.Leases, leases[id])
	}
	return rec, nil
}

// Restart makes the table of a restart from rec, the journal's state: rec's sealed
// pages and host pages, and each of its leases as a stranded lease of its holder, its
// pages out of reach (a write lease's) or held (a read lease's). The reattach window
// is open while any holder has a stranded lease: until each has declared its leases
// ([Table.Declared]) or is dead ([Table.HolderDead]), or [Table.CloseWindow]. A
// stranded lease is the holder's again once it reattaches it ([Table.Reattach]) and
// ends when its holder is dead. cfg.Epoch must be past every lease's. cfg.Pages
// are the pages mapped now: rec's records of pages past them (and below cfg.Bound)
// are dropped, their hashes no longer visible, and a lease that names one is
// stranded over its other pages only (its reattach refused); a page past the Bound
// is an ErrJournal. On failure (ErrJournal, ErrInput) there is no table.
func Restart(cfg Config, rec Recovered) (*Table, error) { return restart(cfg, rec, rules{}) }

func restart(cfg Config, rec Recovered, r rules) (*Table, error) {
	t, err := New(cfg)
	if err != nil {
		return nil, err
	}
	t.rules, t.seq = r, rec.Seq
	for _, sp := range rec.Sealed {
		if int(sp.Page) >= len(t.g) && int(sp.Page) < t.cfg.Bound {
			continue // not mapped now: its hash is gone
		}
		if err := t.restoreSealed(sp); err != nil {
			return nil, err
		}
	}
	for _, sp := range rec.Host {
		if err := t.restoreHost(sp); err != nil {
			return nil, err
		}
	}
	for _, r := range rec.Leases {
		r = t.mappedOnly(r)
		if len(r.Pages) == 0 {
			continue // of pages not mapped now: its reattach is refused
		}
		if err := t.restoreLease(r); err != nil {
			return nil, err
		}
	}
	t.free = t.free[:0]
	for p := len(t.g) - 1; p >= 0; p-- {
		if t.g[p].state == Free {
			t.free = append(t.free, uint32(p))
		}
	}
	t.hfree = t.hfree[:0]
	for p := len(t.h) - 1; p >= 0; p-- {
		if t.h[p].state == HostFree {
			t.hfree = append(t.hfree, uint32(p))
		}
	}
	for h := range t.expected {
		t.expected[h] = max(1, rec.Replicas[h])
	}
	t.window = len(t.expected) > 0
	return t, nil
}

// mappedOnly is lease record r without its pages past Mapped and below the Bound
// (those not mapped now): a lease that names one is stranded over the rest, which
// stay out of reach until its holder declares or dies, and its reattach is refused.
func (t *Table) mappedOnly(r Record) Record {
	if !slices.ContainsFunc(r.Pages, t.unmapped) || !r.Write && len(r.Hashes) != len(r.Pages) {
		return r
	}
	out := r
	out.Pages, out.Hashes = nil, nil
	for i, p := range r.Pages {
		if !t.unmapped(p) {
			out.Pages = append(out.Pages, p)
			if !r.Write {
				out.Hashes = append(out.Hashes, r.Hashes[i])
			}
		}
	}
	return out
}

// unmapped says whether GPU page p is one the table may have but does not now.
func (t *Table) unmapped(p uint32) bool { return int(p) >= len(t.g) && int(p) < t.cfg.Bound }

func (t *Table) restoreSealed(sp PageHash) error {
	if int(sp.Page) >= len(t.g) || t.g[sp.Page].state != Free {
		return fmt.Errorf("%w: GPU page %d of %d sealed twice or out of range", ErrJournal, sp.Page, len(t.g))
	}
	if _, dup := t.index[sp.Hash]; dup {
		return fmt.Errorf("%w: hash %v sealed in two GPU pages", ErrJournal, sp.Hash)
	}
	t.leave(sp.Page)
	t.g[sp.Page].state, t.g[sp.Page].hash = Sealed, sp.Hash
	t.index[sp.Hash] = sp.Page
	t.enter(sp.Page)
	return nil
}

func (t *Table) restoreHost(sp PageHash) error {
	if int(sp.Page) >= len(t.h) || t.h[sp.Page].state != HostFree {
		return fmt.Errorf("%w: host page %d of %d sealed twice or out of range", ErrJournal, sp.Page, len(t.h))
	}
	if _, dup := t.hindex[sp.Hash]; dup {
		return fmt.Errorf("%w: hash %v sealed in two host pages", ErrJournal, sp.Hash)
	}
	t.hleave(sp.Page)
	h := &t.h[sp.Page]
	h.state, h.hash = HostSealed, sp.Hash
	t.hindex[sp.Hash] = sp.Page
	if p, ok := t.index[sp.Hash]; ok {
		h.gpu = p
		t.g[p].twin = sp.Page
	}
	t.henter(sp.Page)
	return nil
}

func (t *Table) restoreLease(r Record) error {
	switch {
	case r.Kind != RecLeased:
		return fmt.Errorf("%w: a lease record of kind %v", ErrJournal, r.Kind)
	case r.Lease.Epoch() >= t.cfg.Epoch:
		return fmt.Errorf("%w: lease %d is of epoch %d, this table's is %d", ErrJournal, r.Lease, r.Lease.Epoch(), t.cfg.Epoch)
	case len(r.Pages) == 0 || (!r.Write && len(r.Hashes) != len(r.Pages)):
		return fmt.Errorf("%w: lease %d of %d pages and %d hashes", ErrJournal, r.Lease, len(r.Pages), len(r.Hashes))
	}
	for i, p := range r.Pages {
		switch {
		case int(p) >= len(t.g):
			return fmt.Errorf("%w: lease %d names page %d of %d", ErrJournal, r.Lease, p, len(t.g))
		case r.Write && t.g[p].state != Free:
			return fmt.Errorf("%w: write lease %d names page %d, %s", ErrJournal, r.Lease, p, t.g[p].state)
		case !r.Write && (t.g[p].state != Sealed || t.g[p].hash != r.Hashes[i]):
			return fmt.Errorf("%w: read lease %d names page %d, not sealed under its hash", ErrJournal, r.Lease, p)
		}
		if r.Write && !t.rules.noStrand {
			t.setState(p, Writing, r.Lease)
		}
	}
	if !r.Write {
		for i := len(r.Pages) - 1; i >= 0; i-- {
			t.read(r.Pages[i], 1)
		}
	}
	t.addLease(&lease{id: r.Lease, holder: r.Holder, write: r.Write, state: stranded,
		pages: slices.Clone(r.Pages), hashes: slices.Clone(r.Hashes), parent: NoRef})
	t.expected[r.Holder] = 1
	return nil
}

// Reattach makes stranded lease id h's again: accepted only for a lease granted to h
// before the restart, not ended, with the same kind, pages and (a read lease's) hashes.
// A lease reattached joins h's leases ([Table.Load]); its pages were never out of its
// hands. ErrLost otherwise, with nothing changed.
func (t *Table) Reattach(h Holder, id LeaseID, write bool, pages []uint32, hashes []kv.Hash) error {
	l, ok := t.leases[id]
	switch {
	case !ok || l.holder != h || l.state != stranded:
		return fmt.Errorf("%w: lease %d was not granted to %v before the restart, or was taken back already", ErrLost, id, h)
	case l.write != write || !slices.Equal(l.pages, pages) || (!write && !slices.Equal(l.hashes, hashes)):
		return fmt.Errorf("%w: lease %d was granted with other pages", ErrLost, id)
	}
	if write && t.rules.noStrand { // the defect: the pages were free meanwhile
		for _, p := range pages {
			if int(p) >= t.limit || t.g[p].state != Free {
				return fmt.Errorf("%w: page %d is no longer free", ErrLost, p)
			}
		}
		t.free = slices.DeleteFunc(t.free, func(p uint32) bool { return slices.Contains(pages, p) })
		for _, p := range pages {
			t.setState(p, Writing, id)
		}
	}
	l.state = held
	t.nstranded--
	return nil
}

// Declared says that one replica (connection) of h has reattached every lease whose
// pages it may still touch. Once every replica of h has (Recovered.Replicas), h's
// stranded leases left are given back (ended: a write lease's pages freed, a read
// lease's let go), and the window no longer waits for h; it closes once it waits for
// no one. A replica re-declares every lease it holds, sealed and released ones whose
// answer it did not get included; one whose answer it never got it never touched.
func (t *Table) Declared(h Holder) Effects {
	if n, ok := t.expected[h]; ok && n > 1 {
		t.expected[h] = n - 1
		return t.effects()
	}
	t.expect(h)
	if hd := t.holders[h]; hd != nil {
		for _, id := range slices.Sorted(maps.Keys(hd.leases)) {
			if l := hd.leases[id]; l.state == stranded {
				t.endDead(l)
			}
		}
	}
	return t.effects()
}

// expect stops waiting for h.
func (t *Table) expect(h Holder) {
	delete(t.expected, h)
	if len(t.expected) == 0 {
		t.window = false
	}
}

// CloseWindow closes the reattach window (its grace has passed). Stranded leases stay
// stranded, their pages out of reach, until their holders reattach them, declare, or
// die; a holder that had several replicas still gives its leases back only once each
// has declared.
func (t *Table) CloseWindow() { t.window = false }

// Expected are the holders the window waits for, sorted.
func (t *Table) Expected() []Holder {
	return slices.SortedFunc(maps.Keys(t.expected), func(a, b Holder) int {
		return cmp.Or(cmp.Compare(a.PID, b.PID), cmp.Compare(a.Start, b.Start))
	})
}

// HolderDead ends every lease of h, which has exited: its write leases' pages are
// freed (pages it sealed whose work was pending publish nothing), its read leases let
// go, its restores in flight answer no one. The window no longer waits for it.
func (t *Table) HolderDead(h Holder) Effects {
	t.expect(h)
	hd := t.holders[h]
	if hd == nil {
		return t.effects()
	}
	for _, id := range slices.Sorted(maps.Keys(hd.leases)) {
		t.endDead(hd.leases[id])
	}
	return t.effects()
}

func (t *Table) endDead(l *lease) {
	switch {
	case l.state == restoring:
		t.copies[l.copy].dead = true
		t.dropLease(l)
		return // never granted: nothing to journal
	case l.state == sealing:
		var v, d int
		t.settleSeal(l, false, &v, &d)
		return
	case l.state == releasing:
		t.settleRelease(l)
		return
	case l.write:
		if l.state != stranded || !t.rules.noStrand {
			for _, p := range l.pages {
				t.release(p)
			}
		}
	default:
		for i := len(l.pages) - 1; i >= 0; i-- {
			t.read(l.pages[i], -1)
		}
	}
	t.dropLease(l)
	t.journal(Record{Kind: RecEnd, Lease: l.id})
}

// Snapshot is the records that rebuild t's state from nothing, for a compaction: a
// seal per sealed GPU page and per sealed host page, least recent first, and a RecLeased
// record per lease. It costs O(pages in use).
func (t *Table) Snapshot() []Record {
	var out []Record
	for _, p := range slices.Sorted(maps.Values(t.index)) {
		if !t.g[p].listed { // held: more recent than every listed page
			out = append(out, Record{Kind: RecSeal, Page: p, Hash: t.g[p].hash})
		}
	}
	var listed []Record
	for p := t.glru.head; p != none; p = t.g[p].next {
		listed = append(listed, Record{Kind: RecSeal, Page: p, Hash: t.g[p].hash})
	}
	slices.Reverse(listed)
	out = append(listed, out...)
	var hlisted []Record
	for p := t.hlru.head; p != none; p = t.h[p].next {
		hlisted = append(hlisted, Record{Kind: RecHostSeal, Page: p, Hash: t.h[p].hash})
	}
	slices.Reverse(hlisted)
	out = append(out, hlisted...)
	for _, p := range slices.Sorted(maps.Values(t.hindex)) {
		if !t.h[p].listed { // twins and pages a restore reads
			out = append(out, Record{Kind: RecHostSeal, Page: p, Hash: t.h[p].hash})
		}
	}
	for _, id := range slices.Sorted(maps.Keys(t.leases)) {
		if l := t.leases[id]; l.state != restoring && (l.state != sealing || !t.rules.endAtSeal) {
			out = append(out, leaseRecord(l))
		}
	}
	return out
}
