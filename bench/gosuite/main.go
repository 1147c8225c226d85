// Command gosuite is the cudapool column of the benchmark suite (issues 6 and 13):
// the operations bench/cref times in C, done through cudapool's packages (pool,
// export) with the consumers in other processes, so that scripts/bench-suite.sh can
// print each beside C, the legacy IPC path and cuda.core taken in one run.
//
// Every measurement prints
//
//	result IMPL OP UNIT MEDIAN P90 N
//	raw IMPL OP UNIT V1 V2 ...
//
// or "fail IMPL OP REASON" when it could not be taken, or "needs IMPL OP GPUS" where
// the host has too few GPUs for it (unless CUDAPOOL_REQUIRE_GPUS demands them); the
// others still run.
// IMPL is cudapool (the pool and export packages) or cudart (the bare binding).
// Times are in microseconds from CLOCK_MONOTONIC, which every process of the host
// shares, so a consumer's timestamp can be compared with the producer's.
//
// Usage:
//
//	gosuite [-runtime auto|gpu|test] [-quick] [-validate] all
//	gosuite [-runtime ...] -plan PLAN -ring IN,OUT [-ready FIFO] [-round R] [-batches B] [-pairs N] alloc
//	gosuite [-runtime ...] granularity
//	gosuite [-runtime ...] [-quick] [-kv-bytes SIZE] kv
//	gosuite [-runtime ...] [-quick] kv-restart
//
// "kv" runs the KV page pool's rows (kv.go), "kv-restart" its restart row (kvrestart.go). "all" runs the sharing operations and the import pair. "alloc" runs the allocation
// pairs as one participant of the ring that scripts/bench-suite.sh starts (see
// alloc.go). "granularity" prints the bytes an exportable pool allocates for one
// byte asked, which the script puts in the plan. -quick takes few samples, for a dry
// run on the software device; -validate makes the consumers check every byte they
// are given.
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
	"strconv"
	"strings"
	"time"

	"github.com/dustin/go-humanize"
	"golang.org/x/sys/unix"

	"github.com/cudapool/cudapool/cudart"
	"github.com/cudapool/cudapool/cudart/choose"
	_ "github.com/cudapool/cudapool/cudart/choose/softdevice" // the software device, for -runtime test and where there is no GPU
	"github.com/cudapool/cudapool/pool"
)

// The shapes of the measurements, the same as bench/cref's.
type shape struct {
	batches       int // timed batches of the import pairs, after one untimed
	importBuffers int // buffers a batch of import pairs imports
	samples       int // timed operations of a per-operation measurement
	warmup        int // untimed operations before them
	fanoutReps    int
	ring          int // buffers "already exported" cycles through
	rounds        int // windows of the sustained rate
	window        time.Duration
	copies        int
	readSize      uint64
	slabSize      uint64 // the slab of the block rows, cut in blocks of blockSize
}

var fullShape = shape{batches: 15, importBuffers: importBuffers, samples: 200, warmup: 20, fanoutReps: 50,
	ring: 64, rounds: 5, window: 300 * time.Millisecond, copies: 20, readSize: 1 << 30, slabSize: 1 << 30}

var quickShape = shape{batches: 3, importBuffers: 8, samples: 10, warmup: 2, fanoutReps: 3, ring: 4,
	rounds: 2, window: 50 * time.Millisecond, copies: 2, readSize: 8 << 20, slabSize: 8 << 20}

// shareSize is the size of every shared buffer: cudapool rounds buffers of an
// exportable pool to the 2 MiB granularity, and cref and cuda.core share 2 MiB too.
const shareSize = 2 << 20

// opTimeout bounds every wait for a consumer: a hang guard, never a measurement.
const opTimeout = 60 * time.Second

var fanouts = []int{1, 2, 4, 7}

const sustainConsumers = 4

func main() {
	playRole()
	os.Exit(run())
}

// playRole runs this process as the consumer or the exporter it was started as, and
// exits; it returns when the process was started as neither.
func playRole() {
	if len(os.Args) > 1 {
		switch os.Args[1] {
		case consumerRole:
			os.Exit(consumerMain(os.Args[2:]))
		case exporterRole:
			os.Exit(exporterMain(os.Args[2:]))
		case kvReplicaRole:
			os.Exit(kvReplicaMain(os.Args[2:]))
		case kvKeeperRole:
			os.Exit(kvKeeperMain(os.Args[2:]))
		case kvOwnerRole:
			os.Exit(kvOwnerMain(os.Args[2:]))
		case kvRestartRole:
			os.Exit(kvRestartMain(os.Args[2:]))
		}
	}
}

