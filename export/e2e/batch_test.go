package e2e_test

import (
	"context"
	"fmt"
	"sync"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/cudapool/cudapool/cudart"
	"github.com/cudapool/cudapool/cudart/cudarttest"
	"github.com/cudapool/cudapool/export"
	"github.com/cudapool/cudapool/export/consumer"
	"github.com/cudapool/cudapool/export/internal/exporttest"
	"github.com/cudapool/cudapool/export/producer"
	"github.com/cudapool/cudapool/internal/intercept"
	"github.com/cudapool/cudapool/pool"
)

// Many blocks of one slab in one request and one answer, each block its own Mapping
// over one import; released in one request.
func TestOpenAllAndReleaseAll(t *testing.T) {
	for _, meta := range []int{0, export.MaxMetaLen} { // with metadata the answer spans frames
		t.Run(fmt.Sprintf("meta=%d", meta), func(t *testing.T) {
			rp := exporttest.NewRetainingPair(t)
			ctx := exporttest.Ctx(t)
			const n, block = 64, 64 << 10
			_, names := rp.Slab(t, n, block, meta)
			ms, err := rp.C.Imp.OpenAll(ctx, names, rp.C.Stream)
			require.NoError(t, err)
			require.Len(t, ms, n)
			for i, m := range ms {
				require.Equal(t, ms[0].Ptr()+cudart.DevicePtr(uint64(i)*block), m.Ptr(), "block %d", i)
				require.True(t, exporttest.AllAre(rp.C.Read(t, m), byte(i+1)), "block %d read other bytes", i)
				require.Len(t, m.Meta(), meta)
			}
			assert.Equal(t, int64(1), rp.CCalls.Imports(), "one import for the slab")
			s := exporttest.PoolStats(t, rp.Pr.Pool)
			assert.Equal(t, n, s.ActiveLeases)
			require.NoError(t, rp.C.Imp.ReleaseAll(ctx, ms, rp.C.Stream))
			assert.Zero(t, exporttest.PoolStats(t, rp.Pr.Pool).ActiveLeases)
			assert.Equal(t, int64(1), rp.CCalls.Frees())
			require.ErrorIs(t, rp.C.Imp.ReleaseAll(ctx, ms[:1], rp.C.Stream), consumer.ErrReleased)
			rp.Pr.CheckClean(t)
			rp.C.CheckClean(t)
		})
	}
}

// A batch with a name that is not published leases nothing.
func TestOpenAllIsAllOrNothing(t *testing.T) {
	rp := exporttest.NewRetainingPair(t)
	ctx := exporttest.Ctx(t)
	_, names := rp.Slab(t, 4, 4096, 0)
	_, err := rp.C.Imp.OpenAll(ctx, append(names, "nope"), rp.C.Stream)
	require.ErrorIs(t, err, export.ErrUnknownName)
	assert.Contains(t, err.Error(), `"nope"`)
	assert.Zero(t, exporttest.PoolStats(t, rp.Pr.Pool).ActiveLeases, "a failed batch left leases")
	assert.Zero(t, rp.CCalls.Imports())
	_, err = rp.C.Imp.OpenAll(ctx, make([]string, export.MaxBatch+1), rp.C.Stream)
	require.ErrorIs(t, err, export.ErrBadRequest)
	ms, err := rp.C.Imp.OpenAll(ctx, names, rp.C.Stream)
	require.NoError(t, err)
	require.ErrorIs(t, rp.C.Imp.ReleaseAll(ctx, append(ms, ms[0]), rp.C.Stream), consumer.ErrReleased, "a Mapping listed twice with one reference")
	assert.Equal(t, len(ms), exporttest.PoolStats(t, rp.Pr.Pool).ActiveLeases, "a refused batch released something")
	require.NoError(t, rp.C.Imp.ReleaseAll(ctx, ms, rp.C.Stream))
	assert.Zero(t, exporttest.PoolStats(t, rp.Pr.Pool).ActiveLeases)
	rp.Pr.CheckClean(t)
	rp.C.CheckClean(t)
}

