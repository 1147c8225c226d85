package producer

import (
	"context"
	"fmt"
	"maps"
	"sync"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/cudapool/cudapool/cudart"
	"github.com/cudapool/cudapool/export/consumer"
	"github.com/cudapool/cudapool/export/internal/inspect"
	"github.com/cudapool/cudapool/pool"
)

// callCounts is a runtime that counts the calls a share may make, by name.
type callCounts struct {
	cudart.Runtime
	mu sync.Mutex
	n  map[string]int
}

func newCallCounts(rt cudart.Runtime) *callCounts {
	return &callCounts{Runtime: rt, n: map[string]int{}}
}

func (r *callCounts) count(call string) {
	r.mu.Lock()
	r.n[call]++
	r.mu.Unlock()
}

// take returns the counts since the last take.
func (r *callCounts) take() map[string]int {
	r.mu.Lock()
	defer r.mu.Unlock()
	n := maps.Clone(r.n)
	clear(r.n)
	return n
}

func (r *callCounts) StreamWaitEvent(dev int, s cudart.Stream, e cudart.Event) error {
	r.count("StreamWaitEvent")
	return r.Runtime.StreamWaitEvent(dev, s, e)
}

func (r *callCounts) EventRecord(dev int, e cudart.Event, s cudart.Stream) error {
	r.count("EventRecord")
	return r.Runtime.EventRecord(dev, e, s)
}

func (r *callCounts) EventQuery(dev int, e cudart.Event) (bool, error) {
	r.count("EventQuery")
	return r.Runtime.EventQuery(dev, e)
}

func (r *callCounts) StreamSynchronize(dev int, s cudart.Stream) error {
	r.count("StreamSynchronize")
	return r.Runtime.StreamSynchronize(dev, s)
}

func (r *callCounts) FreeAsync(dev int, ptr cudart.DevicePtr, s cudart.Stream) error {
	r.count("FreeAsync")
	return r.Runtime.FreeAsync(dev, ptr, s)
}

func (r *callCounts) MemPoolImportPointer(dev int, p cudart.MemPool, d cudart.PtrExportData) (cudart.DevicePtr, error) {
	r.count("MemPoolImportPointer")
	return r.Runtime.MemPoolImportPointer(dev, p, d)
}

func (r *callCounts) MemPoolExportPointer(dev int, ptr cudart.DevicePtr) (cudart.PtrExportData, error) {
	r.count("MemPoolExportPointer")
	return r.Runtime.MemPoolExportPointer(dev, ptr)
}

func (r *callCounts) MallocFromPoolAsync(dev int, size uint64, p cudart.MemPool, s cudart.Stream) (cudart.DevicePtr, error) {
	r.count("MallocFromPoolAsync")
	return r.Runtime.MallocFromPoolAsync(dev, size, p, s)
}

// countedPair is a producer and a consumer whose runtimes count their calls.
type countedPair struct {
	pr      *producer
	prCalls *callCounts
	c       *testConsumer
	cCalls  *callCounts
}

func newCountedPair(t *testing.T, poolOpts []pool.Option, exOpts ...ListenOption) countedPair {
	t.Helper()
	var prCalls *callCounts
	wrap := func(rt cudart.Runtime) cudart.Runtime {
		prCalls = newCallCounts(rt)
		return prCalls
	}
	pr := newProducerOn(t, wrap, poolOpts, exOpts)
	s := newSide(t, 0)
	cCalls := newCallCounts(s.dev)
	imp, err := consumer.Dial(testCtx(t), pr.path, cCalls, 0, consumer.WithLogger(discardLogger))
	require.NoError(t, err)
	t.Cleanup(func() { imp.Close(context.Background()) })
	return countedPair{pr: pr, prCalls: prCalls, c: &testConsumer{side: s, imp: imp}, cCalls: cCalls}
}

// frames returns the frames the exporter has received and sent, as the consumer
// counted them: its requests, and the answers it has read (and so waited for).
func (cp countedPair) frames() (received, sent int64) {
	c := inspect.Client(cp.c.imp).C
	return c.Sent.Load(), c.Received.Load()
}

// awaitFrees waits until the consumer's frees and releases so far have completed, as they
// have long before a producer recycles a buffer in steady state.
func (cp countedPair) awaitFrees(t *testing.T) {
	t.Helper()
	require.NoError(t, cp.c.dev.StreamSynchronize(0, inspect.ReleaseStream(cp.c.imp)))
	require.NoError(t, cp.c.dev.StreamSynchronize(0, cp.c.stream))
}

