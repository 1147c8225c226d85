package main

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"runtime"
	"slices"
	"strconv"
	"strings"
	"sync/atomic"

	"github.com/dustin/go-humanize"

	"github.com/cudapool/cudapool/cudart"
	"github.com/cudapool/cudapool/kv"
	"github.com/cudapool/cudapool/kv/owner"
)

// The growth row of the kv rows (issue 30: "growth by one chunk visible in every
// replica at most 1 ms after the owner maps it"):
//
//	kv/grow   us from the owner having mapped a growth of the slab (the last chunk of
//	          the step it maps: cuMemSetAccess returned in the owner) until every one
//	          of kvGrowWatchers idle replica processes (no call in flight: their
//	          connection's watcher maps what arrives) has the whole step mapped
//	          (replica.Mapped); one sample a growth
//
// The slab is the kv rows' geometry and size, on an owner of its own that starts with
// one step mapped (owner.WithInitialPages(1)) and grows a step at a time (2*Layers
// chunks, one a tensor: the owner never grows by less, so the row's figure is a whole
// step's, 32 chunks for llama-0.85b, which is stricter than one chunk's): a writer
// process holds every free page under write leases and then allocates one page more,
// which makes the owner grow before its reply. It grows to its bound, a sample a step,
// in each of kvGrowRounds(sh) rounds (a fresh owner and fresh processes each). The
// owner is this process's and has no keeper (kvpoold's adds one keeper round trip, the
// step's last chunk's, to the interval).
//
// The clocks: the owner's instant is taken in this process, by the Runtime it is given
// (growClock wraps the device's: CLOCK_MONOTONIC as each cuMemSetAccess returns), and
// each watcher's in its own process, CLOCK_MONOTONIC as it sees Mapped() reach the
// step (it spins on Mapped, yielding, from before the growth until then). CLOCK_MONOTONIC
// is one clock for every process of the host on Linux, so the two instants are
// compared directly, with no round trip and no share of one guessed; the spin's
// resolution (one Mapped call, well under a microsecond) is the figure's. A "# kv grow"
// line gives the p50 of the first chunk of a step mapped in every watcher, on the same
// clocks, and the watchers' time a chunk within a step.
const kvGrowWatchers = 3

// kvGrowRounds is how many owners the row grows to their bound.
func kvGrowRounds(sh shape) int { return sh.rounds }

// growClock is a Runtime whose VMM notes when each MemSetAccess returned (the owner's
// mapping of a chunk is whole then) and how many have: the owner's side of kv/grow.
type growClock struct {
	cudart.Runtime
	cudart.VMM
	last  atomic.Int64 // CLOCK_MONOTONIC, ns
	calls atomic.Int64
}

// newGrowClock wraps rt, which must have a VMM (cudart.VMMOf).
func newGrowClock(rt cudart.Runtime) (*growClock, error) {
	v, err := cudart.VMMOf(rt)
	if err != nil {
		return nil, err
	}
	return &growClock{Runtime: rt, VMM: v}, nil
}

func (c *growClock) MemSetAccess(dev int, ptr cudart.DevicePtr, size uint64, descs []cudart.AccessDesc) error {
	err := c.VMM.MemSetAccess(dev, ptr, size, descs)
	c.last.Store(monotonic())
	c.calls.Add(1)
	return err
}

// growSample is one growth: each watcher's first chunk and whole step, after the
// owner's mapping, in us.
type growSample struct {
	step, first []float64 // one a watcher
}

