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
	"sync"

	"github.com/dustin/go-humanize"

	"github.com/cudapool/cudapool/cudart"
	"github.com/cudapool/cudapool/kv"
	"github.com/cudapool/cudapool/kv/owner"
)

// The growth row of the kv rows (issue 30: "growth by one chunk visible in every
// replica at most 1 ms after the owner maps it"):
//
//	kv/grow   us from the owner having mapped a chunk of a growth of the slab
//	          (cuMemSetAccess returned in the owner) until every one of
//	          kvGrowWatchers idle replica processes (no call in flight: their
//	          connection's watcher maps what arrives) has it mapped
//	          (replica.Mapped); one sample a chunk
//
// The slab is the kv rows' geometry and size, on an owner of its own that starts with
// one step mapped (owner.WithInitialPages(1)) and grows a step at a time (2*Layers
// chunks, one a tensor, each passed to the replicas as soon as the owner has mapped
// it): a writer process holds every free page under write leases and then allocates
// one page more, which makes the owner grow before its reply. It grows to its bound,
// in each of kvGrowRounds(sh) rounds (a fresh owner and fresh processes each). The
// owner is this process's and has no keeper (kvpoold's adds one keeper round trip a
// chunk, before the owner passes it on).
//
// The clocks: the owner's instant is taken in this process, by the Runtime it is given
// (growClock wraps the device's: CLOCK_MONOTONIC as each cuMemSetAccess returns), and
// each watcher's in its own process, CLOCK_MONOTONIC as it sees Mapped() pass each
// chunk (it spins on Mapped, yielding, from before the growth until the step is
// mapped; two chunks seen in one look both get its time, the later one's).
// CLOCK_MONOTONIC is one clock for every process of the host on Linux, so the two
// instants are compared directly, with no round trip and no share of one guessed; the
// spin's resolution (one Mapped call, well under a microsecond) is the figure's. A
// "# kv grow" line gives the p50 of a whole step, from the owner's mapping of its
// first chunk to every watcher having its last.
const kvGrowWatchers = 3

// kvGrowRounds is how many owners the row grows to their bound.
func kvGrowRounds(sh shape) int { return sh.rounds }

// growClock is a Runtime whose VMM notes when each MemSetAccess returned (the owner's
// mapping of a chunk is whole then) and how many have: the owner's side of kv/grow.
type growClock struct {
	cudart.Runtime
	cudart.VMM
	mu    sync.Mutex
	times []int64 // CLOCK_MONOTONIC, ns, as each MemSetAccess returned
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
	now := monotonic()
	c.mu.Lock()
	c.times = append(c.times, now)
	c.mu.Unlock()
	return err
}

// mapped is how many MemSetAccess calls have returned, and their times from the
// first'th on.
func (c *growClock) mapped(first int) (int, []int64) {
	c.mu.Lock()
	defer c.mu.Unlock()
	if first > len(c.times) {
		first = len(c.times)
	}
	return len(c.times), slices.Clone(c.times[first:])
}

// growSample is one growth: for each chunk, the slowest watcher's mapping of it after
// the owner's, and the whole step, from the owner's mapping of its first chunk to the
// slowest watcher's of its last, in us.
type growSample struct {
	chunks []float64
	step   float64
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
	var chunks, step []float64
	for _, s := range samples {
		chunks = append(chunks, s.chunks...)
		step = append(step, s.step)
	}
	fmt.Fprintf(r.w, "# pct cudapool %s us p50 %.2f p99 %.2f\n", op, percentile(chunks, 0.5), percentile(chunks, 0.99))
	fmt.Fprintf(r.w, "# kv grow: a step is %d chunks of %s; a whole step, from the owner's mapping of its first chunk to every replica's of its last, p50 %.1f us (%d growths)\n",
		layout.Regions(), humanize.IBytes(layout.ChunkBytes()), percentile(step, 0.5), len(samples))
	r.result("cudapool", op, "us", chunks)
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
		calls, _ := clock.mapped(0)
		if _, err := writer.ask("grow", "grew"); err != nil {
			return nil, l, fmt.Errorf("the writer: %w", err)
		}
		_, owner := clock.mapped(calls)
		if now := o.Stats().Devices[0].Chunks; now != target || len(owner) != l.Regions() {
			return nil, l, fmt.Errorf("the writer's Alloc grew the slab from %d to %d chunks with %d mappings, want %d and %d", chunks, now, len(owner), target, l.Regions())
		}
		s := growSample{chunks: make([]float64, len(owner))}
		for _, c := range watchers {
			at, err := c.grownAt(len(owner))
			if err != nil {
				return nil, l, err
			}
			for i, t := range at {
				if t < owner[i] {
					return nil, l, fmt.Errorf("watcher %d mapped the step's chunk %d at %d ns, the owner at %d: CLOCK_MONOTONIC is not one clock here", c.pid, i, t, owner[i])
				}
				s.chunks[i] = max(s.chunks[i], float64(t-owner[i])/1e3)
			}
			s.step = max(s.step, float64(at[len(at)-1]-owner[0])/1e3)
		}
		samples = append(samples, s)
		if _, err := writer.ask("fill", "filled"); err != nil {
			return nil, l, fmt.Errorf("the writer: %w", err)
		}
	}
	return samples, l, nil
}

// grownAt asks a watcher for the times it saw each of the n chunks of the growth
// mapped (CLOCK_MONOTONIC, ns).
func (c *consumerSide) grownAt(n int) ([]int64, error) {
	rest, err := c.awaitAfter("grown", "grown")
	if err != nil {
		return nil, err
	}
	f := strings.Fields(rest)
	if len(f) != n {
		return nil, fmt.Errorf("watcher %d said %d times, want one for each of %d chunks", c.pid, len(f), n)
	}
	at := make([]int64, n)
	for i, x := range f {
		if at[i], err = strconv.ParseInt(x, 10, 64); err != nil {
			return nil, fmt.Errorf("watcher %d said %q: %w", c.pid, rest, err)
		}
	}
	return at, nil
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
	done chan struct{}
	at   []int64 // CLOCK_MONOTONIC ns: Mapped() past each chunk after those it had when armed
	err  error
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
	w := &growWatch{done: make(chan struct{}), at: make([]int64, 0, target-before)}
	k.watch = w
	running := make(chan struct{})
	go func() {
		defer close(w.done)
		close(running)
		deadline := monotonic() + opTimeout.Nanoseconds()
		for {
			n, _ := k.r.Mapped()
			now := monotonic()
			for before+len(w.at) < min(n, target) {
				w.at = append(w.at, now)
			}
			if n >= target {
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

// grown waits for the armed spin's end: "grown NS..." (each chunk's time).
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
	var b strings.Builder
	b.WriteString("grown")
	for _, t := range w.at {
		fmt.Fprintf(&b, " %d", t)
	}
	return b.String(), nil
}
