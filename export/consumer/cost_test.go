package consumer_test

import (
	"context"
	"fmt"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/cudapool/cudapool/cudart"
	"github.com/cudapool/cudapool/export/consumer"
	"github.com/cudapool/cudapool/export/internal/exporttest"
	"github.com/cudapool/cudapool/export/producer"
	"github.com/cudapool/cudapool/internal/intercept"
	"github.com/cudapool/cudapool/pool"
)

// callCounts counts the calls a share may make, by name.
type callCounts struct {
	*intercept.Runtime
	last map[string]int64
}

func newCallCounts(rt cudart.Runtime) *callCounts {
	return &callCounts{Runtime: intercept.Wrap(rt), last: map[string]int64{}}
}

// counted are the calls callCounts reports.
func (r *callCounts) counted() []intercept.Method {
	on := &r.On
	return []intercept.Method{&on.StreamWaitEvent, &on.EventRecord, &on.EventQuery, &on.StreamSynchronize, &on.FreeAsync, &on.MemPoolImportPointer, &on.MemPoolExportPointer, &on.MallocFromPoolAsync}
}

// take returns the counts since the last take, of the calls made, by method name.
func (r *callCounts) take() map[string]int {
	n := map[string]int{}
	for _, m := range r.counted() {
		c := m.Calls()
		if d := c - r.last[m.Name()]; d > 0 {
			n[m.Name()] = int(d)
		}
		r.last[m.Name()] = c
	}
	return n
}

// countedPair is a producer and a consumer whose runtimes count their calls.
type countedPair struct {
	pr      *exporttest.Producer
	prCalls *callCounts
	c       *exporttest.Consumer
	cCalls  *callCounts
}

func newCountedPair(t *testing.T, poolOpts []pool.Option, exOpts ...producer.ListenOption) countedPair {
	t.Helper()
	var prCalls *callCounts
	wrap := func(rt cudart.Runtime) cudart.Runtime {
		prCalls = newCallCounts(rt)
		return prCalls
	}
	pr := exporttest.NewProducerOn(t, wrap, poolOpts, exOpts)
	s := exporttest.NewSide(t, 0)
	cCalls := newCallCounts(s.Dev)
	imp, err := consumer.Dial(exporttest.Ctx(t), pr.Path, cCalls, 0, consumer.WithLogger(exporttest.DiscardLogger))
	require.NoError(t, err)
	t.Cleanup(func() { imp.Close(context.Background()) })
	return countedPair{pr: pr, prCalls: prCalls, c: &exporttest.Consumer{Side: s, Imp: imp}, cCalls: cCalls}
}

// frames returns the frames the exporter has received and sent, as the consumer
// counted them: its requests, and the answers it has read (and so waited for).
func (cp countedPair) frames() (received, sent int64) {
	c := consumer.Client(cp.c.Imp).C
	return c.Sent(), c.Received.Load()
}

// awaitFrees waits until the consumer's frees and releases so far have completed, as they
// have long before a producer recycles a buffer in steady state.
func (cp countedPair) awaitFrees(t *testing.T) {
	t.Helper()
	require.NoError(t, cp.c.Dev.StreamSynchronize(0, consumer.ReleaseStream(cp.c.Imp)))
	require.NoError(t, cp.c.Dev.StreamSynchronize(0, cp.c.Stream))
}