func run() int {
	prefer := flag.String("runtime", choose.Auto, "auto, gpu or test (the software device)")
	quick := flag.Bool("quick", false, "few samples: a dry run")
	validate := flag.Bool("validate", false, "consumers check every byte they are given")
	planText := flag.String("plan", "", "alloc: the plan, KIND/SIZE=BYTES ...")
	ringText := flag.String("ring", "", "alloc: the ring's named pipes, IN,OUT")
	ready := flag.String("ready", "", "alloc: the named pipe to say ready on")
	round := flag.Int("round", 0, "alloc: the round's number, for the sample lines")
	batches := flag.Int("batches", 15, "alloc: measured batches per plan entry and slot")
	pairs := flag.Int("pairs", 10000, "alloc: pairs per batch")
	kvBytes := flag.String("kv-bytes", humanize.IBytes(defaultKVSlab), "kv: the slab's size, e.g. 100GiB")
	flag.Parse()
	mode := flag.Arg(0)
	usage := func(why string) int {
		fmt.Fprintln(os.Stderr, "gosuite:", why)
		fmt.Fprintln(os.Stderr, "usage: gosuite [-runtime auto|gpu|test] [-quick] [-validate] all\n"+
			"       gosuite [-runtime ...] -plan PLAN -ring IN,OUT [-ready FIFO] [-round R] [-batches B] [-pairs N] alloc\n"+
			"       gosuite [-runtime ...] granularity\n"+
			"       gosuite [-runtime ...] [-quick] [-kv-bytes SIZE] kv|kvtier|kv-restart   (kvtier: the host tier's rows; kv-restart: the page server's restart)")
		return 2
	}
	if flag.NArg() != 1 {
		return usage("want one mode")
	}
	var plan []planEntry
	var rg ring
	slab, err := humanize.ParseBytes(*kvBytes)
	if err != nil || slab == 0 {
		return usage(fmt.Sprintf("-kv-bytes %q: want a size such as 100GiB", *kvBytes))
	}
	switch mode {
	case "all", "granularity", "kv", "kvtier", "kv-restart":
	case "alloc":
		var err error
		if plan, err = parsePlan(*planText); err != nil {
			return usage(err.Error())
		}
		in, out, ok := strings.Cut(*ringText, ",")
		if !ok || *batches < 1 || *pairs < 1 {
			return usage("alloc needs -ring IN,OUT and positive -batches and -pairs")
		}
		if rg, err = openRing(in, out); err != nil {
			fmt.Fprintln(os.Stderr, "gosuite:", err)
			return 1
		}
	default:
		return usage(fmt.Sprintf("unknown mode %q", mode))
	}
	picked, err := choose.Runtime(*prefer)
	rt, why := picked.Runtime, picked.Why
	if err != nil {
		fmt.Fprintln(os.Stderr, "gosuite:", err)
		return 1
	}
	r := &reporter{w: os.Stdout}
	switch mode {
	case "granularity":
		g, err := granularityOf(rt)
		if err != nil {
			fmt.Fprintln(os.Stderr, "gosuite:", err)
			return 1
		}
		fmt.Println(g)
		return 0
	case "alloc":
		fmt.Printf("# gosuite alloc round %d: %s; GOMAXPROCS=%d\n", *round, why, runtime.GOMAXPROCS(0))
		// The device's context, before saying ready, as cref and cudacore.py make theirs.
		if _, _, err := rt.MemGetInfo(0); err != nil {
			fmt.Fprintln(os.Stderr, "gosuite:", err)
			return 1
		}
		if *ready != "" {
			if err := sayReady(*ready); err != nil {
				fmt.Fprintln(os.Stderr, "gosuite:", err)
				return 1
			}
		}
		if err := allocRing(r, rt, plan, rg, *round, *batches, *pairs); err != nil {
			r.fail("cudapool", "alloc", err)
		}
	case "all":
		fmt.Printf("# gosuite: %s; GOMAXPROCS=%d\n", why, runtime.GOMAXPROCS(0))
		sh := fullShape
		if *quick {
			sh = quickShape
		}
		kind := choose.GPU
		if *prefer == choose.Software || !strings.HasPrefix(rt.Name(), "libcudart") {
			kind = choose.Software
		}
		r.measure("cudart", "import/pair", "us", func() ([]float64, error) { return importPairs(rt, kind, sh) })
		sharing(r, rt, kind, sh, *validate)
	case "kv", "kvtier", "kv-restart":
		fmt.Printf("# gosuite %s: %s; GOMAXPROCS=%d\n", mode, why, runtime.GOMAXPROCS(0))
		sh := fullShape
		if *quick {
			sh = quickShape
		}
		switch mode {
		case "kv":
			kvRows(r, rt, picked.OnGPU, sh, slab)
		case "kvtier":
			kvTierRows(r, rt, picked.OnGPU, sh)
		default:
			kvRestartRow(r, picked.OnGPU, sh)
		}
	}
	if err := choose.Violations(rt); err != nil {
		fmt.Fprintln(os.Stderr, "gosuite: the software device saw rule violations:", err)
		r.failed = true
	}
	if r.failed {
		return 1
	}
	return 0
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

// needs reports that op needs gpus GPUs where the host has n: not run, or a failure
// where CUDAPOOL_REQUIRE_GPUS demands them.
func (r *reporter) needs(impl, op string, gpus, n int) {
	if demanded, err := strconv.Atoi(os.Getenv("CUDAPOOL_REQUIRE_GPUS")); err == nil && demanded >= gpus {
		r.fail(impl, op, fmt.Errorf("%d GPU(s) here; CUDAPOOL_REQUIRE_GPUS=%d demands %d", n, demanded, gpus))
		return
	}
	fmt.Fprintf(r.w, "needs %s %s%s %d\n", impl, r.prefix, op, gpus)
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

// freshPool is a new pool on device 0 and a stream; done destroys both.
func freshPool(rt cudart.Runtime, opts ...pool.Option) (*pool.Pool, cudart.Stream, func(), error) {
	s, err := rt.StreamCreate(0, cudart.StreamNonBlocking)
	if err != nil {
		return nil, 0, nil, err
	}
	p, err := pool.New(rt, 0, opts...)
	if err != nil {
		_ = rt.StreamDestroy(0, s) // cleanup: nothing is left to undo if it fails
		return nil, 0, nil, err
	}
	return p, s, func() {
		_ = rt.StreamSynchronize(0, s)                     // cleanup: the measurement is over
		_, _ = p.Close(context.Background(), pool.Force()) // cleanup: nothing is left to do if closing fails
		_ = rt.StreamDestroy(0, s)                         // cleanup: nothing is left to undo if it fails
	}, nil
}