// kvGrowRow measures kv/grow on slabs of geometry g (Pages its bound), replica
// processes of kind, and prints its meta, "#" and result lines; a round that fails
// fails the row, naming the round.
func kvGrowRow(r *reporter, rt cudart.Runtime, kind string, sh shape, g kv.Geometry) {
	const op = "kv/grow"
	clock, err := newGrowClock(rt)
	if err != nil {
		r.fail("cudapool", op, err)
		return
	}
	var samples []growSample
	var layout kv.SlabLayout
	for round := range kvGrowRounds(sh) {
		s, l, err := growRound(clock, kind, g)
		if err != nil {
			r.fail("cudapool", op, fmt.Errorf("round %d: %w", round, err))
			return
		}
		samples, layout = append(samples, s...), l
	}
	fmt.Fprintf(r.w, "meta kv-grow %s slab (%v) from one step of %d chunks (%s) to its %d, on device 0, mapped by %d idle replica processes\n",
		humanize.IBytes(g.SlabBytes()), layout, layout.Regions(), humanize.IBytes(layout.MappedBytes(layout.Regions())), layout.Chunks(), kvGrowWatchers)
	var step, first, perChunk []float64
	for _, s := range samples {
		step = append(step, slices.Max(s.step))
		first = append(first, slices.Max(s.first))
		for i := range s.step {
			if n := layout.Regions() - 1; n > 0 {
				perChunk = append(perChunk, (s.step[i]-s.first[i])/float64(n))
			}
		}
	}
	fmt.Fprintf(r.w, "# pct cudapool %s us p50 %.2f p99 %.2f\n", op, percentile(step, 0.5), percentile(step, 0.99))
	fmt.Fprintf(r.w, "# kv grow: a step is %d chunks of %s; its first chunk mapped in every replica p50 %.1f us after the owner mapped the step, a chunk after it p50 %.1f us in a replica (%d growths)\n",
		layout.Regions(), humanize.IBytes(layout.ChunkBytes()), percentile(first, 0.5), percentile(perChunk, 0.5), len(samples))
	r.result("cudapool", op, "us", step)
}

// growRound grows a fresh owner's slab of g from one step to its bound, a step a
// sample, with kvGrowWatchers watchers and a writer, and returns the samples and the
// slab's layout. Either way the processes it started have been told to quit and waited
// for, and the owner closed; on failure the error is the first one met.
func growRound(clock *growClock, kind string, g kv.Geometry) (_ []growSample, _ kv.SlabLayout, err error) {
	dir, err := os.MkdirTemp("", "gosuite-kvgrow")
	if err != nil {
		return nil, kv.SlabLayout{}, err
	}
	defer func() { _ = os.RemoveAll(dir) }() // best effort: a leftover file is harmless, and the first error is the one returned
	quiet := slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: slog.LevelError}))
	o, err := owner.Listen(dir, clock, g, owner.WithLogger(quiet), owner.WithInitialPages(1))
	if err != nil {
		return nil, kv.SlabLayout{}, err
	}
	l := o.Layout()
	var procs []*consumerSide
	defer func() {
		for _, c := range procs {
			if qerr := c.quit(); qerr != nil && err == nil {
				err = qerr
			}
		}
		ctx, cancel := context.WithTimeout(context.Background(), opTimeout)
		defer cancel()
		if cerr := o.Close(ctx); cerr != nil && err == nil {
			err = cerr
		}
	}()
	if l.Steps() < 2 {
		return nil, l, fmt.Errorf("the slab (%v) is one step: it cannot grow", l)
	}
	for range kvGrowWatchers + 1 {
		c, err := startRole(kvReplicaRole, kind, dir)
		if err != nil {
			return nil, l, err
		}
		procs = append(procs, c)
	}
	writer, watchers := procs[0], procs[1:]
	if _, err := writer.ask("fill", "filled"); err != nil {
		return nil, l, fmt.Errorf("the writer: %w", err)
	}
	var samples []growSample
	for chunks := o.Stats().Devices[0].Chunks; chunks < l.Chunks(); chunks = o.Stats().Devices[0].Chunks {
		target := chunks + l.Regions()
		for _, c := range watchers {
			if _, err := c.ask("arm "+strconv.Itoa(target), "armed"); err != nil {
				return nil, l, err
			}
		}
		calls := clock.calls.Load()
		if _, err := writer.ask("grow", "grew"); err != nil {
			return nil, l, fmt.Errorf("the writer: %w", err)
		}
		mapped, owned := clock.last.Load(), clock.calls.Load()-calls
		if now := o.Stats().Devices[0].Chunks; now != target || owned != int64(l.Regions()) {
			return nil, l, fmt.Errorf("the writer's Alloc grew the slab from %d to %d chunks with %d mappings, want %d and %d", chunks, now, owned, target, l.Regions())
		}
		var s growSample
		for _, c := range watchers {
			rest, err := c.awaitAfter("grown", "grown")
			if err != nil {
				return nil, l, err
			}
			f := strings.Fields(rest)
			if len(f) != 2 {
				return nil, l, fmt.Errorf("watcher %d said %q, want FIRST-NS ALL-NS", c.pid, rest)
			}
			at := [2]int64{}
			for i, x := range f {
				if at[i], err = strconv.ParseInt(x, 10, 64); err != nil {
					return nil, l, fmt.Errorf("watcher %d said %q: %w", c.pid, rest, err)
				}
			}
			if at[0] < mapped || at[1] < at[0] {
				return nil, l, fmt.Errorf("watcher %d mapped the step's first chunk at %d ns and its last at %d, the owner mapped it at %d: CLOCK_MONOTONIC is not one clock here", c.pid, at[0], at[1], mapped)
			}
			s.first = append(s.first, float64(at[0]-mapped)/1e3)
			s.step = append(s.step, float64(at[1]-mapped)/1e3)
		}
		samples = append(samples, s)
		if _, err := writer.ask("fill", "filled"); err != nil {
			return nil, l, fmt.Errorf("the writer: %w", err)
		}
	}
	return samples, l, nil
}

