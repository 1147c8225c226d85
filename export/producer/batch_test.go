package producer

import (
	"context"
	"fmt"
	"sync"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/cudapool/cudapool/cudart"
	"github.com/cudapool/cudapool/cudart/cudarttest"
	"github.com/cudapool/cudapool/export/consumer"
	"github.com/cudapool/cudapool/export/internal/wire"
	"github.com/cudapool/cudapool/pool"
)

// slab publishes n blocks of a buffer, block i filled with byte(i+1) and published
// as "block-i" with meta bytes of metadata.
func (rp retainingPair) slab(t *testing.T, n int, block uint64, meta int) (*pool.Buffer, []string) {
	t.Helper()
	ctx := testCtx(t)
	pr := rp.pr
	b, err := pr.pool.Alloc(ctx, uint64(n)*block, pr.stream)
	require.NoError(t, err)
	names := make([]string, n)
	for i := range names {
		names[i] = fmt.Sprintf("block-%d", i)
		require.NoError(t, pr.dev.MemsetAsync(pr.ord, b.Ptr()+cudart.DevicePtr(uint64(i)*block), byte(i+1), block, pr.stream))
	}
	for i, name := range names {
		var opts []PublishOption
		if meta > 0 {
			opts = append(opts, WithMeta(make([]byte, meta)))
		}
		require.NoError(t, pr.ex.Publish(ctx, name, b, pr.stream, append(opts, Range(uint64(i)*block, block))...))
	}
	return b, names
}

// Many blocks of one slab in one request and one answer, each block its own Mapping
// over one import; released in one request.
func TestOpenAllAndReleaseAll(t *testing.T) {
	for _, meta := range []int{0, wire.MaxMetaLen} { // with metadata the answer spans frames
		t.Run(fmt.Sprintf("meta=%d", meta), func(t *testing.T) {
			rp := newRetainingPair(t)
			ctx := testCtx(t)
			const n, block = 64, 64 << 10
			_, names := rp.slab(t, n, block, meta)
			ms, err := rp.c.imp.OpenAll(ctx, names, rp.c.stream)
			require.NoError(t, err)
			require.Len(t, ms, n)
			for i, m := range ms {
				require.Equal(t, ms[0].Ptr()+cudart.DevicePtr(uint64(i)*block), m.Ptr(), "block %d", i)
				require.True(t, allAre(rp.c.read(t, m), byte(i+1)), "block %d read other bytes", i)
				require.Len(t, m.Meta(), meta)
			}
			assert.Equal(t, int64(1), rp.cCalls.imports.Load(), "one import for the slab")
			s := poolStats(t, rp.pr.pool)
			assert.Equal(t, n, s.ActiveLeases)
			require.NoError(t, rp.c.imp.ReleaseAll(ctx, ms, rp.c.stream))
			assert.Zero(t, poolStats(t, rp.pr.pool).ActiveLeases)
			assert.Equal(t, int64(1), rp.cCalls.frees.Load())
			require.ErrorIs(t, rp.c.imp.ReleaseAll(ctx, ms[:1], rp.c.stream), consumer.ErrReleased)
			rp.pr.checkClean(t)
			rp.c.checkClean(t)
		})
	}
}

// A batch with a name that is not published leases nothing.
func TestOpenAllIsAllOrNothing(t *testing.T) {
	rp := newRetainingPair(t)
	ctx := testCtx(t)
	_, names := rp.slab(t, 4, 4096, 0)
	_, err := rp.c.imp.OpenAll(ctx, append(names, "nope"), rp.c.stream)
	require.ErrorIs(t, err, ErrUnknownName)
	assert.Contains(t, err.Error(), `"nope"`)
	assert.Zero(t, poolStats(t, rp.pr.pool).ActiveLeases, "a failed batch left leases")
	assert.Zero(t, rp.cCalls.imports.Load())
	_, err = rp.c.imp.OpenAll(ctx, make([]string, wire.MaxBatch+1), rp.c.stream)
	require.ErrorIs(t, err, ErrBadRequest)
	ms, err := rp.c.imp.OpenAll(ctx, names, rp.c.stream)
	require.NoError(t, err)
	require.ErrorIs(t, rp.c.imp.ReleaseAll(ctx, append(ms, ms[0]), rp.c.stream), consumer.ErrReleased, "a Mapping listed twice with one reference")
	assert.Equal(t, len(ms), poolStats(t, rp.pr.pool).ActiveLeases, "a refused batch released something")
	require.NoError(t, rp.c.imp.ReleaseAll(ctx, ms, rp.c.stream))
	assert.Zero(t, poolStats(t, rp.pr.pool).ActiveLeases)
	rp.pr.checkClean(t)
	rp.c.checkClean(t)
}

