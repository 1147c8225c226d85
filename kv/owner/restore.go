package owner

import (
	"fmt"

	"github.com/cudapool/cudapool/kv"
	"github.com/cudapool/cudapool/kv/internal/kvwire"
)

// inHostLocked says whether h is in the host tier of c's device and not visible in its
// slab, under o.mu.
func (c *conn) inHostLocked(h kv.Hash) bool {
	t := c.s.tier
	if t == nil {
		return false
	}
	_, ok := t.index[h]
	return ok
}

// matchRestore answers a Match whose run goes on in the host tier: the run is the
// hashes visible in the slab or held by the host tier, from the first, until one is in
// neither. It takes GPU pages for the host tier's (evicting as alloc does, pages
// evicted without a host copy copied out first; if the slab has no room the run ends
// before the first), copies them back in one batch on the tier's stream, waits for
// the copy on the host, publishes them in the slab's index
// (their host pages stay, as their twins) and leases the whole run: the reply names
// GPU pages only, readable once it has come. If the copy fails, the run ends before
// the first restored page and the error is logged. It takes no page before the
// reattach window has ended, as Alloc does (awaitResumed).
func (c *conn) matchRestore(h kvwire.Header, hashes []kv.Hash) error {
	o, s := c.o, c.s
	t := s.tier
	if !o.awaitResumed() {
		return c.refuse(h.ID, fmt.Errorf("%w: the owner is closing", kv.ErrClosed))
	}
	c.lock()
	type step struct {
		gpu  uint32 // the page, or for a restore the page it goes to
		host uint32 // none: visible in the slab already
	}
	run := make([]step, 0, len(hashes))
	restores := 0
	for _, hh := range hashes {
		if p, ok := s.index[hh]; ok {
			run = append(run, step{gpu: p, host: none})
			s.pages[p].readers++ // held, so that taking pages below does not evict it
			continue
		}
		hp, ok := t.index[hh]
		if !ok {
			break
		}
		run = append(run, step{host: hp})
		t.pages[hp].pins++
		restores++
	}
	dsts, ok, evicted := o.takeLocked(s, restores)
	if !ok {
		dsts, restores = nil, 0
	}
	cut := len(run)
	k := 0
	for i := range run {
		if run[i].host == none {
			continue
		}
		if !ok {
			cut = min(cut, i)
			t.pages[run[i].host].pins--
			continue
		}
		run[i].gpu = dsts[k]
		k++
	}
	for i := cut; i < len(run); i++ {
		if run[i].host == none {
			s.pages[run[i].gpu].readers--
		}
	}
	run = run[:cut]
	c.unlock()

	gpu, host := make([]uint32, 0, restores), make([]uint32, 0, restores)
	for _, st := range run {
		if st.host != none {
			gpu, host = append(gpu, st.gpu), append(host, st.host)
		}
	}
	// The pages taken are copied out first where they held pages the host tier has
	// no copy of, then the restore, in one stream order.
	err := o.copyEvicted(s, evicted, o.tierPieces(t, gpu, host, true))
	c.lock()
	if err != nil {
		o.log.Error("kv: restoring pages from the host tier failed; the match ends before them", "device", s.dev, "err", err)
	} else {
		t.stats.Restores += uint64(len(gpu))
		t.stats.RestoreBytes += uint64(len(gpu)) * t.pageBytes
	}
	firstHost := len(run)
	for i, st := range run {
		if st.host != none {
			firstHost = i
			break
		}
	}
	pages := make([]uint32, 0, len(run))
	for i, st := range run {
		if st.host == none {
			s.pages[st.gpu].readers-- // leaseRunLocked takes the reader back
			if err == nil || i < firstHost {
				pages = append(pages, st.gpu)
			}
			continue
		}
		t.pages[st.host].pins--
		switch p, dup := s.index[hashes[i]]; {
		case err != nil:
			s.release(st.gpu)
		case dup: // sealed here meanwhile
			s.release(st.gpu)
			pages = append(pages, p)
		default:
			parent := noLink
			if len(pages) > 0 {
				parent = s.linkOf(pages[len(pages)-1])
			}
			s.publish(st.gpu, hashes[i], parent)
			if hp := &t.pages[st.host]; hp.state == hostSealed && hp.hash == hashes[i] {
				t.link(st.gpu, st.host)
				t.touch(st.host)
			}
			pages = append(pages, st.gpu)
		}
	}
	return c.answerMatchLocked(h.ID, hashes, pages)
}
