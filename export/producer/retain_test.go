package producer

import (
	"context"
	"sync/atomic"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/cudapool/cudapool/cudart"
	"github.com/cudapool/cudapool/export/consumer"
	"github.com/cudapool/cudapool/export/internal/inspect"
	"github.com/cudapool/cudapool/internal/testwait"
	"github.com/cudapool/cudapool/pool"
)

// importCounter counts the calls that a retained import saves: imports and frees of
// pointers, and exports of them.
type importCounter struct {
	cudart.Runtime
	imports, frees, exports atomic.Int64
}

func (r *importCounter) MemPoolImportPointer(dev int, p cudart.MemPool, d cudart.PtrExportData) (cudart.DevicePtr, error) {
	r.imports.Add(1)
	return r.Runtime.MemPoolImportPointer(dev, p, d)
}

func (r *importCounter) FreeAsync(dev int, ptr cudart.DevicePtr, s cudart.Stream) error {
	r.frees.Add(1)
	return r.Runtime.FreeAsync(dev, ptr, s)
}

func (r *importCounter) MemPoolExportPointer(dev int, ptr cudart.DevicePtr) (cudart.PtrExportData, error) {
	r.exports.Add(1)
	return r.Runtime.MemPoolExportPointer(dev, ptr)
}

// retainingPair is a producer whose pool caches and whose exporter lets consumers
// retain imports, and a consumer whose runtime counts imports and frees.
type retainingPair struct {
	pr      *producer
	prCalls *importCounter
	c       *testConsumer
	cCalls  *importCounter
}

func newRetainingPair(t *testing.T, exOpts ...ListenOption) retainingPair {
	t.Helper()
	var prCalls *importCounter
	wrap := func(rt cudart.Runtime) cudart.Runtime {
		prCalls = &importCounter{Runtime: rt}
		return prCalls
	}
	pr := newProducerOn(t, wrap, []pool.Option{pool.WithCache(64 << 20)}, exOpts)
	s := newSide(t, 0)
	cCalls := &importCounter{Runtime: s.dev}
	imp, err := consumer.Dial(testCtx(t), pr.path, cCalls, 0, consumer.WithLogger(discardLogger))
	require.NoError(t, err)
	t.Cleanup(func() { imp.Close(context.Background()) })
	return retainingPair{pr: pr, prCalls: prCalls, c: &testConsumer{side: s, imp: imp}, cCalls: cCalls}
}

// cycle publishes a buffer filled with fill under name, has the consumer open it,
// check its bytes and release it, and has the producer unpublish and free it.
func (rp retainingPair) cycle(t *testing.T, name string, fill byte) *pool.Buffer {
	t.Helper()
	ctx := testCtx(t)
	b := rp.pr.publish(t, name, 2<<20, fill)
	m, err := rp.c.imp.Open(ctx, name, rp.c.stream)
	require.NoError(t, err)
	require.True(t, allAre(rp.c.read(t, m), fill), "the consumer did not read the bytes of this lease (%#x)", fill)
	require.NoError(t, m.Release(ctx, rp.c.stream))
	require.NoError(t, rp.pr.ex.Unpublish(name))
	require.NoError(t, b.Free(rp.pr.stream))
	return b
}

func poolStats(t *testing.T, p *pool.Pool) pool.Stats {
	t.Helper()
	s, err := p.Stats()
	require.NoError(t, err)
	return s
}

// A recycled buffer shared again with a consumer that retained its import: one
// export, one import, no free until the producer wants the memory back, and each
// lease reads the new contents.
func TestRetainedImportServesRecycledBuffers(t *testing.T) {
	rp := newRetainingPair(t, WithRetainedImports())
	first := rp.cycle(t, "kv", 0x11)
	for i, fill := range []byte{0x22, 0x33, 0x44} {
		b := rp.cycle(t, "kv", fill)
		require.Equal(t, first.Ptr(), b.Ptr(), "round %d: the buffer was not recycled", i)
	}
	assert.Equal(t, int64(1), rp.prCalls.exports.Load(), "pointer exports")
	assert.Equal(t, int64(1), rp.cCalls.imports.Load(), "consumer imports")
	assert.Zero(t, rp.cCalls.frees.Load(), "consumer frees before the revoke")
	s := poolStats(t, rp.pr.pool)
	assert.Equal(t, 1, s.Retentions)
	assert.Equal(t, 1, s.CachedBuffers)

	// The producer wants the memory back: the consumer frees its import first.
	require.NoError(t, rp.pr.pool.Trim())
	waitFor(t, "the revoked import to be freed and the memory with it", func() bool {
		s := poolStats(t, rp.pr.pool)
		return s.Retentions == 0 && s.RevokingBuffers == 0
	})
	assert.Equal(t, int64(1), rp.cCalls.frees.Load(), "consumer frees after the revoke")
	rp.pr.checkClean(t)
	rp.c.checkClean(t)
	require.NoError(t, rp.c.imp.Close(testCtx(t)))
	require.NoError(t, rp.pr.ex.Close(testCtx(t)))
	_, err := rp.pr.pool.Close(testCtx(t))
	require.NoError(t, err)
}

