package producer_test

import (
	"context"
	"fmt"
	"path/filepath"
	"strconv"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/cudapool/cudapool/cudart"
	"github.com/cudapool/cudapool/cudart/cudarttest"
	"github.com/cudapool/cudapool/export/internal/exporttest"
	"github.com/cudapool/cudapool/export/producer"
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
			path := filepath.Join(exporttest.ShortDir(b), "r.sock")
			ex, err := producer.Listen(path, rt, producer.WithoutAnnounce(), producer.WithLogger(exporttest.DiscardLogger))
			require.NoError(b, err)
			const ring = 64
			ctx := exporttest.Ctx(b)
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