// Batches with retained imports: the slab's import is kept across batches and across
// recycles of the slab.
func TestBatchesWithRetainedImports(t *testing.T) {
	rp := newRetainingPair(t, WithRetainedImports())
	ctx := testCtx(t)
	const n, block = 16, 64 << 10
	for round := range 3 {
		b, names := rp.slab(t, n, block, 0)
		ms, err := rp.c.imp.OpenAll(ctx, names, rp.c.stream)
		require.NoError(t, err)
		for i, m := range ms {
			require.True(t, allAre(rp.c.read(t, m), byte(i+1)), "round %d block %d", round, i)
		}
		require.NoError(t, rp.c.imp.ReleaseAll(ctx, ms, rp.c.stream))
		for _, name := range names {
			require.NoError(t, rp.pr.ex.Unpublish(name))
		}
		require.NoError(t, b.Free(rp.pr.stream))
	}
	assert.Equal(t, int64(1), rp.cCalls.imports.Load())
	assert.Zero(t, rp.cCalls.frees.Load())
	require.NoError(t, rp.pr.pool.Trim())
	waitFor(t, "the revoke", func() bool { return poolStats(t, rp.pr.pool).Retentions == 0 })
	rp.pr.checkClean(t)
	rp.c.checkClean(t)
}

// newImmediateConsumer is a consumer on device 0 of a software device whose streams
// run their work at once: the benchmarks time the protocol, not the device's queues.
func newImmediateConsumer(b *testing.B, path string) *testConsumer {
	b.Helper()
	s := newSide(b, 0, cudarttest.WithImmediate())
	imp, err := consumer.Dial(testCtx(b), path, s.dev, 0, consumer.WithLogger(discardLogger))
	require.NoError(b, err)
	b.Cleanup(func() { imp.Close(context.Background()) })
	return &testConsumer{side: s, imp: imp}
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
	pr := newProducer(b, []pool.Option{pool.WithCache(256 << 20)}, []ListenOption{WithRetainedImports()}, cudarttest.WithImmediate())
	const n, block = 1024, 64 << 10
	ctx := testCtx(b)
	slab, err := pr.pool.Alloc(ctx, n*block, pr.stream)
	require.NoError(b, err)
	names := make([]string, n)
	for i := range names {
		names[i] = fmt.Sprint("block-", i)
		require.NoError(b, pr.ex.Publish(ctx, names[i], slab, pr.stream, Range(uint64(i)*block, block)))
	}
	c := newImmediateConsumer(b, pr.path)
	b.ResetTimer()
	for i := 0; i < b.N; i += batch {
		at := i % n
		if at+batch > n {
			at = 0
		}
		if batch == 1 {
			m, err := c.imp.Open(ctx, names[at], c.stream)
			require.NoError(b, err)
			require.NoError(b, m.Release(ctx, c.stream))
			continue
		}
		ms, err := c.imp.OpenAll(ctx, names[at:at+batch], c.stream)
		require.NoError(b, err)
		require.NoError(b, c.imp.ReleaseAll(ctx, ms, c.stream))
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
		var opts []ListenOption
		if retained {
			name, opts = "retained", []ListenOption{WithRetainedImports()}
		}
		b.Run(name, func(b *testing.B) {
			pr := newProducer(b, []pool.Option{pool.WithCache(64 << 20)}, opts, cudarttest.WithImmediate())
			c := newImmediateConsumer(b, pr.path)
			ctx := testCtx(b)
			b.ResetTimer()
			for range b.N {
				buf, err := pr.pool.Alloc(ctx, 2<<20, pr.stream)
				require.NoError(b, err)
				require.NoError(b, pr.ex.Publish(ctx, "kv", buf, pr.stream))
				m, err := c.imp.Open(ctx, "kv", c.stream)
				require.NoError(b, err)
				require.NoError(b, m.Release(ctx, c.stream))
				require.NoError(b, pr.ex.Unpublish("kv"))
				require.NoError(b, buf.Free(pr.stream))
			}
			b.StopTimer()
			b.ReportMetric(float64(b.N)/b.Elapsed().Seconds(), "shares/s")
		})
	}
}

