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
	c := &checker{
		t:            t,
		readers:      make([]int, len(t.g)),
		releases:     make([]int, len(t.g)),
		writer:       make([]LeaseID, len(t.g)),
		pins:         make([]int, len(t.h)),
		holderPages:  map[Holder]int{},
		holderLeases: map[Holder]int{},
	}
	c.recountLeases()
	c.recountRestores()
	c.checkGPU()
	c.checkHost()
	c.checkHolders()
	return errors.Join(c.errs...)
}

// checker holds what [Table.Check] recounts from a table's leases and copies, and
// what it finds wrong.
type checker struct {
	t    *Table
	errs []error

	// Per GPU page: the leases (and dead restores) reading it, releasing it, and
	// the one writing it (0: none). Per host page: the restores reading it.
	readers, releases []int
	writer            []LeaseID
	pins              []int

	holderPages, holderLeases map[Holder]int
	stranded                  int
}

// bad records one contradiction, wrapping errCheck.
func (c *checker) bad(f string, a ...any) {
	c.errs = append(c.errs, fmt.Errorf("%w: "+f, append([]any{errCheck}, a...)...))
}

// own books lease id as page p's writer, and reports a second writer.
func (c *checker) own(p uint32, id LeaseID) {
	if c.writer[p] != 0 {
		c.bad("page %d is written under leases %d and %d", p, c.writer[p], id)
	}
	c.writer[p] = id
}

// restoring books the pages of lease l that restore job copies into as written by
// it, and its other pages as read.
func (c *checker) restoring(l *lease, job *copyJob) {
	for i, p := range l.pages {
		if slices.Contains(job.at, i) {
			c.own(p, l.id)
		} else {
			c.readers[p]++
		}
	}
}

// recountLeases books each lease's pages as read, released or written by it, and
// counts the holders' leases and pages and the stranded leases.
func (c *checker) recountLeases() {
	t := c.t
	for id, l := range t.leases {
		if l.id != id {
			c.bad("lease %d booked as %d", l.id, id)
		}
		c.holderPages[l.holder] += len(l.pages)
		c.holderLeases[l.holder]++
		if l.state == stranded {
			c.stranded++
		}
		switch {
		case l.state == restoring:
			job := t.copies[l.copy]
			if job == nil || job.l != l {
				c.bad("restoring lease %d has no copy", id)
				continue
			}
			c.restoring(l, job)
		case l.write && l.state == stranded && t.rules.noStrand:
		case l.write:
			for _, p := range l.pages {
				c.own(p, id)
			}
		case l.state == releasing:
			for _, p := range l.pages {
				c.releases[p]++
			}
		default:
			for _, p := range l.pages {
				c.readers[p]++
			}
		}
	}
}

// recountRestores books the host pages each restore reads as pinned, and the pages
// of a restore whose lease is gone as its lease's still.
func (c *checker) recountRestores() {
	for _, job := range c.t.copies {
		if job.kind != Restore {
			continue
		}
		for _, hp := range job.host {
			c.pins[hp]++
		}
		if job.dead {
			c.restoring(job.l, job)
		}
	}
}

