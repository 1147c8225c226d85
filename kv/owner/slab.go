package owner

import (
	"context"
	"fmt"
	"sync"

	"github.com/cudapool/cudapool/cudart"
	"github.com/cudapool/cudapool/kv"
	"github.com/cudapool/cudapool/kv/internal/index"
	"github.com/cudapool/cudapool/kv/internal/pages"
	"github.com/cudapool/cudapool/kv/internal/slabmap"
)

// slab is one device's chunks, mapped (kv/internal/slabmap), and its page table
// (kv/internal/pages: the pages of both tiers, the LRU, the hash index, the leases).
// Everything but the fields set at Listen and those grow guards is guarded by the
// Owner's mu.
type slab struct {
	dev    int
	id     uint64             // made with its first chunk: a restart over the keeper's keeps it
	name   string             // the slab's name (kvwire.SlabName)
	m      *slabmap.Map       // the chunks, mapped in this process
	bases  []cudart.DevicePtr // the regions' addresses: m.Bases()
	ix     *index.Index       // the index file; nil: none
	stream cudart.Stream      // the owner's stream on dev: set-up and copies out of this slab
	copyMu sync.Mutex         // one copy at a time queued on stream
	done   cudart.Event       // recorded on stream after a copy (or at Close), asked until it completes

	tab    *pages.Table
	copied uint64    // pages a match copied in from another device's slab (DeviceStats.Copied)
	tier   *hostTier // the device's host tier's memory and copies (hosttier.go), nil without one
	// copies are the table's copies in flight, each closed once done (CopyDone).
	copies map[pages.CopyID]chan struct{}
	// space is closed (and replaced) whenever pages may have become free or
	// evictable: the Allocs that wait for settling pages look again.
	space chan struct{}

	// grow serializes the slab's growths and its replicas' welcomes, so that every
	// replica connection gets every chunk once, in order, before any reply that
	// grants a page in it (growth.go). It is held across the writes of Grow frames,
	// each bounded by the connection's write timeout.
	grow sync.Mutex
	// fds are the chunks' descriptors, in index order: what a replica imports, and
	// what the keeper holds. Guarded by grow; their count by mu too (chunks).
	fds []int
	// chunks is len(fds), read under mu (stats).
	chunks int
	// reached are the replica connections welcomed, which each growth reaches.
	// Guarded by grow.
	reached map[*conn]struct{}
	// gb is the give-back of its memory (giveback.go).
	gb giveBack
}

// spaceLocked wakes the Allocs that wait for pages to settle.
func (s *slab) spaceLocked() {
	close(s.space)
	s.space = make(chan struct{})
}

func newSlab(dev int) *slab {
	return &slab{dev: dev, space: make(chan struct{}), copies: map[pages.CopyID]chan struct{}{}, reached: map[*conn]struct{}{}}
}

// effectsLocked does what an operation of s's table returned that takes no syscall,
// under o.mu: it queues its records in the index, in order, and books its copies, so
// that a later operation that waits for one finds it. It returns the index's sequence
// number the caller waits for (outside o.mu) before it answers or starts a copy (0:
// none), and wakes the Allocs that wait for space and the spiller where pages may
// have become free or visible.
func (o *Owner) effectsLocked(s *slab, fx pages.Effects) uint64 {
	var seq uint64
	for _, r := range fx.Records {
		switch r.Kind {
		case pages.RecSeal:
			seq = s.ix.Seal(s.dev, r.Page, r.Hash)
			if s.tier != nil {
				s.tier.wake()
			}
		case pages.RecFree:
			seq = s.ix.Free(s.dev, r.Page)
		case pages.RecHostSeal:
			seq = s.ix.HostSeal(s.dev, r.Page, r.Hash)
		case pages.RecHostFree:
			seq = s.ix.HostFree(s.dev, r.Page)
		case pages.RecLeased:
			seq = s.ix.Grant(grantOf(s.dev, r))
		case pages.RecEnd:
			seq = s.ix.End(uint64(r.Lease))
			s.spaceLocked()
		}
	}
	for _, c := range fx.Copies {
		s.copies[c.ID] = make(chan struct{})
	}
	switch {
	case len(fx.Copies) > 0: // a copy starts after every record before it
		return s.ix.Queued()
	case fx.Wait == 0:
		return 0
	}
	return seq
}

// grantOf is lease record r of device dev's table as the index journals it.
func grantOf(dev int, r pages.Record) *index.Grant {
	return &index.Grant{Lease: uint64(r.Lease), Dev: dev, Holder: index.Proc(r.Holder), Pages: r.Pages, Read: !r.Write, Hashes: r.Hashes}
}

// awaitCopies waits until the copies ids have completed (CopyDone), or ctx ends.
func (o *Owner) awaitCopies(ctx context.Context, s *slab, ids []pages.CopyID) error {
	for _, id := range ids {
		o.mu.Lock()
		ch := s.copies[id]
		o.mu.Unlock()
		if ch == nil {
			continue // done already
		}
		select {
		case <-ch:
		case <-ctx.Done():
			return fmt.Errorf("%w: a copy into the host tier has not completed", kv.ErrClosed)
		}
	}
	return nil
}

// stats is s's stats: its table's counts, and what only the owner counts.
func (s *slab) stats() kv.DeviceStats {
	st := kv.DeviceStats{Device: s.dev, Copied: s.copied}
	if s.m != nil {
		st.Chunks, st.MappedBytes = s.chunks, s.m.Layout().MappedBytes(s.chunks)
	}
	if s.tier != nil {
		st.Host = s.tier.statsLocked()
	}
	if s.tab != nil {
		s.tab.Fill(&st)
	}
	return st
}
