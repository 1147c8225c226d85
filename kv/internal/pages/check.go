package pages

import (
	"errors"
	"fmt"
	"slices"
)

// errCheck is what Check finds wrong.
var errCheck = errors.New("pages: the table contradicts itself")

// Check recounts t from its pages and leases and returns what contradicts its books:
// the counts, the lists, the free stacks, the indexes, each page's readers, releases
// and writer against the leases, the twins, the holders' loads. It costs O(pages +
// leases), for tests; nil if all agree.
func (t *Table) Check() error {
	var errs []error
	bad := func(f string, a ...any) { errs = append(errs, fmt.Errorf("%w: "+f, append([]any{errCheck}, a...)...)) }

	readers := make([]int, len(t.g))
	releases := make([]int, len(t.g))
	writer := make([]LeaseID, len(t.g))
	pins := make([]int, len(t.h))
	own := func(p uint32, id LeaseID) {
		if writer[p] != 0 {
			bad("page %d is written under leases %d and %d", p, writer[p], id)
		}
		writer[p] = id
	}
	holderPages := map[Holder]int{}
	holderLeases := map[Holder]int{}
	nstr := 0
	for id, l := range t.leases {
		if l.id != id {
			bad("lease %d booked as %d", l.id, id)
		}
		holderPages[l.holder] += len(l.pages)
		holderLeases[l.holder]++
		if l.state == stranded {
			nstr++
		}
		switch {
		case l.state == restoring:
			job := t.copies[l.copy]
			if job == nil || job.l != l {
				bad("restoring lease %d has no copy", id)
				continue
			}
			for i, p := range l.pages {
				if slices.Contains(job.at, i) {
					own(p, id)
				} else {
					readers[p]++
				}
			}
		case l.write && l.state == stranded && t.rules.noStrand:
		case l.write:
			for _, p := range l.pages {
				own(p, id)
			}
		case l.state == releasing:
			for _, p := range l.pages {
				releases[p]++
			}
		default:
			for _, p := range l.pages {
				readers[p]++
			}
		}
	}
	for _, job := range t.copies {
		if job.kind == Restore {
			for _, hp := range job.host {
				pins[hp]++
			}
			if job.dead {
				for i, p := range job.l.pages {
					if slices.Contains(job.at, i) {
						own(p, job.l.id)
					} else {
						readers[p]++
					}
				}
			}
		}
	}

	var count, dcount [nStates]int
	leased, releasing, unread, listed, dunread := 0, 0, 0, 0, 0
	if t.limit < 1 || t.limit > len(t.g) {
		bad("pages from %d of %d given back", t.limit, len(t.g))
	}
	for i := range t.g {
		p, g := uint32(i), &t.g[i]
		drain := i >= t.limit
		count[g.state]++
		if drain {
			dcount[g.state]++
		}
		if int(g.readers) != readers[p] || int(g.releasing) != releases[p] {
			bad("page %d (%s) has %d readers and %d releasing, its leases %d and %d", p, g.state, g.readers, g.releasing, readers[p], releases[p])
		}
		switch g.state {
		case Writing, Sealing, Settling:
			if writer[p] == 0 || g.lease != writer[p] {
				bad("page %d is %s under lease %d, the leases say %d", p, g.state, g.lease, writer[p])
			}
		default:
			if writer[p] != 0 {
				bad("page %d is %s, and lease %d writes it", p, g.state, writer[p])
			}
		}
		if g.state == Sealed {
			if q, ok := t.index[g.hash]; !ok || q != p {
				bad("sealed page %d is not indexed under its hash", p)
			}
			if g.readers > 0 {
				leased++
			} else {
				unread++
				if drain {
					dunread++
				}
			}
			if g.releasing > 0 {
				releasing++
			}
		}
		want := g.state == Sealed && g.readers == 0 && g.releasing == 0 && !drain
		if want != g.listed {
			bad("page %d (%s, %d readers, %d releasing) listed %v", p, g.state, g.readers, g.releasing, g.listed)
		}
		if g.listed {
			listed++
		}
		if g.copy != 0 && (t.copies[g.copy] == nil || t.copies[g.copy].kind != Spill || !slices.Contains(t.copies[g.copy].gpu, p)) {
			bad("page %d is read by copy %d, which does not read it", p, g.copy)
		}
		if g.twin != none {
			if g.state != Sealed || int(g.twin) >= len(t.h) || t.h[g.twin].gpu != p {
				bad("page %d (%s) twins host page %d, which twins %d", p, g.state, g.twin, t.h[min(int(g.twin), len(t.h)-1)].gpu)
			}
		}
	}
	if count != t.count || leased != t.leased || releasing != t.releasing || unread != t.unread || dcount != t.dcount || dunread != t.dunread {
		bad("counts %v leased %d releasing %d unread %d given back %v %d; recounted %v %d %d %d %v %d", t.count, t.leased, t.releasing, t.unread,
			t.dcount, t.dunread, count, leased, releasing, unread, dcount, dunread)
	}
	if len(t.index) != count[Sealed] {
		bad("%d hashes indexed, %d pages sealed", len(t.index), count[Sealed])
	}
	checkStack(bad, "GPU", t.free, func(p uint32) bool { return t.g[p].state == Free && int(p) < t.limit }, count[Free]-dcount[Free], len(t.g))
	n, prev := 0, none
	for p := t.glru.head; p != none && n <= len(t.g); p = t.g[p].next {
		if !t.g[p].listed || t.g[p].prev != prev {
			bad("GPU list broken at page %d", p)
			break
		}
		prev = p
		n++
	}
	if n != listed || n != t.glru.n || prev != t.glru.tail {
		bad("GPU list holds %d pages, %d listed, booked %d", n, listed, t.glru.n)
	}

	var hcount [nHostStates]int
	twins, pinned, hlisted := 0, 0, 0
	for i := range t.h {
		p, h := uint32(i), &t.h[i]
		hcount[h.state]++
		if int(h.pins) != pins[p] {
			bad("host page %d has %d pins, %d restores read it", p, h.pins, pins[p])
		}
		if h.pins > 0 {
			pinned++
		}
		if h.state == HostSealed {
			if q, ok := t.hindex[h.hash]; !ok || q != p {
				bad("sealed host page %d is not indexed under its hash", p)
			}
			if h.gpu != none {
				twins++
			}
		}
		if h.gpu != none && (h.state == HostFree || t.g[h.gpu].twin != p) {
			bad("host page %d twins page %d, whose twin is %d", p, h.gpu, t.g[h.gpu].twin)
		}
		if h.state == HostFilling && t.copies[h.copy] == nil {
			bad("host page %d fills under copy %d, not in flight", p, h.copy)
		}
		want := h.state == HostSealed && h.gpu == none && h.pins == 0
		if want != h.listed {
			bad("host page %d listed %v", p, h.listed)
		}
		if h.listed {
			hlisted++
		}
	}
	if hcount != t.hcount || twins != t.twins || pinned != t.pinned {
		bad("host counts %v twins %d pinned %d; recounted %v %d %d", t.hcount, t.twins, t.pinned, hcount, twins, pinned)
	}
	if len(t.hindex) != hcount[HostSealed] {
		bad("%d hashes indexed on the host, %d host pages sealed", len(t.hindex), hcount[HostSealed])
	}
	checkStack(bad, "host", t.hfree, func(p uint32) bool { return t.h[p].state == HostFree }, hcount[HostFree], len(t.h))
	n, prev = 0, none
	for p := t.hlru.head; p != none && n <= len(t.h); p = t.h[p].next {
		if !t.h[p].listed || t.h[p].prev != prev {
			bad("host list broken at page %d", p)
			break
		}
		prev = p
		n++
	}
	if n != hlisted || n != t.hlru.n || prev != t.hlru.tail {
		bad("host list holds %d pages, %d listed, booked %d", n, hlisted, t.hlru.n)
	}

	if nstr != t.nstranded {
		bad("%d stranded leases, booked %d", nstr, t.nstranded)
	}
	for h, hd := range t.holders {
		if len(hd.leases) != holderLeases[h] || hd.pages != holderPages[h] {
			bad("holder %v booked %d leases of %d pages, holds %d of %d", h, len(hd.leases), hd.pages, holderLeases[h], holderPages[h])
		}
	}
	if len(t.holders) != len(holderLeases) {
		bad("%d holders booked, %d hold leases", len(t.holders), len(holderLeases))
	}
	return errors.Join(errs...)
}

// checkStack checks that stack holds each page that is free exactly once.
func checkStack(bad func(string, ...any), what string, stack []uint32, free func(uint32) bool, want, pages int) {
	seen := make([]bool, pages)
	for _, p := range stack {
		if int(p) >= pages || seen[p] || !free(p) {
			bad("%s free stack holds page %d wrongly", what, p)
			return
		}
		seen[p] = true
	}
	if len(stack) != want {
		bad("%s free stack holds %d pages, %d are free", what, len(stack), want)
	}
}
