package e2e_test

import (
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/cudapool/cudapool/export/internal/exporttest"
	"github.com/cudapool/cudapool/export/producer"
)

// A recycled buffer shared again with a consumer that retained its import: one
// export, one import, no free until the producer wants the memory back, and each
// lease reads the new contents.
func TestRetainedImportServesRecycledBuffers(t *testing.T) {
	rp := exporttest.NewRetainingPair(t, producer.WithRetainedImports())
	first := rp.Cycle(t, "kv", 0x11)
	for i, fill := range []byte{0x22, 0x33, 0x44} {
		b := rp.Cycle(t, "kv", fill)
		require.Equal(t, first.Ptr(), b.Ptr(), "round %d: the buffer was not recycled", i)
	}
	assert.Equal(t, int64(1), rp.PrCalls.Exports(), "pointer exports")
	assert.Equal(t, int64(1), rp.CCalls.Imports(), "consumer imports")
	assert.Zero(t, rp.CCalls.Frees(), "consumer frees before the revoke")
	s := exporttest.PoolStats(t, rp.Pr.Pool)
	assert.Equal(t, 1, s.Retentions)
	assert.Equal(t, 1, s.CachedBuffers)

	// The producer wants the memory back: the consumer frees its import first.
	require.NoError(t, rp.Pr.Pool.Trim())
	exporttest.WaitFor(t, "the revoked import to be freed and the memory with it", func() bool {
		s := exporttest.PoolStats(t, rp.Pr.Pool)
		return s.Retentions == 0 && s.RevokingBuffers == 0
	})
	assert.Equal(t, int64(1), rp.CCalls.Frees(), "consumer frees after the revoke")
	rp.Pr.CheckClean(t)
	rp.C.CheckClean(t)
	require.NoError(t, rp.C.Imp.Close(exporttest.Ctx(t)))
	require.NoError(t, rp.Pr.Ex.Close(exporttest.Ctx(t)))
	_, err := rp.Pr.Pool.Close(exporttest.Ctx(t))
	require.NoError(t, err)
}

// Without WithRetainedImports every release frees the import, as before.
func TestImportsAreNotRetainedUnlessAllowed(t *testing.T) {
	rp := exporttest.NewRetainingPair(t)
	rp.Cycle(t, "kv", 0x11)
	rp.Cycle(t, "kv", 0x22)
	assert.Equal(t, int64(2), rp.CCalls.Imports(), "consumer imports")
	assert.Equal(t, int64(2), rp.CCalls.Frees(), "consumer frees")
	assert.Zero(t, exporttest.PoolStats(t, rp.Pr.Pool).Retentions)
	rp.C.CheckClean(t)
}

// Exporter.Close revokes what consumers retain and waits for them to let go.
func TestExporterCloseRevokesRetainedImports(t *testing.T) {
	rp := exporttest.NewRetainingPair(t, producer.WithRetainedImports())
	rp.Cycle(t, "kv", 0x11)
	require.Equal(t, 1, exporttest.PoolStats(t, rp.Pr.Pool).Retentions)
	require.NoError(t, rp.Pr.Ex.Close(exporttest.Ctx(t)))
	assert.Zero(t, exporttest.PoolStats(t, rp.Pr.Pool).Retentions)
	assert.Equal(t, int64(1), rp.CCalls.Frees(), "the consumer did not free its retained import")
	_, err := rp.Pr.Pool.Close(exporttest.Ctx(t))
	require.NoError(t, err)
	rp.Pr.CheckClean(t)
	rp.C.CheckClean(t)
}

// A consumer that closes frees what it retains, and its retentions end.
func TestImporterCloseEndsRetentions(t *testing.T) {
	rp := exporttest.NewRetainingPair(t, producer.WithRetainedImports())
	rp.Cycle(t, "kv", 0x11)
	require.NoError(t, rp.C.Imp.Close(exporttest.Ctx(t)))
	exporttest.WaitFor(t, "the departed consumer's retention to end", func() bool {
		return exporttest.PoolStats(t, rp.Pr.Pool).Retentions == 0
	})
	require.NoError(t, rp.Pr.Pool.Trim())
	assert.Zero(t, exporttest.PoolStats(t, rp.Pr.Pool).RevokingBuffers)
	rp.Pr.CheckClean(t)
	rp.C.CheckClean(t)
}

