package owner

import (
	"context"
	"fmt"
	"sync/atomic"
	"time"

	"github.com/cudapool/cudapool/cudart"
	"github.com/cudapool/cudapool/kv/internal/pages"
)

// The give-back of memory ([WithMinFree]): while a device's free memory
// (MemGetInfo) is below the bound, the owner gives the last steps of its slab back.
// One goroutine looks at every device each giveBackTick (no spinning). A give-back
// bounds the slab's growth at the steps it keeps (an Alloc evicts instead), shrinks
// the page table past them (pages.Table.Shrink: its unleased pages evicted, copied
// to the host tier where it has room), drains it each tick until no lease holds a
// page past them and no copy reads one (Table.Drain; a lease is never taken: the
// give-back waits for its release or its holder's death), ends the shrink
// (Table.Shrunk), waits for the index to have every record of it, and unmaps the
// chunks (unmapChunks: every replica is sent a Shrink frame, the keeper drops them).
// The bound on growth is lifted once the free memory is a step above the bound
// again. The slab keeps at least one step.
//
// The replicas do not acknowledge the Shrink frame: a chunk's memory goes back to
// the driver once every replica has read the frame (or exited), so the next tick may
// still see it in use; the tick after a give-back only looks.

// giveBackTick is how often the give-back looks at the devices' free memory.
const giveBackTick = 100 * time.Millisecond

// WithMinFree makes the owner give the last chunks of a device's slab back while the
// device's free memory is below n bytes (0, the default: never), as the package
// comment of giveback.go says: the pages in them are evicted (copied to the host
// tier where it has room) or, where leased, waited for, and every replica unmaps them.
func WithMinFree(n uint64) Option { return func(o *options) { o.MinFree = n } }

// freeMemory reads device dev's free memory: MemGetInfo; tests replace it.
var freeMemory atomic.Pointer[func(rt cudart.Runtime, dev int) (uint64, error)]

func init() {
	f := func(rt cudart.Runtime, dev int) (uint64, error) {
		free, _, err := rt.MemGetInfo(dev)
		return free, err
	}
	freeMemory.Store(&f)
}

// giveBack is one slab's give-back state.
type giveBack struct {
	// ceiling is the most chunks a growth maps while memory is short (0: no bound).
	// Guarded by the slab's grow.
	ceiling int
	// keep is the chunks a give-back in progress keeps (0: none), and rest says the
	// last tick ended one. The give-back's goroutine's alone.
	keep int
	rest bool
	// ticks counts the give-back's looks at the slab (tests).
	ticks atomic.Uint64
}

// startGiveBack starts the give-back's goroutine, with WithMinFree, once the tables
// are made; it ends when the owner stops (o.stopped), and teardown waits for it.
func (o *Owner) startGiveBack() {
	if o.opts.MinFree == 0 {
		return
	}
	o.waiters.Add(1)
	go func() {
		defer o.waiters.Done()
		tk := time.NewTicker(giveBackTick)
		defer tk.Stop()
		for {
			select {
			case <-o.stopped.Done():
				return
			case <-tk.C:
			}
			for _, s := range o.slabs {
				if err := o.giveBackStep(o.stopped, s); err != nil && o.stopped.Err() == nil {
					o.log.Warn("kv: giving the slab's memory back", "device", s.dev, "err", err)
				}
				s.gb.ticks.Add(1)
			}
		}
	}()
}

// mayGrowTo is how many chunks a growth of s may map, of want: fewer while memory is
// short. s.grow is held.
func (s *slab) mayGrowTo(want int) int {
	if s.gb.ceiling > 0 {
		return min(want, max(s.gb.ceiling, len(s.fds)))
	}
	return want
}

// giveBackStep is one tick of s's give-back: it goes on with the one in progress,
// or starts one where the device's free memory is below the bound.
func (o *Owner) giveBackStep(ctx context.Context, s *slab) error {
	if s.tab == nil {
		return nil
	}
	if s.gb.keep > 0 {
		return o.drainStep(ctx, s)
	}
	if s.gb.rest { // the replicas may not have unmapped the last give-back yet
		s.gb.rest = false
		return nil
	}
	free, err := (*freeMemory.Load())(o.rt, s.dev)
	if err != nil {
		return fmt.Errorf("kv/owner: the free memory of device %d: %w", s.dev, err)
	}
	step := o.layout.Regions()
	stepBytes := uint64(step) * o.layout.ChunkBytes()
	s.grow.Lock()
	n := len(s.fds)
	switch {
	case free >= o.opts.MinFree+stepBytes || free >= o.opts.MinFree && s.gb.ceiling == 0:
		s.gb.ceiling = 0
		s.grow.Unlock()
		return nil
	case free >= o.opts.MinFree:
		s.grow.Unlock()
		return nil // short no more: growth stays bounded until a step is free
	}
	short := o.opts.MinFree - free
	keep := max(step, n-int((short+stepBytes-1)/stepBytes)*step)
	s.gb.ceiling = keep
	s.grow.Unlock()
	if keep >= n {
		return nil // one step left: nothing to give back
	}
	o.mu.Lock()
	var fx pages.Effects
	if to, _ := s.tab.Shrinking(); to > o.layout.MappedPages(keep) {
		fx, err = s.tab.Shrink(o.layout.MappedPages(keep))
	}
	after := o.effectsLocked(s, fx)
	o.mu.Unlock()
	if err != nil {
		return fmt.Errorf("kv/owner: shrinking the table of device %d to %d chunks: %w", s.dev, keep, err)
	}
	o.log.Info("kv: device memory short; giving the slab's last chunks back", "device", s.dev,
		"free", free, "min_free", o.opts.MinFree, "chunks", n, "keep", keep)
	s.gb.keep = keep
	o.runCopies(ctx, s, fx.Copies, after)
	return o.drainStep(ctx, s)
}

// drainStep evicts the pages given back that have come free, and once none is in
// use ends the shrink, waits for the index and unmaps the chunks past s.gb.keep.
func (o *Owner) drainStep(ctx context.Context, s *slab) error {
	keep := s.gb.keep
	o.mu.Lock()
	var fx pages.Effects
	left := 0
	if _, shrinking := s.tab.Shrinking(); shrinking {
		fx, left = s.tab.Drain()
		if left == 0 {
			_, _, err := s.tab.Shrunk()
			if err != nil {
				o.mu.Unlock()
				return fmt.Errorf("kv/owner: ending the shrink of device %d: %w", s.dev, err)
			}
		}
	}
	after := o.effectsLocked(s, fx)
	seq := s.ix.Queued()
	o.mu.Unlock()
	o.runCopies(ctx, s, fx.Copies, after)
	if left > 0 {
		return nil // leases or copies still hold pages past the chunks kept
	}
	// No restart may find a seal in the chunks once they are gone.
	if err := o.journaled(ctx, seq); err != nil {
		return err
	}
	s.gb.keep, s.gb.rest = 0, true
	if err := o.unmapChunks(s, keep); err != nil {
		return err
	}
	o.log.Info("kv: the slab's last chunks are given back", "device", s.dev, "chunks", keep)
	return nil
}

// runCopies makes copies of s's table (a give-back's evictions into the host tier),
// each once the index has every record up to after; a copy that fails is logged: its
// pages are gone from the host tier.
func (o *Owner) runCopies(ctx context.Context, s *slab, copies []pages.Copy, after uint64) {
	for _, cp := range copies {
		if _, _, err := o.runCopy(ctx, s, cp, after); err != nil && ctx.Err() == nil {
			o.log.Error("kv: copying pages given back to the host tier failed; they are gone", "device", s.dev, "err", err)
		}
	}
}
