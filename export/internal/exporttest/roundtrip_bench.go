package exporttest

import (
	"context"
	"errors"
	"fmt"
	"os"
	"runtime"
	"strconv"
	"strings"
	"sync/atomic"
	"time"

	"github.com/cudapool/cudapool/cudart"
	"github.com/cudapool/cudapool/cudart/cudarttest"
	"github.com/cudapool/cudapool/export/consumer"
	"github.com/cudapool/cudapool/internal/proctest"
)

// RoleRoundTripConsumer: roundtrip-consumer SOCKET, then commands on stdin, each
// answered with "ns T allocs A calls C" for the timed part:
//
//	open NAME COUNT N         N times: Open NAME<i%COUNT> (timed), Release
//	release NAME COUNT N      N times: Open, Release (timed)
//	openrelease NAME COUNT N  N times: Open and Release (timed)
//	batch64 NAME COUNT N      N/64 times: OpenAll of 64 names, ReleaseAll (timed)
func RoleRoundTripConsumer(args []string) int {
	fail := func(err error) int { fmt.Fprintln(os.Stderr, "roundtrip-consumer:", err); return 1 }
	if len(args) != 1 {
		return fail(errors.New("want SOCKET"))
	}
	d := cudarttest.New(cudarttest.WithImmediate())
	defer func() { _ = d.Close() }() // cleanup: what is tested is above
	rt := &CountingRuntime{Runtime: d}
	ctx := context.Background()
	s, err := rt.StreamCreate(0, cudart.StreamNonBlocking)
	if err != nil {
		return fail(err)
	}
	imp, err := consumer.Dial(ctx, args[0], rt, 0)
	if err != nil {
		return fail(err)
	}
	defer func() { _ = imp.Close(ctx) }() // cleanup: what is tested is above
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
		calls := rt.Calls.Load()
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
		fmt.Println("ns", spent.Nanoseconds(), "allocs", ms.Mallocs-allocs, "calls", rt.Calls.Load()-calls)
	}
	return 0
}

// CountingRuntime counts the runtime calls a share makes: those of Open and Release.
type CountingRuntime struct {
	cudart.Runtime
	Calls atomic.Int64
}

func (r *CountingRuntime) StreamDevice(dev int, s cudart.Stream) (int, error) {
	r.Calls.Add(1)
	return r.Runtime.StreamDevice(dev, s)
}

func (r *CountingRuntime) StreamWaitEvent(dev int, s cudart.Stream, e cudart.Event) error {
	r.Calls.Add(1)
	return r.Runtime.StreamWaitEvent(dev, s, e)
}

func (r *CountingRuntime) StreamSynchronize(dev int, s cudart.Stream) error {
	r.Calls.Add(1)
	return r.Runtime.StreamSynchronize(dev, s)
}

func (r *CountingRuntime) EventRecord(dev int, e cudart.Event, s cudart.Stream) error {
	r.Calls.Add(1)
	return r.Runtime.EventRecord(dev, e, s)
}

func (r *CountingRuntime) EventQuery(dev int, e cudart.Event) (bool, error) {
	r.Calls.Add(1)
	return r.Runtime.EventQuery(dev, e)
}

func (r *CountingRuntime) FreeAsync(dev int, ptr cudart.DevicePtr, s cudart.Stream) error {
	r.Calls.Add(1)
	return r.Runtime.FreeAsync(dev, ptr, s)
}

func (r *CountingRuntime) MemPoolImportPointer(dev int, p cudart.MemPool, data cudart.PtrExportData) (cudart.DevicePtr, error) {
	r.Calls.Add(1)
	return r.Runtime.MemPoolImportPointer(dev, p, data)
}