// Without WithRetainedImports every release frees the import, as before.
func TestImportsAreNotRetainedUnlessAllowed(t *testing.T) {
	rp := newRetainingPair(t)
	rp.cycle(t, "kv", 0x11)
	rp.cycle(t, "kv", 0x22)
	assert.Equal(t, int64(2), rp.cCalls.imports.Load(), "consumer imports")
	assert.Equal(t, int64(2), rp.cCalls.frees.Load(), "consumer frees")
	assert.Zero(t, poolStats(t, rp.pr.pool).Retentions)
	rp.c.checkClean(t)
}

// Exporter.Close revokes what consumers retain and waits for them to let go.
func TestExporterCloseRevokesRetainedImports(t *testing.T) {
	rp := newRetainingPair(t, WithRetainedImports())
	rp.cycle(t, "kv", 0x11)
	require.Equal(t, 1, poolStats(t, rp.pr.pool).Retentions)
	require.NoError(t, rp.pr.ex.Close(testCtx(t)))
	assert.Zero(t, poolStats(t, rp.pr.pool).Retentions)
	assert.Equal(t, int64(1), rp.cCalls.frees.Load(), "the consumer did not free its retained import")
	_, err := rp.pr.pool.Close(testCtx(t))
	require.NoError(t, err)
	rp.pr.checkClean(t)
	rp.c.checkClean(t)
}

// A consumer that closes frees what it retains, and its retentions end.
func TestImporterCloseEndsRetentions(t *testing.T) {
	rp := newRetainingPair(t, WithRetainedImports())
	rp.cycle(t, "kv", 0x11)
	require.NoError(t, rp.c.imp.Close(testCtx(t)))
	waitFor(t, "the departed consumer's retention to end", func() bool {
		return poolStats(t, rp.pr.pool).Retentions == 0
	})
	require.NoError(t, rp.pr.pool.Trim())
	assert.Zero(t, poolStats(t, rp.pr.pool).RevokingBuffers)
	rp.pr.checkClean(t)
	rp.c.checkClean(t)
}

// A buffer freed while its lease is live reaches the cache when the consumer releases
// (retaining its import); a Trim then revokes the import, and the software device sees
// it freed before the memory.
func TestRetainedBufferFreedPastTheCache(t *testing.T) {
	rp := newRetainingPair(t, WithRetainedImports())
	ctx := testCtx(t)
	b := rp.pr.publish(t, "big", 2<<20, 0x55)
	m, err := rp.c.imp.Open(ctx, "big", rp.c.stream)
	require.NoError(t, err)
	require.NoError(t, b.Free(rp.pr.stream)) // deferred: the lease is live
	require.NoError(t, m.Release(ctx, rp.c.stream))
	require.NoError(t, rp.pr.pool.Trim())
	waitFor(t, "the retained memory to go back to the driver", func() bool {
		s := poolStats(t, rp.pr.pool)
		return s.Retentions == 0 && s.RevokingBuffers == 0 && s.CachedBuffers == 0
	})
	assert.Equal(t, int64(1), rp.cCalls.frees.Load())
	rp.pr.checkClean(t)
	rp.c.checkClean(t)
}