// Recycled 2 MiB buffers shared with a consumer that retains its imports, round after
// round as the benchmark suite's recycled row does: after the first round a share is
// one Open and one Release, each one request and one answer; the exporter makes no
// runtime call for it (no wait on the consumer's release event at each Release: the
// pool asks for it when the buffer is freed); the consumer imports, frees and
// synchronises nothing; and recycling the buffers once the consumer's work is done
// costs the producer no wait either.
func TestRecycledShareCosts(t *testing.T) {
	cp := newCountedPair(t, []pool.Option{pool.WithCache(64 << 20)}, producer.WithRetainedImports())
	ctx := exporttest.Ctx(t)
	const ring, turns = 4, 3
	for round := range 3 {
		bufs := make([]*pool.Buffer, ring)
		for i := range bufs {
			bufs[i] = cp.pr.Publish(t, fmt.Sprintf("r%d-%d", round, i), 2<<20, byte(round*ring+i+1))
		}
		cp.prCalls.take()
		cp.cCalls.take()
		received, sent := cp.frames()
		for n := range ring * turns {
			i := n % ring
			m, err := cp.c.Imp.Open(ctx, fmt.Sprintf("r%d-%d", round, i), cp.c.Stream)
			require.NoError(t, err)
			if n < ring {
				require.True(t, exporttest.AllAre(cp.c.Read(t, m), byte(round*ring+i+1)), "round %d buffer %d: not this round's bytes", round, i)
			}
			require.NoError(t, m.Release(ctx, cp.c.Stream))
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
			require.NoError(t, cp.pr.Ex.Unpublish(fmt.Sprintf("r%d-%d", round, i)))
			require.NoError(t, b.Free(cp.pr.Stream))
		}
		p := cp.prCalls.take()
		assert.Zero(t, p["StreamWaitEvent"], "round %d: recycling waited on the release stream or on a completed release event", round)
		assert.Zero(t, p["FreeAsync"], "round %d: recycling freed memory", round)
		assert.Equal(t, ring, p["EventQuery"], "round %d: one question of the consumer's release event per buffer", round)
	}
	s := exporttest.PoolStats(t, cp.pr.Pool)
	assert.Equal(t, uint64(2*ring), s.CacheHits, "the buffers after the first round came from the cache")
	cp.pr.CheckClean(t)
	cp.c.CheckClean(t)
}

// A batch of 64 blocks of one slab, opened with OpenAll and released with ReleaseAll
// by a consumer that holds another block of the slab (as a serving consumer does): one
// request and one answer each way, no runtime call in the exporter, and in the
// consumer one question of the ready event for the batch and one release event
// recorded for it, no import, free or synchronisation.
func TestBlockBatchCosts(t *testing.T) {
	cp := newCountedPair(t, nil)
	ctx := exporttest.Ctx(t)
	const n, block = 65, 64 << 10
	rp := exporttest.RetainingPair{Pr: cp.pr}
	slab, names := rp.Slab(t, n, block, 0)
	held, err := cp.c.Imp.Open(ctx, names[n-1], cp.c.Stream)
	require.NoError(t, err)
	cp.awaitFrees(t)
	for round := range 3 {
		cp.prCalls.take()
		cp.cCalls.take()
		received, sent := cp.frames()
		ms, err := cp.c.Imp.OpenAll(ctx, names[:n-1], cp.c.Stream)
		require.NoError(t, err)
		if round == 0 {
			for i, m := range ms {
				require.True(t, exporttest.AllAre(cp.c.Read(t, m), byte(i+1)), "block %d read other bytes", i)
			}
			cp.cCalls.take()
		}
		require.NoError(t, cp.c.Imp.ReleaseAll(ctx, ms, cp.c.Stream))
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
	require.NoError(t, held.Release(ctx, cp.c.Stream))
	require.NoError(t, slab.Free(cp.pr.Stream))
	cp.pr.CheckClean(t)
	cp.c.CheckClean(t)
}

// ReleaseAll of whole buffers, whose imports it frees: the caller's stream ordered
// once and the release event recorded once for all of them.
func TestWholeBufferBatchCosts(t *testing.T) {
	cp := newCountedPair(t, nil)
	ctx := exporttest.Ctx(t)
	const n = 8
	names := make([]string, n)
	for i := range names {
		names[i] = fmt.Sprintf("whole-%d", i)
		cp.pr.Publish(t, names[i], 2<<20, byte(i+1))
	}
	ms, err := cp.c.Imp.OpenAll(ctx, names, cp.c.Stream)
	require.NoError(t, err)
	cp.cCalls.take()
	require.NoError(t, cp.c.Imp.ReleaseAll(ctx, ms, cp.c.Stream))
	c := cp.cCalls.take()
	assert.Equal(t, map[string]int{"EventRecord": 2, "StreamWaitEvent": 1, "FreeAsync": n}, c,
		"the consumer's calls: one ordering of the release stream, %d frees, one release event", n)
	cp.c.CheckClean(t)
}