// PublishAll publishes every entry or none, ready after one record of the stream.
func TestPublishAll(t *testing.T) {
	rp := newRetainingPair(t)
	ctx := testCtx(t)
	pr := rp.pr
	b, err := pr.pool.Alloc(ctx, 3*4096, pr.stream)
	require.NoError(t, err)
	for i := range 3 {
		require.NoError(t, pr.dev.MemsetAsync(pr.ord, b.Ptr()+cudart.DevicePtr(i*4096), byte(0x70+i), 4096, pr.stream))
	}
	entry := func(name string, i int) Entry {
		return Entry{Name: name, Buffer: b, Options: []PublishOption{Range(uint64(i)*4096, 4096), WithMeta([]byte{byte(i)})}}
	}
	err = pr.ex.PublishAll(ctx, pr.stream, entry("p0", 0), entry("p1", 1), entry("p0", 2))
	require.ErrorIs(t, err, ErrNameInUse)
	_, err = rp.c.imp.Open(ctx, "p1", rp.c.stream)
	require.ErrorIs(t, err, ErrUnknownName, "a refused batch published a name")
	require.ErrorIs(t, pr.ex.PublishAll(ctx, pr.stream, entry("q0", 0), Entry{Name: "q1"}), ErrBadRequest, "an entry without a buffer")

	require.NoError(t, pr.ex.PublishAll(ctx, pr.stream, entry("p0", 0), entry("p1", 1), entry("p2", 2)))
	ms, err := rp.c.imp.OpenAll(ctx, []string{"p0", "p1", "p2"}, rp.c.stream)
	require.NoError(t, err)
	for i, m := range ms {
		require.True(t, allAre(rp.c.read(t, m), byte(0x70+i)), "entry %d", i)
		require.Equal(t, []byte{byte(i)}, m.Meta())
	}
	require.NoError(t, rp.c.imp.ReleaseAll(ctx, ms, rp.c.stream))
	rp.pr.checkClean(t)
	rp.c.checkClean(t)
}

// A ReleaseAll of Mappings that all stay referenced (each opened by two batches)
// releases no grant: it asks the exporter nothing, and the connection serves on.
func TestReleaseAllOfMappingsStillReferenced(t *testing.T) {
	for _, retain := range []bool{false, true} {
		t.Run(fmt.Sprintf("retain=%v", retain), func(t *testing.T) {
			var opts []ListenOption
			if retain {
				opts = append(opts, WithRetainedImports())
			}
			rp := newRetainingPair(t, opts...)
			ctx := testCtx(t)
			_, names := rp.slab(t, 4, 4096, 0)
			first, err := rp.c.imp.OpenAll(ctx, names, rp.c.stream)
			require.NoError(t, err)
			second, err := rp.c.imp.OpenAll(ctx, names, rp.c.stream)
			require.NoError(t, err)
			held := poolStats(t, rp.pr.pool).ActiveLeases
			require.NoError(t, rp.c.imp.ReleaseAll(ctx, first, rp.c.stream))
			assert.Equal(t, held, poolStats(t, rp.pr.pool).ActiveLeases, "grants ended while their Mappings are referenced")
			m, err := rp.c.imp.Open(ctx, names[0], rp.c.stream)
			require.NoError(t, err, "an Open after a ReleaseAll that released no grant")
			require.NoError(t, m.Release(ctx, rp.c.stream))
			require.NoError(t, rp.c.imp.ReleaseAll(ctx, second, rp.c.stream))
			assert.Zero(t, poolStats(t, rp.pr.pool).ActiveLeases)
			assert.NotContains(t, rp.pr.log.String(), "closing peer connection", "the exporter cut the connection")
			rp.pr.checkClean(t)
			rp.c.checkClean(t)
		})
	}
}

// A ReleaseBatch of no entries is a bad request, answered with an Error; the
// connection serves on.
func TestEmptyReleaseBatchIsABadRequest(t *testing.T) {
	r := admittedToA(t)
	r.send(&wire.ReleaseBatchMsg{ReqID: 5})
	wantError(t, r.recv(), 5, ErrBadRequest)
	r.servesOn(6)
}