// Recycled 2 MiB buffers shared with a consumer that retains its imports, round after
// round as the benchmark suite's recycled row does: after the first round a share is
// one Open and one Release, each one request and one answer; the exporter makes no
// runtime call for it (no wait on the consumer's release event at each Release: the
// pool asks for it when the buffer is freed); the consumer imports, frees and
// synchronises nothing; and recycling the buffers once the consumer's work is done
// costs the producer no wait either.
func TestRecycledShareCosts(t *testing.T) {
	cp := newCountedPair(t, []pool.Option{pool.WithCache(64 << 20)}, WithRetainedImports())
	ctx := testCtx(t)
	const ring, turns = 4, 3
	for round := range 3 {
		bufs := make([]*pool.Buffer, ring)
		for i := range bufs {
			bufs[i] = cp.pr.publish(t, fmt.Sprintf("r%d-%d", round, i), 2<<20, byte(round*ring+i+1))
		}
		cp.prCalls.take()
		cp.cCalls.take()
		received, sent := cp.frames()
		for n := range ring * turns {
			i := n % ring
			m, err := cp.c.imp.Open(ctx, fmt.Sprintf("r%d-%d", round, i), cp.c.stream)
			require.NoError(t, err)
			if n < ring {
				require.True(t, allAre(cp.c.read(t, m), byte(round*ring+i+1)), "round %d buffer %d: not this round's bytes", round, i)
			}
			require.NoError(t, m.Release(ctx, cp.c.stream))
		}
		shares := ring * turns
		r2, s2 := cp.frames()
		assert.Empty(t, cp.prCalls.take(), "round %d: the exporter's runtime calls for %d shares", round, shares)
		c := cp.cCalls.take()
		if round > 0 { // the first also sends the pool's handle, and imports
			assert.Equal(t, int64(2*shares), r2-received, "round %d: frames the exporter received (Open, Release per share)", round)
			assert.Equal(t, int64(2*shares), s2-sent, "round %d: frames the exporter sent (Lease, Released per share)", round)
			for _, call := range []string{"MemPoolImportPointer", "FreeAsync", "StreamSynchronize"} {
				assert.Zero(t, c[call], "round %d: the consumer's %s", round, call)
			}
			// The copies that checked the bytes synchronised the consumer's stream: at
			// most one wait on the ready event, after that a query.
			assert.LessOrEqual(t, c["EventQuery"], shares, "round %d: the consumer's queries of the ready event", round)
			assert.LessOrEqual(t, c["StreamWaitEvent"], 2*shares, "round %d: the consumer's waits (ready event, release ordering)", round)
			assert.Equal(t, 2*shares, c["EventRecord"], "round %d: the consumer's records (release ordering, release event)", round)
		}

		cp.awaitFrees(t)
		for i, b := range bufs {
			require.NoError(t, cp.pr.ex.Unpublish(fmt.Sprintf("r%d-%d", round, i)))
			require.NoError(t, b.Free(cp.pr.stream))
		}
		p := cp.prCalls.take()
		assert.Zero(t, p["StreamWaitEvent"], "round %d: recycling waited on the release stream or on a completed release event", round)
		assert.Zero(t, p["FreeAsync"], "round %d: recycling freed memory", round)
		assert.Equal(t, ring, p["EventQuery"], "round %d: one question of the consumer's release event per buffer", round)
	}
	s := poolStats(t, cp.pr.pool)
	assert.Equal(t, uint64(2*ring), s.CacheHits, "the buffers after the first round came from the cache")
	cp.pr.checkClean(t)
	cp.c.checkClean(t)
}