// Batches with retained imports: the slab's import is kept across batches and across
// recycles of the slab.
func TestBatchesWithRetainedImports(t *testing.T) {
	rp := exporttest.NewRetainingPair(t, producer.WithRetainedImports())
	ctx := exporttest.Ctx(t)
	const n, block = 16, 64 << 10
	for round := range 3 {
		b, names := rp.Slab(t, n, block, 0)
		ms, err := rp.C.Imp.OpenAll(ctx, names, rp.C.Stream)
		require.NoError(t, err)
		for i, m := range ms {
			require.True(t, exporttest.AllAre(rp.C.Read(t, m), byte(i+1)), "round %d block %d", round, i)
		}
		require.NoError(t, rp.C.Imp.ReleaseAll(ctx, ms, rp.C.Stream))
		for _, name := range names {
			require.NoError(t, rp.Pr.Ex.Unpublish(name))
		}
		require.NoError(t, b.Free(rp.Pr.Stream))
	}
	assert.Equal(t, int64(1), rp.CCalls.Imports())
	assert.Zero(t, rp.CCalls.Frees())
	require.NoError(t, rp.Pr.Pool.Trim())
	exporttest.WaitFor(t, "the revoke", func() bool { return exporttest.PoolStats(t, rp.Pr.Pool).Retentions == 0 })
	rp.Pr.CheckClean(t)
	rp.C.CheckClean(t)
}

// newImmediateConsumer is a consumer on device 0 of a software device whose streams
// run their work at once: the benchmarks time the protocol, not the device's queues.
func newImmediateConsumer(b *testing.B, path string) *exporttest.Consumer {
	b.Helper()
	s := exporttest.NewSide(b, 0, cudarttest.WithImmediate())
	imp, err := consumer.Dial(exporttest.Ctx(b), path, s.Dev, 0, consumer.WithLogger(exporttest.DiscardLogger))
	require.NoError(b, err)
	b.Cleanup(func() { imp.Close(context.Background()) })
	return &exporttest.Consumer{Side: s, Imp: imp}
}

// BenchmarkBlockSharesInProcess opens and releases 64 KiB blocks of a 64 MiB slab, one
// at a time (Open, Release) and in batches of 64 (OpenAll, ReleaseAll), with the
// consumer in this process on a second software device: the protocol's own cost per
// block. ns/op is per block.
func BenchmarkBlockSharesInProcess(b *testing.B) {
	for _, batch := range []int{1, 64} {
		b.Run(fmt.Sprintf("batch=%d", batch), func(b *testing.B) { benchBlocks(b, batch) })
	}
}

func benchBlocks(b *testing.B, batch int) {
	pr := exporttest.NewProducer(b, []pool.Option{pool.WithCache(256 << 20)}, []producer.ListenOption{producer.WithRetainedImports()}, cudarttest.WithImmediate())
	const n, block = 1024, 64 << 10
	ctx := exporttest.Ctx(b)
	slab, err := pr.Pool.Alloc(ctx, n*block, pr.Stream)
	require.NoError(b, err)
	names := make([]string, n)
	for i := range names {
		names[i] = fmt.Sprint("block-", i)
		require.NoError(b, pr.Ex.Publish(ctx, names[i], slab, pr.Stream, producer.Range(uint64(i)*block, block)))
	}
	c := newImmediateConsumer(b, pr.Path)
	b.ResetTimer()
	for i := 0; i < b.N; i += batch {
		at := i % n
		if at+batch > n {
			at = 0
		}
		if batch == 1 {
			m, err := c.Imp.Open(ctx, names[at], c.Stream)
			require.NoError(b, err)
			require.NoError(b, m.Release(ctx, c.Stream))
			continue
		}
		ms, err := c.Imp.OpenAll(ctx, names[at:at+batch], c.Stream)
		require.NoError(b, err)
		require.NoError(b, c.Imp.ReleaseAll(ctx, ms, c.Stream))
	}
	b.StopTimer()
	b.ReportMetric(float64(b.N)/b.Elapsed().Seconds(), "blocks/s")
}

