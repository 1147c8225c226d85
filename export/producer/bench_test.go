package producer_test

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/cudapool/cudapool/cudart"
	"github.com/cudapool/cudapool/cudart/choose"
	"github.com/cudapool/cudapool/export/internal/exporttest"
	"github.com/cudapool/cudapool/export/producer"
	"github.com/cudapool/cudapool/internal/proctest"
	"github.com/cudapool/cudapool/pool"
)

// benchBatch bounds the buffers a benchmark has published at once.
const benchBatch = 256

// benchEnv is a producer in the benchmark's process and a consumer child.
type benchEnv struct {
	rt     cudart.Runtime
	onGPU  bool
	pool   *pool.Pool
	ex     *producer.Exporter
	stream cudart.Stream
	kid    *proctest.Child
}

func newBenchEnv(b *testing.B) *benchEnv {
	b.Helper()
	picked, err := choose.Runtime(os.Getenv("CUDAPOOL_RUNTIME"))
	rt, onGPU, why := picked.Runtime, picked.OnGPU, picked.Why
	require.NoError(b, err)
	b.Log(why)
	n, err := rt.DeviceCount()
	require.NoError(b, err)
	e := &benchEnv{rt: rt, onGPU: onGPU}
	e.stream, err = rt.StreamCreate(0, cudart.StreamNonBlocking)
	require.NoError(b, err)
	e.pool, err = pool.New(rt, 0)
	require.NoError(b, err)
	path := filepath.Join(exporttest.ShortDir(b), "b.sock")
	e.ex, err = producer.Listen(path, rt, producer.WithoutAnnounce(), producer.WithLogger(exporttest.DiscardLogger))
	require.NoError(b, err)
	kind := "test"
	if onGPU {
		kind = "gpu"
	}
	e.kid = proctest.Start(b, "bench-consumer", kind, path, strconv.Itoa(min(1, n-1)))
	b.Cleanup(func() {
		e.kid.Finish()
		ctx := context.Background()
		assert.NoError(b, e.ex.Close(ctx))
		e.pool.Close(ctx, pool.Force())
		assert.NoError(b, choose.Violations(rt))
	})
	return e
}

// publish allocates and publishes count buffers of size bytes named name<i>; the
// time spent in Publish is returned.
func (e *benchEnv) publish(b *testing.B, name string, from, to int, size uint64) ([]*pool.Buffer, time.Duration) {
	b.Helper()
	ctx := context.Background()
	var bufs []*pool.Buffer
	var spent time.Duration
	for i := from; i < to; i++ {
		buf, err := e.pool.Alloc(ctx, size, e.stream)
		require.NoError(b, err)
		require.NoError(b, e.rt.MemsetAsync(0, buf.Ptr(), byte(i), size, e.stream))
		start := time.Now()
		require.NoError(b, e.ex.Publish(ctx, fmt.Sprint(name, i), buf, e.stream))
		spent += time.Since(start)
		bufs = append(bufs, buf)
	}
	return bufs, spent
}

func (e *benchEnv) unpublishAndFree(b *testing.B, name string, from int, bufs []*pool.Buffer) {
	b.Helper()
	for i, buf := range bufs {
		e.ex.Unpublish(fmt.Sprint(name, from+i))
		require.NoError(b, buf.Free(e.stream))
	}
}

// ask sends a command to the consumer and returns the nanoseconds it reports.
func (e *benchEnv) ask(b *testing.B, cmd string) time.Duration {
	b.Helper()
	e.kid.Send(cmd)
	reply := e.kid.Next()
	ns, err := strconv.ParseInt(strings.TrimPrefix(reply, "ns "), 10, 64)
	require.NoError(b, err, "consumer answered %q to %q: %v", reply, cmd, err)
	require.True(b, strings.HasPrefix(reply, "ns "), "consumer answered %q to %q: %v", reply, cmd, err)
	return time.Duration(ns)
}

// BenchmarkShareFresh: a buffer nobody has seen is published and opened by one
// consumer, from Publish to a usable pointer in the consumer (export of the record,
// lease, import, stream wait). ns/op is Publish plus Open.
func BenchmarkShareFresh(b *testing.B) {
	e := newBenchEnv(b)
	// The pool's handle travels once per consumer; that is not what is measured.
	warm, _ := e.publish(b, "warm", 0, 1, 1<<20)
	e.ask(b, "open warm 1 1")
	e.unpublishAndFree(b, "warm", 0, warm)
	var publish, open time.Duration
	b.ResetTimer()
	for done := 0; done < b.N; {
		n := min(benchBatch, b.N-done)
		bufs, p := e.publish(b, "fresh", done, done+n, 1<<20)
		publish += p
		open += e.ask(b, fmt.Sprintf("fresh fresh %d %d", done, done+n))
		e.unpublishAndFree(b, "fresh", done, bufs)
		done += n
	}
	b.ReportMetric(float64(publish.Nanoseconds())/float64(b.N), "publish-ns/op")
	b.ReportMetric(float64(open.Nanoseconds())/float64(b.N), "open-ns/op")
	b.ReportMetric(float64((publish+open).Nanoseconds())/float64(b.N), "ns/op")
}

// BenchmarkOpenExported: a consumer that is connected (pool imported, events opened)
// opens buffers whose records are exported already. Target: under 30 µs.
func BenchmarkOpenExported(b *testing.B) {
	e := newBenchEnv(b)
	const count = 64
	bufs, _ := e.publish(b, "x", 0, count, 1<<20)
	e.ask(b, fmt.Sprintf("open x %d %d", count, count))
	b.ResetTimer()
	spent := e.ask(b, fmt.Sprintf("open x %d %d", count, b.N))
	b.ReportMetric(float64(spent.Nanoseconds())/float64(b.N), "ns/op")
	b.StopTimer()
	e.unpublishAndFree(b, "x", 0, bufs)
}

// BenchmarkReleaseRoundTrip: Release of a mapping, from the call to the exporter's
// answer (free of the import, release event, lease ended by the exporter).
func BenchmarkReleaseRoundTrip(b *testing.B) {
	e := newBenchEnv(b)
	bufs, _ := e.publish(b, "r", 0, 1, 1<<20)
	e.ask(b, "release r0 1")
	b.ResetTimer()
	spent := e.ask(b, fmt.Sprintf("release r0 %d", b.N))
	b.ReportMetric(float64(spent.Nanoseconds())/float64(b.N), "ns/op")
	b.StopTimer()
	e.unpublishAndFree(b, "r", 0, bufs)
}

// BenchmarkReadImported: copies of an imported buffer into the consumer's own memory,
// on the other GPU where there are two (1 GiB on a GPU, 64 MiB on the software
// device). Reported in GB/s (10^9 bytes), each byte counted once.
func BenchmarkReadImported(b *testing.B) {
	e := newBenchEnv(b)
	size := uint64(64 << 20)
	if e.onGPU {
		size = 1 << 30
	}
	bufs, _ := e.publish(b, "big", 0, 1, size)
	e.ask(b, "read big0 1")
	b.ResetTimer()
	spent := e.ask(b, fmt.Sprintf("read big0 %d", b.N))
	b.ReportMetric(float64(spent.Nanoseconds())/float64(b.N), "ns/op")
	b.ReportMetric(float64(size)*float64(b.N)/spent.Seconds()/1e9, "GB/s")
	b.SetBytes(int64(size))
	b.StopTimer()
	e.unpublishAndFree(b, "big", 0, bufs)
}
