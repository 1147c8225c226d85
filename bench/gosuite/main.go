// Command gosuite is the cudapool column of the benchmark suite (issue 6): the
// operations bench/cref times in C, done through cudapool's packages (pool,
// export) with the consumer in other processes, so that scripts/bench-suite.sh can
// print each as a ratio to C, the legacy IPC path and cuda.core taken in one run.
//
// Every measurement prints
//
//	result IMPL OP UNIT MEDIAN P90 N
//	raw IMPL OP UNIT V1 V2 ...
//
// or "fail IMPL OP REASON" when it could not be taken; the others still run. IMPL is
// cudapool (the pool and export packages) or cudart (the binding's own pair, beside
// it for the allocation variants). Times are in microseconds from CLOCK_MONOTONIC,
// which every process of the host shares, so a consumer's timestamp can be compared
// with the producer's.
//
// Usage:
//
//	gosuite [-runtime auto|gpu|test] [-lock] [-label L] [-quick] all|alloc
//
// "alloc" runs only the allocate+free pairs; -lock runs them with the measuring
// goroutine locked to its OS thread, and -label names them variant/L/... (the
// script runs them under several GOMAXPROCS and CPU pinnings). -quick takes few
// samples, for a dry run on the software device.
package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"os"
	"runtime"
	"slices"
	"strings"
	"time"

	"golang.org/x/sys/unix"

	"github.com/cudapool/cudapool/cudart"
	"github.com/cudapool/cudapool/internal/rtselect"
	"github.com/cudapool/cudapool/pool"
)

// The shapes of the measurements, the same as bench/cref's.
type shape struct {
	batches    int // timed batches of the allocation pairs, after one untimed
	syncEvery  int // pairs per batch
	samples    int // timed operations of a per-operation measurement
	warmup     int // untimed operations before them
	fanoutReps int
	ring       int // buffers "already exported" cycles through
	rounds     int // windows of the sustained rate
	window     time.Duration
	copies     int
	readSize   uint64
}

var fullShape = shape{batches: 15, syncEvery: 10000, samples: 200, warmup: 20, fanoutReps: 50, ring: 64,
	rounds: 5, window: 300 * time.Millisecond, copies: 20, readSize: 1 << 30}

var quickShape = shape{batches: 3, syncEvery: 100, samples: 10, warmup: 2, fanoutReps: 3, ring: 4,
	rounds: 2, window: 50 * time.Millisecond, copies: 2, readSize: 8 << 20}

// shareSize is the size of every shared buffer: cudapool rounds buffers of an
// exportable pool to the 2 MiB granularity, and cref and cuda.core share 2 MiB too.
const shareSize = 2 << 20

// opTimeout bounds every wait for a consumer: a hang guard, never a measurement.
const opTimeout = 60 * time.Second

var fanouts = []int{1, 2, 4, 7}

const sustainConsumers = 4

func main() {
	if len(os.Args) > 1 && os.Args[1] == consumerRole {
		os.Exit(consumerMain(os.Args[2:]))
	}
	prefer := flag.String("runtime", rtselect.Auto, "auto, gpu or test (the software device)")
	lock := flag.Bool("lock", false, "lock the measuring goroutine to its OS thread")
	label := flag.String("label", "", "name the allocation pairs variant/LABEL/...")
	quick := flag.Bool("quick", false, "few samples: a dry run")
	flag.Parse()
	mode := flag.Arg(0)
	if flag.NArg() != 1 || (mode != "all" && mode != "alloc") {
		fmt.Fprintln(os.Stderr, "usage: gosuite [-runtime auto|gpu|test] [-lock] [-label L] [-quick] all|alloc")
		os.Exit(2)
	}
	if *lock {
		runtime.LockOSThread()
	}
	rt, _, why, err := rtselect.Open(*prefer)
	if err != nil {
		fmt.Fprintln(os.Stderr, "gosuite:", err)
		os.Exit(1)
	}
	fmt.Printf("# gosuite: %s; GOMAXPROCS=%d, locked=%v\n", why, runtime.GOMAXPROCS(0), *lock)
	sh := fullShape
	if *quick {
		sh = quickShape
	}
	r := &reporter{w: os.Stdout}
	if *label != "" {
		r.prefix = "variant/" + *label + "/"
	}
	allocPairs(r, rt, sh)
	if mode == "all" {
		kind := rtselect.GPU
		if *prefer == rtselect.Test || !strings.HasPrefix(rt.Name(), "libcudart") {
			kind = rtselect.Test
		}
		sharing(r, rt, kind, sh)
	}
	if err := rtselect.Err(rt); err != nil {
		fmt.Fprintln(os.Stderr, "gosuite: the software device saw rule violations:", err)
		r.failed = true
	}
	if r.failed {
		os.Exit(1)
	}
}

// reporter prints measurements in the suite's format.
type reporter struct {
	w      io.Writer
	prefix string
	failed bool
}