// BenchmarkRecycledSharesInProcess is one share of a 2 MiB buffer per op: the producer
// allocates it (from its cache), publishes it, the consumer opens and releases it, and
// the producer unpublishes and frees it; "fresh" imports and frees each time,
// "retained" keeps the import (WithRetainedImports). The software device, in one
// process.
func BenchmarkRecycledSharesInProcess(b *testing.B) {
	for _, retained := range []bool{false, true} {
		name := "fresh"
		var opts []producer.ListenOption
		if retained {
			name, opts = "retained", []producer.ListenOption{producer.WithRetainedImports()}
		}
		b.Run(name, func(b *testing.B) {
			pr := exporttest.NewProducer(b, []pool.Option{pool.WithCache(64 << 20)}, opts, cudarttest.WithImmediate())
			c := newImmediateConsumer(b, pr.Path)
			ctx := exporttest.Ctx(b)
			b.ResetTimer()
			for range b.N {
				buf, err := pr.Pool.Alloc(ctx, 2<<20, pr.Stream)
				require.NoError(b, err)
				require.NoError(b, pr.Ex.Publish(ctx, "kv", buf, pr.Stream))
				m, err := c.Imp.Open(ctx, "kv", c.Stream)
				require.NoError(b, err)
				require.NoError(b, m.Release(ctx, c.Stream))
				require.NoError(b, pr.Ex.Unpublish("kv"))
				require.NoError(b, buf.Free(pr.Stream))
			}
			b.StopTimer()
			b.ReportMetric(float64(b.N)/b.Elapsed().Seconds(), "shares/s")
		})
	}
}

// PublishAll publishes every entry or none, ready after one record of the stream.
func TestPublishAll(t *testing.T) {
	rp := exporttest.NewRetainingPair(t)
	ctx := exporttest.Ctx(t)
	pr := rp.Pr
	b, err := pr.Pool.Alloc(ctx, 3*4096, pr.Stream)
	require.NoError(t, err)
	for i := range 3 {
		require.NoError(t, pr.Dev.MemsetAsync(pr.Ord, b.Ptr()+cudart.DevicePtr(i*4096), byte(0x70+i), 4096, pr.Stream))
	}
	entry := func(name string, i int) producer.Entry {
		return producer.Entry{Name: name, Buffer: b, Options: []producer.PublishOption{producer.Range(uint64(i)*4096, 4096), producer.WithMeta([]byte{byte(i)})}}
	}
	err = pr.Ex.PublishAll(ctx, []producer.Entry{entry("p0", 0), entry("p1", 1), entry("p0", 2)}, pr.Stream)
	require.ErrorIs(t, err, producer.ErrNameInUse)
	_, err = rp.C.Imp.Open(ctx, "p1", rp.C.Stream)
	require.ErrorIs(t, err, export.ErrUnknownName, "a refused batch published a name")
	require.ErrorIs(t, pr.Ex.PublishAll(ctx, []producer.Entry{entry("q0", 0), producer.Entry{Name: "q1"}}, pr.Stream), export.ErrBadRequest, "an entry without a buffer")

	require.NoError(t, pr.Ex.PublishAll(ctx, []producer.Entry{entry("p0", 0), entry("p1", 1), entry("p2", 2)}, pr.Stream))
	ms, err := rp.C.Imp.OpenAll(ctx, []string{"p0", "p1", "p2"}, rp.C.Stream)
	require.NoError(t, err)
	for i, m := range ms {
		require.True(t, exporttest.AllAre(rp.C.Read(t, m), byte(0x70+i)), "entry %d", i)
		require.Equal(t, []byte{byte(i)}, m.Meta())
	}
	require.NoError(t, rp.C.Imp.ReleaseAll(ctx, ms, rp.C.Stream))
	rp.Pr.CheckClean(t)
	rp.C.CheckClean(t)
}

// A ReleaseAll of Mappings that all stay referenced (each opened by two batches)
// releases no grant: it asks the exporter nothing, and the connection serves on.
func TestReleaseAllOfMappingsStillReferenced(t *testing.T) {
	for _, retain := range []bool{false, true} {
		t.Run(fmt.Sprintf("retain=%v", retain), func(t *testing.T) {
			var opts []producer.ListenOption
			if retain {
				opts = append(opts, producer.WithRetainedImports())
			}
			rp := exporttest.NewRetainingPair(t, opts...)
			ctx := exporttest.Ctx(t)
			_, names := rp.Slab(t, 4, 4096, 0)
			first, err := rp.C.Imp.OpenAll(ctx, names, rp.C.Stream)
			require.NoError(t, err)
			second, err := rp.C.Imp.OpenAll(ctx, names, rp.C.Stream)
			require.NoError(t, err)
			held := exporttest.PoolStats(t, rp.Pr.Pool).ActiveLeases
			require.NoError(t, rp.C.Imp.ReleaseAll(ctx, first, rp.C.Stream))
			assert.Equal(t, held, exporttest.PoolStats(t, rp.Pr.Pool).ActiveLeases, "grants ended while their Mappings are referenced")
			m, err := rp.C.Imp.Open(ctx, names[0], rp.C.Stream)
			require.NoError(t, err, "an Open after a ReleaseAll that released no grant")
			require.NoError(t, m.Release(ctx, rp.C.Stream))
			require.NoError(t, rp.C.Imp.ReleaseAll(ctx, second, rp.C.Stream))
			assert.Zero(t, exporttest.PoolStats(t, rp.Pr.Pool).ActiveLeases)
			assert.NotContains(t, rp.Pr.Log.String(), "closing peer connection", "the exporter cut the connection")
			rp.Pr.CheckClean(t)
			rp.C.CheckClean(t)
		})
	}
}

