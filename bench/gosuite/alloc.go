package main

import (
	"context"
	"errors"
	"fmt"
	"os"
	"slices"
	"strconv"
	"strings"
	"time"

	"golang.org/x/sys/unix"

	"github.com/cudapool/cudapool/cudart"
	"github.com/cudapool/cudapool/pool"
)

// The allocation pairs run as one participant of a ring of processes that take turns,
// one batch each, pinned by scripts/bench-suite.sh to the same CPU: bench/cref (C),
// this program and bench/cudacore.py. The host's CPUs switch between a fast and a slow
// state from batch to batch (docs/FACTS.md, "Timing noise"), so only batches taken
// next to each other on the same CPU compare like with like; the ring makes each Go
// batch a neighbour of a C batch of the same operation, and bench/table.py gives each
// Go batch the state of its C neighbour.
//
// Every participant runs the same plan (the -plan flag, made by the script): for each
// entry, for each slot (api, then binding), one untimed warm-up batch and then
// measured batches. A turn is one batch; the token that passes the turn carries the
// turn's number, which each sample line records:
//
//	sample IMPL SLOT OP ROUND BATCH TURN US
//	bytes IMPL OP BYTES
//
// A participant with nothing to run in a slot still takes and passes its turns.

// planEntry is one allocation measurement: asked bytes from a pool of a kind, and the
// bytes every column must allocate for them (cudapool rounds an exportable pool's
// buffers up to the granularity; C and cuda.core are asked for the rounded size).
//
// The kinds: ipc, an exportable pool (POSIX fd); local, a pool of handle type none;
// hit, an exportable pool whose cache (pool.WithCache) serves every Alloc after the
// first (issue 11's hit path); miss, an exportable pool with its cache on but too
// small for any buffer, so that every Alloc goes to the driver past the cache (the
// miss path). C and cuda.core have no cache: for hit and miss they run their plain
// pair on an exportable pool, the pair issue 11 compares with.
type planEntry struct {
	kind  string // ipc, local, hit or miss
	asked uint64
	bytes uint64
	op    string // alloc/KIND/SIZE
}

var planKinds = []string{"ipc", "local", "hit", "miss"}

// allocSlots are the layers each plan entry is measured at, in this order.
var allocSlots = []string{"api", "binding"}

// parsePlan reads "KIND/SIZE=BYTES ..." (SIZE as 1KiB, 1MiB, 64MiB, or plain bytes).
func parsePlan(s string) ([]planEntry, error) {
	var plan []planEntry
	for _, f := range strings.Fields(s) {
		name, bytesText, ok := strings.Cut(f, "=")
		kind, size, ok2 := strings.Cut(name, "/")
		if !ok || !ok2 || !slices.Contains(planKinds, kind) {
			return nil, fmt.Errorf("plan entry %q: want KIND/SIZE=BYTES with KIND one of %v", f, planKinds)
		}
		asked, err := parseSize(size)
		if err != nil {
			return nil, fmt.Errorf("plan entry %q: %w", f, err)
		}
		bytes, err := strconv.ParseUint(bytesText, 10, 64)
		if err != nil || bytes < asked {
			return nil, fmt.Errorf("plan entry %q: bytes must be a number at least the size asked", f)
		}
		plan = append(plan, planEntry{kind: kind, asked: asked, bytes: bytes, op: "alloc/" + name})
	}
	if len(plan) == 0 {
		return nil, errors.New("empty plan")
	}
	return plan, nil
}

func parseSize(s string) (uint64, error) {
	for _, u := range []struct {
		suffix string
		shift  uint
	}{{"GiB", 30}, {"MiB", 20}, {"KiB", 10}, {"B", 0}} {
		if n, ok := strings.CutSuffix(s, u.suffix); ok {
			v, err := strconv.ParseUint(n, 10, 64)
			if err != nil || v == 0 {
				return 0, fmt.Errorf("size %q", s)
			}
			return v << u.shift, nil
		}
	}
	return 0, fmt.Errorf("size %q: want a number with KiB, MiB, GiB or B", s)
}

// turnTimeout bounds the wait for the token: a participant that died or runs another
// plan must fail the run, not hang it.
const turnTimeout = 60 * time.Second