// checkGPU checks each GPU page against the recount, then the table's GPU counts,
// index, free stack and list.
func (c *checker) checkGPU() {
	t := c.t
	var count, dcount [nStates]int
	leased, releasing, unread, listed, dunread := 0, 0, 0, 0, 0
	if t.limit < 1 || t.limit > len(t.g) {
		c.bad("pages from %d of %d given back", t.limit, len(t.g))
	}
	for i := range t.g {
		p, g := uint32(i), &t.g[i]
		drain := i >= t.limit
		count[g.state]++
		if drain {
			dcount[g.state]++
		}
		c.checkPage(p, g, drain)
		if g.state == Sealed {
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
		if g.listed {
			listed++
		}
	}
	if count != t.count || leased != t.leased || releasing != t.releasing || unread != t.unread || dcount != t.dcount || dunread != t.dunread {
		c.bad("counts %v leased %d releasing %d unread %d given back %v %d; recounted %v %d %d %d %v %d", t.count, t.leased, t.releasing, t.unread,
			t.dcount, t.dunread, count, leased, releasing, unread, dcount, dunread)
	}
	if len(t.index) != count[Sealed] {
		c.bad("%d hashes indexed, %d pages sealed", len(t.index), count[Sealed])
	}
	checkStack(c.bad, "GPU", t.free, func(p uint32) bool { return t.g[p].state == Free && int(p) < t.limit }, count[Free]-dcount[Free], len(t.g))
	c.checkList("GPU", &t.glru, t.glinks, func(p uint32) bool { return t.g[p].listed }, listed, len(t.g))
}

// checkPage checks GPU page p (being drained if drain) against the recount: its
// readers, releases and writer, its index entry, whether it is listed, the copy
// reading it and its twin.
func (c *checker) checkPage(p uint32, g *gpage, drain bool) {
	t := c.t
	if int(g.readers) != c.readers[p] || int(g.releasing) != c.releases[p] {
		c.bad("page %d (%s) has %d readers and %d releasing, its leases %d and %d", p, g.state, g.readers, g.releasing, c.readers[p], c.releases[p])
	}
	switch g.state {
	case Writing, Sealing, Settling:
		if c.writer[p] == 0 || g.lease != c.writer[p] {
			c.bad("page %d is %s under lease %d, the leases say %d", p, g.state, g.lease, c.writer[p])
		}
	default:
		if c.writer[p] != 0 {
			c.bad("page %d is %s, and lease %d writes it", p, g.state, c.writer[p])
		}
	}
	if g.state == Sealed {
		if q, ok := t.index[g.hash]; !ok || q != p {
			c.bad("sealed page %d is not indexed under its hash", p)
		}
	}
	want := g.state == Sealed && g.readers == 0 && g.releasing == 0 && !drain
	if want != g.listed {
		c.bad("page %d (%s, %d readers, %d releasing) listed %v", p, g.state, g.readers, g.releasing, g.listed)
	}
	if g.copy != 0 && (t.copies[g.copy] == nil || t.copies[g.copy].kind != Spill || !slices.Contains(t.copies[g.copy].gpu, p)) {
		c.bad("page %d is read by copy %d, which does not read it", p, g.copy)
	}
	if g.twin != none {
		if g.state != Sealed || int(g.twin) >= len(t.h) || t.h[g.twin].gpu != p {
			c.bad("page %d (%s) twins host page %d, which twins %d", p, g.state, g.twin, t.h[min(int(g.twin), len(t.h)-1)].gpu)
		}
	}
}

// checkHost checks each host page against the recount, then the table's host
// counts, index, free stack and list.
func (c *checker) checkHost() {
	t := c.t
	var hcount [nHostStates]int
	twins, pinned, hlisted := 0, 0, 0
	for i := range t.h {
		p, h := uint32(i), &t.h[i]
		hcount[h.state]++
		if int(h.pins) != c.pins[p] {
			c.bad("host page %d has %d pins, %d restores read it", p, h.pins, c.pins[p])
		}
		if h.pins > 0 {
			pinned++
		}
		if h.state == HostSealed {
			if q, ok := t.hindex[h.hash]; !ok || q != p {
				c.bad("sealed host page %d is not indexed under its hash", p)
			}
			if h.gpu != none {
				twins++
			}
		}
		if h.gpu != none && (h.state == HostFree || t.g[h.gpu].twin != p) {
			c.bad("host page %d twins page %d, whose twin is %d", p, h.gpu, t.g[h.gpu].twin)
		}
		if h.state == HostFilling && t.copies[h.copy] == nil {
			c.bad("host page %d fills under copy %d, not in flight", p, h.copy)
		}
		want := h.state == HostSealed && h.gpu == none && h.pins == 0
		if want != h.listed {
			c.bad("host page %d listed %v", p, h.listed)
		}
		if h.listed {
			hlisted++
		}
	}
	if hcount != t.hcount || twins != t.twins || pinned != t.pinned {
		c.bad("host counts %v twins %d pinned %d; recounted %v %d %d", t.hcount, t.twins, t.pinned, hcount, twins, pinned)
	}
	if len(t.hindex) != hcount[HostSealed] {
		c.bad("%d hashes indexed on the host, %d host pages sealed", len(t.hindex), hcount[HostSealed])
	}
	checkStack(c.bad, "host", t.hfree, func(p uint32) bool { return t.h[p].state == HostFree }, hcount[HostFree], len(t.h))
	c.checkList("host", &t.hlru, t.hlinks, func(p uint32) bool { return t.h[p].listed }, hlisted, len(t.h))
}

// checkList walks list l head to tail (at most pages+1 steps) and checks that each
// page on it is listed and links back to the one before, and that it holds the
// listed pages, as many as it books.
func (c *checker) checkList(what string, l *list, links func(uint32) (prev, next *uint32), isListed func(uint32) bool, listed, pages int) {
	n, prev := 0, none
	for p := l.head; p != none && n <= pages; {
		back, next := links(p)
		if !isListed(p) || *back != prev {
			c.bad("%s list broken at page %d", what, p)
			break
		}
		prev, p = p, *next
		n++
	}
	if n != listed || n != l.n || prev != l.tail {
		c.bad("%s list holds %d pages, %d listed, booked %d", what, n, listed, l.n)
	}
}

// checkHolders checks the stranded leases and each holder's leases and pages
// against the recount.
func (c *checker) checkHolders() {
	t := c.t
	if c.stranded != t.nstranded {
		c.bad("%d stranded leases, booked %d", c.stranded, t.nstranded)
	}
	for h, hd := range t.holders {
		if len(hd.leases) != c.holderLeases[h] || hd.pages != c.holderPages[h] {
			c.bad("holder %v booked %d leases of %d pages, holds %d of %d", h, len(hd.leases), hd.pages, c.holderLeases[h], c.holderPages[h])
		}
	}
	if len(t.holders) != len(c.holderLeases) {
		c.bad("%d holders booked, %d hold leases", len(t.holders), len(c.holderLeases))
	}
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