// OpenAll of export.MaxBatch names of 64 bytes (SHA-256 in hex), within every documented
// limit, goes out in requests that each fit a frame, and is all or none still.
func TestOpenAllOfLongNames(t *testing.T) {
	rp := exporttest.NewRetainingPair(t)
	ctx := exporttest.Ctx(t)
	const block = 4096
	b, err := rp.Pr.Pool.Alloc(ctx, export.MaxBatch*block, rp.Pr.Stream)
	require.NoError(t, err)
	entries := make([]producer.Entry, export.MaxBatch)
	names := make([]string, export.MaxBatch)
	for i := range entries {
		names[i] = fmt.Sprintf("%064x", i)
		entries[i] = producer.Entry{Name: names[i], Buffer: b, Options: []producer.PublishOption{producer.Range(uint64(i)*block, block)}}
	}
	require.NoError(t, rp.Pr.Ex.PublishAll(ctx, entries, rp.Pr.Stream))
	ms, err := rp.C.Imp.OpenAll(ctx, names, rp.C.Stream)
	require.NoError(t, err, "OpenAll of %d names of 64 bytes", export.MaxBatch)
	require.Len(t, ms, export.MaxBatch)
	for i, m := range ms {
		require.Equal(t, ms[0].Ptr()+cudart.DevicePtr(uint64(i)*block), m.Ptr(), "block %d", i)
	}
	assert.Equal(t, export.MaxBatch, exporttest.PoolStats(t, rp.Pr.Pool).ActiveLeases)
	require.NoError(t, rp.C.Imp.ReleaseAll(ctx, ms, rp.C.Stream))

	// A name that fails in the last request gives back what the earlier ones leased.
	_, err = rp.C.Imp.OpenAll(ctx, append(names[:export.MaxBatch-1:export.MaxBatch-1], "nope"), rp.C.Stream)
	require.ErrorIs(t, err, export.ErrUnknownName)
	exporttest.WaitFor(t, "the earlier requests' leases to be given back", func() bool { return exporttest.PoolStats(t, rp.Pr.Pool).ActiveLeases == 0 })
	assert.NotContains(t, rp.Pr.Log.String(), "closing peer connection", "the exporter cut the connection")
	rp.Pr.CheckClean(t)
	rp.C.CheckClean(t)
}

// countWaits counts the distinct events each stream of rt is made to wait on.
func countWaits(rt *intercept.Runtime) (waited func(cudart.Stream) int) {
	var mu sync.Mutex
	waits := map[cudart.Stream]map[cudart.Event]bool{}
	rt.On.StreamWaitEvent.Before(func(_ int, s cudart.Stream, e cudart.Event) error {
		mu.Lock()
		defer mu.Unlock()
		if waits[s] == nil {
			waits[s] = map[cudart.Event]bool{}
		}
		waits[s][e] = true
		return nil
	})
	return func(s cudart.Stream) int {
		mu.Lock()
		defer mu.Unlock()
		return len(waits[s])
	}
}