// awaitAfter says cmd and returns the rest of the reply that starts with want.
func (c *consumerSide) awaitAfter(cmd, want string) (string, error) {
	if err := c.say(cmd); err != nil {
		return "", err
	}
	return c.awaitLine(want + " ")
}

// growWatch is a watcher's spin over Mapped for one growth (kvLoad.arm).
type growWatch struct {
	done  chan struct{}
	first int64 // CLOCK_MONOTONIC ns: Mapped() past the chunks it had when armed
	all   int64 // Mapped() at the target
	err   error
}

// fill takes every free page of the slab under write leases, held until the replica
// closes, so that the next Alloc makes the owner grow.
func (k *kvLoad) fill(ctx context.Context) error {
	for {
		st, err := k.r.Stats(ctx)
		if err != nil {
			return err
		}
		if len(st.Devices) == 0 {
			return errors.New("the owner's stats list no device")
		}
		free := st.Devices[0].Free
		if free == 0 {
			return nil
		}
		if _, err := k.r.Alloc(ctx, min(free, kv.MaxBatch)); err != nil {
			return err
		}
	}
}

// growOne allocates one page where the slab has none free: the owner grows a step
// before it answers.
func (k *kvLoad) growOne(ctx context.Context) error {
	before, _ := k.r.Mapped()
	if _, err := k.r.Alloc(ctx, 1); err != nil {
		return err
	}
	if after, _ := k.r.Mapped(); after <= before {
		return fmt.Errorf("an Alloc with no page free left the slab at %d chunks", after)
	}
	return nil
}

// arm starts a spin over Mapped until target chunks are mapped, noting when the
// first chunk past those mapped now and the target were seen; it returns once the
// spin runs.
func (k *kvLoad) arm(target int) error {
	before, _ := k.r.Mapped()
	if before >= target {
		return fmt.Errorf("%d chunks mapped already, the target is %d", before, target)
	}
	w := &growWatch{done: make(chan struct{})}
	k.watch = w
	running := make(chan struct{})
	go func() {
		defer close(w.done)
		close(running)
		deadline := monotonic() + opTimeout.Nanoseconds()
		for {
			n, _ := k.r.Mapped()
			now := monotonic()
			if n > before && w.first == 0 {
				w.first = now
			}
			if n >= target {
				w.all = now
				return
			}
			if now > deadline {
				w.err = fmt.Errorf("%d chunks mapped after %v, want %d", n, opTimeout, target)
				return
			}
			runtime.Gosched()
		}
	}()
	<-running
	return nil
}

// grown waits for the armed spin's end: "grown FIRST-NS ALL-NS".
func (k *kvLoad) grown() (string, error) {
	w := k.watch
	if w == nil {
		return "", errors.New("grown before arm")
	}
	k.watch = nil
	<-w.done // the spin ends by its deadline at the latest
	if w.err != nil {
		return "", w.err
	}
	return fmt.Sprintf("grown %d %d", w.first, w.all), nil
}