// OpenAll of MaxBatch names of 64 bytes (SHA-256 in hex), within every documented
// limit, goes out in requests that each fit a frame, and is all or none still.
func TestOpenAllOfLongNames(t *testing.T) {
	rp := newRetainingPair(t)
	ctx := testCtx(t)
	const block = 4096
	b, err := rp.pr.pool.Alloc(ctx, MaxBatch*block, rp.pr.stream)
	require.NoError(t, err)
	entries := make([]Entry, MaxBatch)
	names := make([]string, MaxBatch)
	for i := range entries {
		names[i] = fmt.Sprintf("%064x", i)
		entries[i] = Entry{Name: names[i], Buffer: b, Options: []PublishOption{Range(uint64(i)*block, block)}}
	}
	require.NoError(t, rp.pr.ex.PublishAll(ctx, rp.pr.stream, entries...))
	ms, err := rp.c.imp.OpenAll(ctx, names, rp.c.stream)
	require.NoError(t, err, "OpenAll of %d names of 64 bytes", MaxBatch)
	require.Len(t, ms, MaxBatch)
	for i, m := range ms {
		require.Equal(t, ms[0].Ptr()+cudart.DevicePtr(uint64(i)*block), m.Ptr(), "block %d", i)
	}
	assert.Equal(t, MaxBatch, poolStats(t, rp.pr.pool).ActiveLeases)
	require.NoError(t, rp.c.imp.ReleaseAll(ctx, ms, rp.c.stream))

	// A name that fails in the last request gives back what the earlier ones leased.
	_, err = rp.c.imp.OpenAll(ctx, append(names[:MaxBatch-1:MaxBatch-1], "nope"), rp.c.stream)
	require.ErrorIs(t, err, ErrUnknownName)
	waitFor(t, "the earlier requests' leases to be given back", func() bool { return poolStats(t, rp.pr.pool).ActiveLeases == 0 })
	assert.NotContains(t, rp.pr.log.String(), "closing peer connection", "the exporter cut the connection")
	rp.pr.checkClean(t)
	rp.c.checkClean(t)
}

// A ReleaseBatch of MaxBatch forged entries is refused with one Error frame that fits
// the frame limit; the connection serves on.
func TestReleaseBatchOfBadEntriesAnswerFits(t *testing.T) {
	r := admittedToA(t)
	entries := make([]wire.ReleaseMsg, MaxBatch)
	for i := range entries {
		entries[i] = wire.ReleaseMsg{LeaseID: 0xdead0000 + uint64(i), Count: 1}
	}
	r.send(&wire.ReleaseBatchMsg{ReqID: 5, Entries: entries})
	m := r.recv()
	wantStale(t, m, 5, staleForged)
	assert.Contains(t, m.(*wire.ErrorMsg).Text, fmt.Sprintf("%d of %d entries refused", MaxBatch, MaxBatch))
	r.servesOn(6)
}

// No frame larger than the limit is ever written: send refuses it, writing nothing,
// and the connection stays usable.
func TestSendRefusesAnOversizedFrame(t *testing.T) {
	r := admittedToA(t)
	names := make([]string, MaxBatch)
	for i := range names {
		names[i] = fmt.Sprintf("%064x", i)
	}
	err := r.c.Send(context.Background(), &wire.OpenBatchMsg{ReqID: 5, Names: names}, -1)
	require.ErrorIs(t, err, ErrBadRequest, "an OpenBatch of %d names of 64 bytes", MaxBatch)
	assert.Contains(t, err.Error(), "frame limit")
	r.servesOn(6)
}

// admittedToA is a raw peer admitted by an exporter that publishes "a".
func admittedToA(t *testing.T) *rawPeer {
	t.Helper()
	pr := newProducer(t, nil, nil)
	pr.publish(t, "a", 1<<20, 1)
	return admitted(t, pr.path)
}

// servesOn checks that the connection still serves: "a" is leased (request reqID)
// and released (reqID+1).
func (r *rawPeer) servesOn(reqID uint64) {
	r.t.Helper()
	l, ok := r.open(reqID, "a").(*wire.LeaseMsg)
	require.True(r.t, ok, "the connection did not serve an Open")
	_, ok = r.release(reqID+1, l.LeaseID, 1).(*wire.ReleasedMsg)
	require.True(r.t, ok, "the connection did not serve a Release")
}

// waitCounter counts the distinct events each stream was made to wait on.
type waitCounter struct {
	cudart.Runtime
	mu    sync.Mutex
	waits map[cudart.Stream]map[cudart.Event]bool
}

func (w *waitCounter) StreamWaitEvent(dev int, s cudart.Stream, e cudart.Event) error {
	w.mu.Lock()
	if w.waits[s] == nil {
		w.waits[s] = map[cudart.Event]bool{}
	}
	w.waits[s][e] = true
	w.mu.Unlock()
	return w.Runtime.StreamWaitEvent(dev, s, e)
}

func (w *waitCounter) waited(s cudart.Stream) int {
	w.mu.Lock()
	defer w.mu.Unlock()
	return len(w.waits[s])
}