// ring is this participant's place in the turn ring: it reads the token from in and
// passes it on to out, and gives up when no token comes within timeout.
type ring struct {
	in, out *os.File
	timeout time.Duration
}

// take waits for the token and returns the turn's number.
func (r ring) take() (int, error) {
	fds := []unix.PollFd{{Fd: int32(r.in.Fd()), Events: unix.POLLIN}}
	deadline := time.Now().Add(r.timeout)
	for {
		n, err := unix.Poll(fds, int(time.Until(deadline).Milliseconds()))
		if errors.Is(err, unix.EINTR) {
			continue
		}
		if err != nil {
			return 0, fmt.Errorf("waiting for the turn: %w", err)
		}
		if n == 0 {
			return 0, fmt.Errorf("no turn came for %v: another participant died or runs another plan", r.timeout)
		}
		break
	}
	// The token is one short write, so one read takes it whole (PIPE_BUF).
	buf := make([]byte, 32)
	n, err := r.in.Read(buf)
	if err != nil {
		return 0, fmt.Errorf("reading the turn: %w", err)
	}
	turn, err := strconv.Atoi(strings.TrimSpace(string(buf[:n])))
	if err != nil {
		return 0, fmt.Errorf("bad turn token %q", buf[:n])
	}
	return turn, nil
}

func (r ring) pass(turn int) error {
	_, err := fmt.Fprintf(r.out, "%d\n", turn+1)
	return err
}

// openRing opens the ring's two named pipes.
func openRing(in, out string) (ring, error) {
	// O_RDWR never blocks on a FIFO (Linux), whatever order the participants open in.
	fin, err := os.OpenFile(in, os.O_RDWR, 0)
	if err != nil {
		return ring{}, err
	}
	fout, err := os.OpenFile(out, os.O_RDWR, 0)
	if err != nil {
		_ = fin.Close() // cleanup: nothing is left to do if closing fails
		return ring{}, err
	}
	return ring{in: fin, out: fout, timeout: turnTimeout}, nil
}

// sayReady tells the script, through the named pipe at path, that this process is
// ready to take its first turn: the script starts the ring only when every participant
// is, so that no start-up runs beside a measured batch.
func sayReady(path string) error {
	f, err := os.OpenFile(path, os.O_RDWR, 0)
	if err != nil {
		return err
	}
	defer func() { _ = f.Close() }() // cleanup: nothing is left to do if closing fails
	_, err = fmt.Fprintf(f, "ready gosuite %d\n", os.Getpid())
	return err
}

// poolOptions are the options of a plan entry's pool.
func (e planEntry) poolOptions() []pool.Option {
	switch e.kind {
	case "local":
		return []pool.Option{pool.WithHandleType(cudart.HandleTypeNone)}
	case "hit":
		return []pool.Option{pool.WithHandleType(cudart.HandleTypePosixFD), pool.WithCache(2 * e.bytes)}
	case "miss":
		return []pool.Option{pool.WithHandleType(cudart.HandleTypePosixFD), pool.WithCache(1)}
	}
	return []pool.Option{pool.WithHandleType(cudart.HandleTypePosixFD)}
}

// cached reports whether the entry measures the pool's cache: its binding slot would
// only repeat the ipc entry's, and is passed.
func (e planEntry) cached() bool { return e.kind == "hit" || e.kind == "miss" }

