package producer

import (
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"runtime"
	"strconv"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/cudapool/cudapool/cudart"
	"github.com/cudapool/cudapool/cudart/cudarttest"
	"github.com/cudapool/cudapool/export/consumer"
	"github.com/cudapool/cudapool/internal/proctest"
	"github.com/cudapool/cudapool/pool"
)

// BenchmarkRoundTrips times the consumer's round trips with the exporter, a process
// each, on immediate software devices (no worker to wait for, so what is left is the
// protocol: messages, wakes, locks, allocations): an Open of a buffer exported before,
// a Release, both, and OpenAll plus ReleaseAll of 64 blocks. Besides ns/op the
// consumer reports its allocations and its runtime calls per op (on the GPU each call
// costs 0.5-2 µs).
func BenchmarkRoundTrips(b *testing.B) {
	for _, verb := range []string{"open", "release", "openrelease", "batch64"} {
		b.Run(verb, func(b *testing.B) {
			rt := cudarttest.New(cudarttest.WithImmediate())
			b.Cleanup(func() { rt.Close() })
			s, err := rt.StreamCreate(0, cudart.StreamNonBlocking)
			require.NoError(b, err)
			p, err := pool.New(rt, 0)
			require.NoError(b, err)
			path := filepath.Join(shortDir(b), "r.sock")
			ex, err := Listen(path, rt, WithoutAnnounce(), WithLogger(discardLogger))
			require.NoError(b, err)
			const ring = 64
			ctx := testCtx(b)
			for i := range ring {
				buf, err := p.Alloc(ctx, 1<<20, s)
				require.NoError(b, err)
				require.NoError(b, ex.Publish(ctx, fmt.Sprint("r", i), buf, s))
			}
			kid := proctest.Start(b, "roundtrip-consumer", path)
			b.Cleanup(func() {
				kid.Finish()
				require.NoError(b, ex.Close(context.Background()))
				p.Close(context.Background(), pool.Force())
			})
			ask := func(n int) []string {
				kid.Send(fmt.Sprintf("%s r %d %d", verb, ring, n))
				f := strings.Fields(kid.Next())
				require.Len(b, f, 6, "consumer answered %q", f)
				return f
			}
			ask(ring) // warm: pool handle, ready event, first imports
			b.ResetTimer()
			f := ask(b.N)
			b.StopTimer()
			ns, _ := strconv.ParseFloat(f[1], 64)
			allocs, _ := strconv.ParseFloat(f[3], 64)
			calls, _ := strconv.ParseFloat(f[5], 64)
			b.ReportMetric(ns/float64(b.N), "ns/op")
			b.ReportMetric(allocs/float64(b.N), "consumer-allocs/op")
			b.ReportMetric(calls/float64(b.N), "consumer-calls/op")
		})
	}
}

// roleRoundTripConsumer: roundtrip-consumer SOCKET, then commands on stdin, each
// answered with "ns T allocs A calls C" for the timed part:
//
//	open NAME COUNT N         N times: Open NAME<i%COUNT> (timed), Release
//	release NAME COUNT N      N times: Open, Release (timed)
//	openrelease NAME COUNT N  N times: Open and Release (timed)
//	batch64 NAME COUNT N      N/64 times: OpenAll of 64 names, ReleaseAll (timed)
func roleRoundTripConsumer(args []string) int {
	fail := func(err error) int { fmt.Fprintln(os.Stderr, "roundtrip-consumer:", err); return 1 }
	if len(args) != 1 {
		return fail(errors.New("want SOCKET"))
	}
	d := cudarttest.New(cudarttest.WithImmediate())
	defer d.Close()
	rt := &countingRuntime{Runtime: d}
	ctx := context.Background()
	s, err := rt.StreamCreate(0, cudart.StreamNonBlocking)
	if err != nil {
		return fail(err)
	}
	imp, err := consumer.Dial(ctx, args[0], rt, 0)
	if err != nil {
		return fail(err)
	}
	defer imp.Close(ctx)
	for line := range proctest.Commands() {
		f := strings.Fields(line)
		if len(f) != 4 {
			return fail(fmt.Errorf("bad command %q", line))
		}
		count, _ := strconv.Atoi(f[2])
		n, _ := strconv.Atoi(f[3])
		var spent time.Duration
		var ms runtime.MemStats
		runtime.ReadMemStats(&ms)
		allocs := ms.Mallocs
		calls := rt.calls.Load()
		timed := func(do func() error) error {
			start := time.Now()
			err := do()
			spent += time.Since(start)
			return err
		}
		for i := 0; i < n && err == nil; i++ {
			name := fmt.Sprint(f[1], i%count)
			var m *consumer.Mapping
			switch f[0] {
			case "open":
				err = timed(func() (err error) { m, err = imp.Open(ctx, name, s); return err })
				if err == nil {
					err = m.Release(ctx, s)
				}
			case "release":
				if m, err = imp.Open(ctx, name, s); err == nil {
					err = timed(func() error { return m.Release(ctx, s) })
				}
			case "openrelease":
				err = timed(func() error {
					m, err := imp.Open(ctx, name, s)
					if err == nil {
						err = m.Release(ctx, s)
					}
					return err
				})
			case "batch64":
				names := make([]string, 64)
				for j := range names {
					names[j] = fmt.Sprint(f[1], (i+j)%count)
				}
				i += len(names) - 1
				err = timed(func() error {
					ms, err := imp.OpenAll(ctx, names, s)
					if err == nil {
						err = imp.ReleaseAll(ctx, ms, s)
					}
					return err
				})
			default:
				err = fmt.Errorf("unknown command %q", line)
			}
		}
		if err != nil {
			return fail(err)
		}
		runtime.ReadMemStats(&ms)
		fmt.Println("ns", spent.Nanoseconds(), "allocs", ms.Mallocs-allocs, "calls", rt.calls.Load()-calls)
	}
	return 0
}

// countingRuntime counts the runtime calls a share makes: those of Open and Release.
type countingRuntime struct {
	cudart.Runtime
	calls atomic.Int64
}

func (r *countingRuntime) StreamDevice(dev int, s cudart.Stream) (int, error) {
	r.calls.Add(1)
	return r.Runtime.StreamDevice(dev, s)
}

func (r *countingRuntime) StreamWaitEvent(dev int, s cudart.Stream, e cudart.Event) error {
	r.calls.Add(1)
	return r.Runtime.StreamWaitEvent(dev, s, e)
}

func (r *countingRuntime) StreamSynchronize(dev int, s cudart.Stream) error {
	r.calls.Add(1)
	return r.Runtime.StreamSynchronize(dev, s)
}

func (r *countingRuntime) EventRecord(dev int, e cudart.Event, s cudart.Stream) error {
	r.calls.Add(1)
	return r.Runtime.EventRecord(dev, e, s)
}

func (r *countingRuntime) EventQuery(dev int, e cudart.Event) (bool, error) {
	r.calls.Add(1)
	return r.Runtime.EventQuery(dev, e)
}

func (r *countingRuntime) FreeAsync(dev int, ptr cudart.DevicePtr, s cudart.Stream) error {
	r.calls.Add(1)
	return r.Runtime.FreeAsync(dev, ptr, s)
}

func (r *countingRuntime) MemPoolImportPointer(dev int, p cudart.MemPool, data cudart.PtrExportData) (cudart.DevicePtr, error) {
	r.calls.Add(1)
	return r.Runtime.MemPoolImportPointer(dev, p, data)
}