// OpenAll of buffers published on two producer streams, both stalled before their
// writes, makes the consumer's stream wait on the ready event of each (and on one
// only for two buffers of one stream); reads on the consumer's stream see the writes.
func TestOpenAllWaitsForEveryProducerStream(t *testing.T) {
	pr := newProducer(t, nil, nil)
	ctx := testCtx(t)
	second, err := pr.dev.StreamCreate(pr.ord, cudart.StreamNonBlocking)
	require.NoError(t, err)
	names := []string{"first", "second", "first-too"}
	var resumes []func()
	for i, s := range []cudart.Stream{pr.stream, second, pr.stream} {
		b, err := pr.pool.Alloc(ctx, 1<<20, s)
		require.NoError(t, err)
		if i < 2 {
			require.NoError(t, pr.dev.StreamSynchronize(pr.ord, s))
			resume, err := pr.dev.Stall(pr.ord, s)
			require.NoError(t, err)
			t.Cleanup(resume)
			resumes = append(resumes, resume)
		}
		require.NoError(t, pr.dev.MemsetAsync(pr.ord, b.Ptr(), byte(i+1), 1<<20, s)) // held by the stall
		require.NoError(t, pr.ex.Publish(ctx, names[i], b, s))
	}

	side := newSide(t, 0)
	rt := &waitCounter{Runtime: side.dev, waits: map[cudart.Stream]map[cudart.Event]bool{}}
	imp, err := consumer.Dial(ctx, pr.path, rt, 0, consumer.WithLogger(discardLogger))
	require.NoError(t, err)
	c := &testConsumer{side: side, imp: imp}
	t.Cleanup(func() { imp.Close(context.Background()) })
	ms, err := c.imp.OpenAll(ctx, names, c.stream)
	require.NoError(t, err)
	assert.Equal(t, 2, rt.waited(c.stream), "the producer streams the consumer's stream waits for")
	for _, resume := range resumes {
		resume()
	}
	for i, m := range ms {
		require.True(t, allAre(c.read(t, m), byte(i+1)), "the consumer read %s before its producer's writes", names[i])
	}
	require.NoError(t, c.imp.ReleaseAll(ctx, ms, c.stream))
	require.NoError(t, pr.dev.StreamSynchronize(pr.ord, second))
	c.checkClean(t)
	pr.checkClean(t)
}

// ReleaseAll with the imports retained still orders the release after the caller's
// pending work: the producer's next use of the recycled memory waits for a copy the
// consumer queued (on a stalled stream) before it released.
func TestReleaseAllWithRetentionOrdersAfterPendingWork(t *testing.T) {
	rp := newRetainingPair(t, WithRetainedImports())
	ctx := testCtx(t)
	pr, c := rp.pr, rp.c
	b, names := rp.slab(t, 2, 1<<20, 0)
	ms, err := c.imp.OpenAll(ctx, names, c.stream)
	require.NoError(t, err)
	dp, err := c.dev.DeviceGetDefaultMemPool(c.ord)
	require.NoError(t, err)
	local, err := c.dev.MallocFromPoolAsync(c.ord, 1<<20, dp, c.stream)
	require.NoError(t, err, "the consumer's own buffer")
	require.NoError(t, c.dev.StreamSynchronize(c.ord, c.stream))
	resume := stall(t, c.side)
	require.NoError(t, c.dev.MemcpyDtoDAsync(c.ord, local, ms[1].Ptr(), 1<<20, c.stream)) // pending
	require.NoError(t, c.imp.ReleaseAll(ctx, ms, c.stream))
	assert.Equal(t, 1, poolStats(t, pr.pool).Retentions, "the slab's import is retained")
	for _, name := range names {
		require.NoError(t, pr.ex.Unpublish(name))
	}
	require.NoError(t, b.Free(pr.stream))
	again, err := pr.pool.Alloc(ctx, 2<<20, pr.stream) // the recycled slab
	require.NoError(t, err)
	require.Equal(t, b.Ptr(), again.Ptr(), "the slab's memory was recycled")
	require.NoError(t, pr.dev.MemsetAsync(pr.ord, again.Ptr(), 0xee, 2<<20, pr.stream)) // must wait for the copy
	resume()
	out := make([]byte, 1<<20)
	require.NoError(t, c.dev.MemcpyDtoHAsync(c.ord, out, local, c.stream))
	assert.True(t, allAre(out, 2), "the consumer's pending copy read the producer's next data")
	require.NoError(t, pr.dev.StreamSynchronize(pr.ord, pr.stream))
	require.NoError(t, c.dev.FreeAsync(c.ord, local, c.stream))
	require.NoError(t, again.Free(pr.stream))
	pr.checkClean(t)
	c.checkClean(t)
}