// allocRing runs the plan's allocation pairs as one participant of the ring: the
// pool's pair (cudapool, api slot) and the binding's own pair on the pool's handle
// (cudart, binding slot).
func allocRing(r *reporter, rt cudart.Runtime, plan []planEntry, rg ring, round, batches, pairs int) error {
	ctx := context.Background()
	for _, e := range plan {
		for _, slot := range allocSlots {
			impl := map[string]string{"api": "cudapool", "binding": "cudart"}[slot]
			if slot == "binding" && e.cached() {
				if err := passTurns(rg, batches+1); err != nil {
					return err
				}
				continue
			}
			opts := e.poolOptions()
			var p *pool.Pool
			var s cudart.Stream
			done := func() {}
			pair := func() error { return nil }
			for b := -1; b < batches; b++ {
				turn, err := rg.take()
				if err != nil {
					return err
				}
				if b == -1 {
					// Set up inside the first turn: nothing of it runs beside another's batch.
					if p, s, done, err = freshPool(rt, opts...); err != nil {
						return fmt.Errorf("%s %s: %w", impl, e.op, err)
					}
					if pair, err = allocPair(ctx, r, rt, p, s, e, impl); err != nil {
						done()
						return fmt.Errorf("%s %s: %w", impl, e.op, err)
					}
				}
				start := monotonic()
				for range pairs {
					if err = pair(); err != nil {
						break
					}
				}
				if err == nil {
					err = rt.StreamSynchronize(0, s)
				}
				us := float64(monotonic()-start) / 1e3 / float64(pairs)
				if b == batches-1 && err == nil && slot == "api" {
					err = checkCache(p, e, (batches+1)*pairs+1)
				}
				if b == batches-1 || err != nil {
					done()
				}
				if err != nil {
					return fmt.Errorf("%s %s: %w", impl, e.op, err)
				}
				if b >= 0 {
					fmt.Fprintf(r.w, "sample %s %s %s %d %d %d %.4f\n", impl, slot, e.op, round, b, turn, us)
				}
				if err := rg.pass(turn); err != nil {
					return err
				}
			}
		}
	}
	return nil
}

// passTurns takes and passes n turns without work.
func passTurns(rg ring, n int) error {
	for range n {
		turn, err := rg.take()
		if err != nil {
			return err
		}
		if err := rg.pass(turn); err != nil {
			return err
		}
	}
	return nil
}

// checkCache makes sure that the pool's cache did what the entry's kind measures, in
// the n Allocs made: hit, every Alloc after the first served by the cache; miss,
// every one past it to the driver; without a cache, no cache counts at all.
func checkCache(p *pool.Pool, e planEntry, n int) error {
	st, err := p.Stats()
	if err != nil {
		return err
	}
	hits, misses := int(st.CacheHits), int(st.CacheMisses)
	ok := map[string]bool{
		"hit":  hits == n-1 && misses == 1,
		"miss": hits == 0 && misses == n,
	}
	if want, measured := ok[e.kind]; measured && !want || !measured && hits+misses != 0 {
		return fmt.Errorf("%s: %d of %d Allocs were cache hits and %d misses: the pairs did not take the path measured", e.op, hits, n, misses)
	}
	return nil
}

// allocPair checks, once, that the pool allocates e.bytes for e.asked (says so in a
// bytes line) and returns the pair a batch repeats.
func allocPair(ctx context.Context, r *reporter, rt cudart.Runtime, p *pool.Pool, s cudart.Stream, e planEntry, impl string) (func() error, error) {
	b, err := p.Alloc(ctx, e.asked, s)
	if err != nil {
		return nil, err
	}
	reserved := b.Reserved()
	if err := p.Free(b, s); err != nil {
		return nil, err
	}
	if err := rt.StreamSynchronize(0, s); err != nil {
		return nil, err
	}
	if reserved != e.bytes {
		return nil, fmt.Errorf("the pool allocates %d bytes for %d asked, the plan says %d: the columns would not allocate the same bytes", reserved, e.asked, e.bytes)
	}
	fmt.Fprintf(r.w, "bytes %s %s %d\n", impl, e.op, reserved)
	if impl == "cudapool" {
		return func() error {
			b, err := p.Alloc(ctx, e.asked, s)
			if err != nil {
				return err
			}
			return p.Free(b, s)
		}, nil
	}
	h := p.Handle()
	return func() error {
		ptr, err := rt.MallocFromPoolAsync(0, e.bytes, h, s)
		if err != nil {
			return err
		}
		return rt.FreeAsync(0, ptr, s)
	}, nil
}

// granularityOf prints the bytes an exportable pool allocates for 1 byte asked: the
// plan's rounding, for the script.
func granularityOf(rt cudart.Runtime) (uint64, error) {
	p, err := pool.New(rt, 0, pool.WithHandleType(cudart.HandleTypePosixFD))
	if err != nil {
		return 0, err
	}
	defer func() { _, _ = p.Close(context.Background(), pool.Force()) }() // cleanup: nothing is left to do if closing fails
	return p.Granularity(), nil
}