// result prints the median and 90th percentile of v (sorted in place) and v itself.
func (r *reporter) result(impl, op, unit string, v []float64) {
	if len(v) == 0 {
		r.fail(impl, op, errors.New("no samples"))
		return
	}
	slices.Sort(v)
	p90 := v[int(0.9*float64(len(v)-1)+0.5)]
	fmt.Fprintf(r.w, "result %s %s%s %s %.4f %.4f %d\n", impl, r.prefix, op, unit, v[len(v)/2], p90, len(v))
	var raw strings.Builder
	fmt.Fprintf(&raw, "raw %s %s%s %s", impl, r.prefix, op, unit)
	for _, x := range v {
		fmt.Fprintf(&raw, " %.4f", x)
	}
	fmt.Fprintln(r.w, raw.String())
}

func (r *reporter) fail(impl, op string, err error) {
	r.failed = true
	fmt.Fprintf(r.w, "fail %s %s%s %s\n", impl, r.prefix, op, strings.ReplaceAll(err.Error(), "\n", " "))
}

// measure reports what f measured, or its failure.
func (r *reporter) measure(impl, op, unit string, f func() ([]float64, error)) {
	v, err := f()
	if err != nil {
		r.fail(impl, op, err)
		return
	}
	r.result(impl, op, unit, v)
}

func micros(d time.Duration) float64 { return float64(d.Nanoseconds()) / 1e3 }

// monotonic is CLOCK_MONOTONIC in nanoseconds: the clock bench/cref and cuda.core's
// time.monotonic_ns read, the same in every process of the host.
func monotonic() int64 {
	var ts unix.Timespec
	if err := unix.ClockGettime(unix.CLOCK_MONOTONIC, &ts); err != nil {
		panic(err) // CLOCK_MONOTONIC exists on every Linux
	}
	return ts.Nano()
}

var allocSizes = []struct {
	name  string
	bytes uint64
}{{"1KiB", 1 << 10}, {"1MiB", 1 << 20}, {"64MiB", 64 << 20}}

// allocPairs times allocate+free pairs as bench/cref does: on a fresh pool that
// reserved its memory once, one untimed batch, then sh.batches batches of
// sh.syncEvery pairs, each closed by a synchronize; a sample is a batch's time per
// pair. Through pool.Pool (cudapool) and through the binding alone (cudart).
func allocPairs(r *reporter, rt cudart.Runtime, sh shape) {
	ctx := context.Background()
	for _, size := range allocSizes {
		op := "alloc/" + size.name
		r.measure("cudapool", op, "us", func() ([]float64, error) {
			p, s, done, err := freshPool(rt, pool.WithHandleType(cudart.HandleTypePosixFD))
			if err != nil {
				return nil, err
			}
			defer done()
			return pairBatches(rt, s, sh, func() error {
				b, err := p.Alloc(ctx, size.bytes, s)
				if err != nil {
					return err
				}
				return p.Free(b, s)
			})
		})
		r.measure("cudart", op, "us", func() ([]float64, error) {
			p, s, done, err := freshPool(rt, pool.WithHandleType(cudart.HandleTypePosixFD))
			if err != nil {
				return nil, err
			}
			defer done()
			h := p.Handle()
			return pairBatches(rt, s, sh, func() error {
				ptr, err := rt.MallocFromPoolAsync(0, size.bytes, h, s)
				if err != nil {
					return err
				}
				return rt.FreeAsync(0, ptr, s)
			})
		})
	}
}

// freshPool is a new pool on device 0 and a stream; done destroys both.
func freshPool(rt cudart.Runtime, opts ...pool.Option) (*pool.Pool, cudart.Stream, func(), error) {
	s, err := rt.StreamCreate(0, cudart.StreamNonBlocking)
	if err != nil {
		return nil, 0, nil, err
	}
	p, err := pool.New(rt, 0, opts...)
	if err != nil {
		rt.StreamDestroy(0, s)
		return nil, 0, nil, err
	}
	return p, s, func() {
		rt.StreamSynchronize(0, s)
		p.Close(context.Background(), pool.Force())
		rt.StreamDestroy(0, s)
	}, nil
}

func pairBatches(rt cudart.Runtime, s cudart.Stream, sh shape, pair func() error) ([]float64, error) {
	// The pool reserves its memory once, untimed, as in cref.
	if err := pair(); err != nil {
		return nil, err
	}
	if err := rt.StreamSynchronize(0, s); err != nil {
		return nil, err
	}
	var perPair []float64
	for b := -1; b < sh.batches; b++ {
		start := time.Now()
		for range sh.syncEvery {
			if err := pair(); err != nil {
				return nil, err
			}
		}
		if err := rt.StreamSynchronize(0, s); err != nil {
			return nil, err
		}
		if b >= 0 {
			perPair = append(perPair, micros(time.Since(start))/float64(sh.syncEvery))
		}
	}
	return perPair, nil
}