// A buffer freed while its lease is live reaches the cache when the consumer releases
// (retaining its import); a Trim then revokes the import, and the software device sees
// it freed before the memory.
func TestRetainedBufferFreedPastTheCache(t *testing.T) {
	rp := exporttest.NewRetainingPair(t, producer.WithRetainedImports())
	ctx := exporttest.Ctx(t)
	b := rp.Pr.Publish(t, "big", 2<<20, 0x55)
	m, err := rp.C.Imp.Open(ctx, "big", rp.C.Stream)
	require.NoError(t, err)
	require.NoError(t, b.Free(rp.Pr.Stream)) // deferred: the lease is live
	require.NoError(t, m.Release(ctx, rp.C.Stream))
	require.NoError(t, rp.Pr.Pool.Trim())
	exporttest.WaitFor(t, "the retained memory to go back to the driver", func() bool {
		s := exporttest.PoolStats(t, rp.Pr.Pool)
		return s.Retentions == 0 && s.RevokingBuffers == 0 && s.CachedBuffers == 0
	})
	assert.Equal(t, int64(1), rp.CCalls.Frees())
	rp.Pr.CheckClean(t)
	rp.C.CheckClean(t)
}

// Ranges of one buffer share its import: the import is kept when the last of their
// Mappings is released, and a new lease on any range of the recycled buffer finds it.
func TestRetainedImportOfRanges(t *testing.T) {
	rp := exporttest.NewRetainingPair(t, producer.WithRetainedImports())
	ctx := exporttest.Ctx(t)
	const half = 1 << 20
	for round, fill := range []byte{0x61, 0x62} {
		b, err := rp.Pr.Pool.Alloc(ctx, 2*half, rp.Pr.Stream)
		require.NoError(t, err)
		require.NoError(t, rp.Pr.Dev.MemsetAsync(0, b.Ptr(), fill, 2*half, rp.Pr.Stream))
		require.NoError(t, rp.Pr.Ex.Publish(ctx, "lo", b, rp.Pr.Stream, producer.Range(0, half)))
		require.NoError(t, rp.Pr.Ex.Publish(ctx, "hi", b, rp.Pr.Stream, producer.Range(half, half)))
		lo, err := rp.C.Imp.Open(ctx, "lo", rp.C.Stream)
		require.NoError(t, err)
		hi, err := rp.C.Imp.Open(ctx, "hi", rp.C.Stream)
		require.NoError(t, err)
		require.Equal(t, lo.Ptr()+half, hi.Ptr(), "round %d", round)
		require.True(t, exporttest.AllAre(rp.C.Read(t, hi), fill), "round %d: the consumer read old bytes", round)
		require.NoError(t, lo.Release(ctx, rp.C.Stream))
		assert.Equal(t, round, exporttest.PoolStats(t, rp.Pr.Pool).Retentions, "round %d: retained while a range was still open", round)
		require.NoError(t, hi.Release(ctx, rp.C.Stream))
		assert.Equal(t, 1, exporttest.PoolStats(t, rp.Pr.Pool).Retentions, "round %d", round)
		require.NoError(t, rp.Pr.Ex.Unpublish("lo"))
		require.NoError(t, rp.Pr.Ex.Unpublish("hi"))
		require.NoError(t, b.Free(rp.Pr.Stream))
	}
	assert.Equal(t, int64(1), rp.CCalls.Imports(), "consumer imports")
	assert.Zero(t, rp.CCalls.Frees(), "consumer frees")
	require.NoError(t, rp.Pr.Pool.Trim())
	exporttest.WaitFor(t, "the revoke", func() bool { return exporttest.PoolStats(t, rp.Pr.Pool).Retentions == 0 })
	rp.Pr.CheckClean(t)
	rp.C.CheckClean(t)
}