// OpenAll of buffers published on two producer streams, both stalled before their
// writes, makes the consumer's stream wait on the ready event of each (and on one
// only for two buffers of one stream); reads on the consumer's stream see the writes.
func TestOpenAllWaitsForEveryProducerStream(t *testing.T) {
	pr := exporttest.NewProducer(t, nil, nil)
	ctx := exporttest.Ctx(t)
	second, err := pr.Dev.StreamCreate(pr.Ord, cudart.StreamNonBlocking)
	require.NoError(t, err)
	names := []string{"first", "second", "first-too"}
	var resumes []func()
	for i, s := range []cudart.Stream{pr.Stream, second, pr.Stream} {
		b, err := pr.Pool.Alloc(ctx, 1<<20, s)
		require.NoError(t, err)
		if i < 2 {
			require.NoError(t, pr.Dev.StreamSynchronize(pr.Ord, s))
			resume, err := pr.Dev.Stall(pr.Ord, s)
			require.NoError(t, err)
			t.Cleanup(resume)
			resumes = append(resumes, resume)
		}
		require.NoError(t, pr.Dev.MemsetAsync(pr.Ord, b.Ptr(), byte(i+1), 1<<20, s)) // held by the stall
		require.NoError(t, pr.Ex.Publish(ctx, names[i], b, s))
	}

	side := exporttest.NewSide(t, 0)
	rt := intercept.Wrap(side.Dev)
	waited := countWaits(rt)
	imp, err := consumer.Dial(ctx, pr.Path, rt, 0, consumer.WithLogger(exporttest.DiscardLogger))
	require.NoError(t, err)
	c := &exporttest.Consumer{Side: side, Imp: imp}
	t.Cleanup(func() { imp.Close(context.Background()) })
	ms, err := c.Imp.OpenAll(ctx, names, c.Stream)
	require.NoError(t, err)
	assert.Equal(t, 2, waited(c.Stream), "the producer streams the consumer's stream waits for")
	for _, resume := range resumes {
		resume()
	}
	for i, m := range ms {
		require.True(t, exporttest.AllAre(c.Read(t, m), byte(i+1)), "the consumer read %s before its producer's writes", names[i])
	}
	require.NoError(t, c.Imp.ReleaseAll(ctx, ms, c.Stream))
	require.NoError(t, pr.Dev.StreamSynchronize(pr.Ord, second))
	c.CheckClean(t)
	pr.CheckClean(t)
}

// ReleaseAll with the imports retained still orders the release after the caller's
// pending work: the producer's next use of the recycled memory waits for a copy the
// consumer queued (on a stalled stream) before it released.
func TestReleaseAllWithRetentionOrdersAfterPendingWork(t *testing.T) {
	rp := exporttest.NewRetainingPair(t, producer.WithRetainedImports())
	ctx := exporttest.Ctx(t)
	pr, c := rp.Pr, rp.C
	b, names := rp.Slab(t, 2, 1<<20, 0)
	ms, err := c.Imp.OpenAll(ctx, names, c.Stream)
	require.NoError(t, err)
	dp, err := c.Dev.DeviceGetDefaultMemPool(c.Ord)
	require.NoError(t, err)
	local, err := c.Dev.MallocFromPoolAsync(c.Ord, 1<<20, dp, c.Stream)
	require.NoError(t, err, "the consumer's own buffer")
	require.NoError(t, c.Dev.StreamSynchronize(c.Ord, c.Stream))
	resume := exporttest.Stall(t, c.Side)
	require.NoError(t, c.Dev.MemcpyDtoDAsync(c.Ord, local, ms[1].Ptr(), 1<<20, c.Stream)) // pending
	require.NoError(t, c.Imp.ReleaseAll(ctx, ms, c.Stream))
	assert.Equal(t, 1, exporttest.PoolStats(t, pr.Pool).Retentions, "the slab's import is retained")
	for _, name := range names {
		require.NoError(t, pr.Ex.Unpublish(name))
	}
	require.NoError(t, b.Free(pr.Stream))
	again, err := pr.Pool.Alloc(ctx, 2<<20, pr.Stream) // the recycled slab
	require.NoError(t, err)
	require.Equal(t, b.Ptr(), again.Ptr(), "the slab's memory was recycled")
	require.NoError(t, pr.Dev.MemsetAsync(pr.Ord, again.Ptr(), 0xee, 2<<20, pr.Stream)) // must wait for the copy
	resume()
	out := make([]byte, 1<<20)
	require.NoError(t, c.Dev.MemcpyDtoHAsync(c.Ord, out, local, c.Stream))
	assert.True(t, exporttest.AllAre(out, 2), "the consumer's pending copy read the producer's next data")
	require.NoError(t, pr.Dev.StreamSynchronize(pr.Ord, pr.Stream))
	require.NoError(t, c.Dev.FreeAsync(c.Ord, local, c.Stream))
	require.NoError(t, again.Free(pr.Stream))
	pr.CheckClean(t)
	c.CheckClean(t)
}