// Ranges of one buffer share its import: the import is kept when the last of their
// Mappings is released, and a new lease on any range of the recycled buffer finds it.
func TestRetainedImportOfRanges(t *testing.T) {
	rp := newRetainingPair(t, WithRetainedImports())
	ctx := testCtx(t)
	const half = 1 << 20
	for round, fill := range []byte{0x61, 0x62} {
		b, err := rp.pr.pool.Alloc(ctx, 2*half, rp.pr.stream)
		require.NoError(t, err)
		require.NoError(t, rp.pr.dev.MemsetAsync(0, b.Ptr(), fill, 2*half, rp.pr.stream))
		require.NoError(t, rp.pr.ex.Publish(ctx, "lo", b, rp.pr.stream, Range(0, half)))
		require.NoError(t, rp.pr.ex.Publish(ctx, "hi", b, rp.pr.stream, Range(half, half)))
		lo, err := rp.c.imp.Open(ctx, "lo", rp.c.stream)
		require.NoError(t, err)
		hi, err := rp.c.imp.Open(ctx, "hi", rp.c.stream)
		require.NoError(t, err)
		require.Equal(t, lo.Ptr()+half, hi.Ptr(), "round %d", round)
		require.True(t, allAre(rp.c.read(t, hi), fill), "round %d: the consumer read old bytes", round)
		require.NoError(t, lo.Release(ctx, rp.c.stream))
		assert.Equal(t, round, poolStats(t, rp.pr.pool).Retentions, "round %d: retained while a range was still open", round)
		require.NoError(t, hi.Release(ctx, rp.c.stream))
		assert.Equal(t, 1, poolStats(t, rp.pr.pool).Retentions, "round %d", round)
		require.NoError(t, rp.pr.ex.Unpublish("lo"))
		require.NoError(t, rp.pr.ex.Unpublish("hi"))
		require.NoError(t, b.Free(rp.pr.stream))
	}
	assert.Equal(t, int64(1), rp.cCalls.imports.Load(), "consumer imports")
	assert.Zero(t, rp.cCalls.frees.Load(), "consumer frees")
	require.NoError(t, rp.pr.pool.Trim())
	waitFor(t, "the revoke", func() bool { return poolStats(t, rp.pr.pool).Retentions == 0 })
	rp.pr.checkClean(t)
	rp.c.checkClean(t)
}

// A revoked retention ends only after the consumer's free of the import has run: with
// the Importer's release stream stalled across the Trim, the pool frees the memory
// after that free, and the software device sees no memory freed under an import.
func TestRevokedRetentionWaitsForTheConsumersFree(t *testing.T) {
	rp := newRetainingPair(t, WithRetainedImports())
	rp.cycle(t, "kv", 0x11)
	require.Equal(t, 1, poolStats(t, rp.pr.pool).Retentions)
	resume, err := rp.c.dev.Stall(rp.c.ord, inspect.ReleaseStream(rp.c.imp))
	require.NoError(t, err)
	t.Cleanup(resume)
	require.NoError(t, rp.pr.pool.Trim()) // revokes; the consumer's free waits for the stall
	waitFor(t, "the revoke to be answered", func() bool { return poolStats(t, rp.pr.pool).Retentions == 0 })
	resume()
	waitFor(t, "the memory to go back", func() bool {
		s := poolStats(t, rp.pr.pool)
		return s.RevokingBuffers == 0 && s.UsedCurrent == 0
	})
	require.NoError(t, rp.pr.dev.StreamSynchronize(rp.pr.ord, 0))
	rp.pr.checkClean(t)
	rp.c.checkClean(t)
}

// A revoke that arrives while the retained import is mapped again (leased anew) is
// answered once that mapping is released: Exporter.Close, which revokes, returns then.
func TestRevokeWhileMappedAgainIsAnsweredAtRelease(t *testing.T) {
	rp := newRetainingPair(t, WithRetainedImports())
	ctx := testCtx(t)
	rp.cycle(t, "kv", 0x11)
	b := rp.pr.publish(t, "kv", 2<<20, 0x22) // the recycled memory
	m, err := rp.c.imp.Open(ctx, "kv", rp.c.stream)
	require.NoError(t, err)
	assert.Equal(t, int64(1), rp.cCalls.imports.Load(), "the retained import mapped again")
	require.NoError(t, rp.pr.ex.Unpublish("kv"))
	require.NoError(t, b.Free(rp.pr.stream))
	closed := make(chan error, 1)
	go func() { closed <- rp.pr.ex.Close(ctx) }()
	waitFor(t, "the revoke to reach the mapped import", func() bool { return inspect.RevokedMapped(rp.c.imp) == 1 })
	assert.Equal(t, 1, poolStats(t, rp.pr.pool).Retentions, "the retention, held while mapped")
	require.NoError(t, m.Release(ctx, rp.c.stream))
	require.NoError(t, testwait.Recv(t, closed, "Close to return once the mapping was released"))
	assert.Zero(t, poolStats(t, rp.pr.pool).Retentions)
	assert.Equal(t, int64(1), rp.cCalls.frees.Load(), "the consumer freed its import at the release")
	rp.pr.checkClean(t)
	rp.c.checkClean(t)
}