// A batch of 64 blocks of one slab, opened with OpenAll and released with ReleaseAll
// by a consumer that holds another block of the slab (as a serving consumer does): one
// request and one answer each way, no runtime call in the exporter, and in the
// consumer one question of the ready event for the batch and one release event
// recorded for it, no import, free or synchronisation.
func TestBlockBatchCosts(t *testing.T) {
	cp := newCountedPair(t, nil)
	ctx := testCtx(t)
	const n, block = 65, 64 << 10
	rp := retainingPair{pr: cp.pr}
	slab, names := rp.slab(t, n, block, 0)
	held, err := cp.c.imp.Open(ctx, names[n-1], cp.c.stream)
	require.NoError(t, err)
	cp.awaitFrees(t)
	for round := range 3 {
		cp.prCalls.take()
		cp.cCalls.take()
		received, sent := cp.frames()
		ms, err := cp.c.imp.OpenAll(ctx, names[:n-1], cp.c.stream)
		require.NoError(t, err)
		if round == 0 {
			for i, m := range ms {
				require.True(t, allAre(cp.c.read(t, m), byte(i+1)), "block %d read other bytes", i)
			}
			cp.cCalls.take()
		}
		require.NoError(t, cp.c.imp.ReleaseAll(ctx, ms, cp.c.stream))
		r2, s2 := cp.frames()
		assert.Equal(t, int64(2), r2-received, "round %d: frames the exporter received (OpenBatch, ReleaseBatch)", round)
		assert.Equal(t, int64(2), s2-sent, "round %d: frames the exporter sent (LeaseBatch, Released)", round)
		assert.Empty(t, cp.prCalls.take(), "round %d: the exporter's runtime calls for a batch", round)
		c := cp.cCalls.take()
		if round > 0 {
			assert.Equal(t, map[string]int{"EventQuery": 1, "StreamWaitEvent": c["StreamWaitEvent"], "EventRecord": 1},
				c, "round %d: the consumer's calls for a batch", round)
			assert.LessOrEqual(t, c["StreamWaitEvent"], 2, "round %d: the consumer's waits (ready event, release ordering)", round)
		}
	}
	require.NoError(t, held.Release(ctx, cp.c.stream))
	require.NoError(t, slab.Free(cp.pr.stream))
	cp.pr.checkClean(t)
	cp.c.checkClean(t)
}

// ReleaseAll of whole buffers, whose imports it frees: the caller's stream ordered
// once and the release event recorded once for all of them.
func TestWholeBufferBatchCosts(t *testing.T) {
	cp := newCountedPair(t, nil)
	ctx := testCtx(t)
	const n = 8
	names := make([]string, n)
	for i := range names {
		names[i] = fmt.Sprintf("whole-%d", i)
		cp.pr.publish(t, names[i], 2<<20, byte(i+1))
	}
	ms, err := cp.c.imp.OpenAll(ctx, names, cp.c.stream)
	require.NoError(t, err)
	cp.cCalls.take()
	require.NoError(t, cp.c.imp.ReleaseAll(ctx, ms, cp.c.stream))
	c := cp.cCalls.take()
	assert.Equal(t, map[string]int{"EventRecord": 2, "StreamWaitEvent": 1, "FreeAsync": n}, c,
		"the consumer's calls: one ordering of the release stream, %d frees, one release event", n)
	cp.c.checkClean(t)
}

// A block released while another block of its slab keeps the import: its Release
// still orders the release stream after the caller's stream, so that the import's
// free, whichever Release issues it on whichever stream, follows this block's use too.
// (It did not: a block written on a busy stream and released, then another released on
// an idle stream, had the import freed under the busy stream's write.)
func TestRangeReleaseOrdersTheImportsFree(t *testing.T) {
	pr := newProducer(t, nil, nil)
	ctx := testCtx(t)
	rp := retainingPair{pr: pr}
	_, names := rp.slab(t, 2, 64<<10, 0)
	c := newConsumer(t, pr.path, 0)
	other, err := c.dev.StreamCreate(0, cudart.StreamNonBlocking)
	require.NoError(t, err)
	busy, err := c.imp.Open(ctx, names[0], c.stream)
	require.NoError(t, err)
	last, err := c.imp.Open(ctx, names[1], other)
	require.NoError(t, err)
	require.NoError(t, c.dev.StreamSynchronize(0, c.stream)) // the ready waits are done
	resume := stall(t, c.side)
	// The busy stream's last use of its block, still queued when the block is released.
	require.NoError(t, c.dev.MemsetAsync(0, busy.Ptr(), 0x5a, busy.Size(), c.stream))
	require.NoError(t, busy.Release(ctx, c.stream))
	require.NoError(t, last.Release(ctx, other)) // frees the import on the release stream
	require.NoError(t, c.dev.Err(), "the import was freed before the busy stream's use of it")
	resume()
	require.NoError(t, c.dev.Synchronize(), "the import was freed before the busy stream's use of it")
	c.checkClean(t)
}
