package consumer_test

import (
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/cudapool/cudapool/export/consumer"
	"github.com/cudapool/cudapool/export/internal/exporttest"
	"github.com/cudapool/cudapool/export/producer"
	"github.com/cudapool/cudapool/internal/testwait"
)

// A revoked retention ends only after the consumer's free of the import has run: with
// the Importer's release stream stalled across the Trim, the pool frees the memory
// after that free, and the software device sees no memory freed under an import.
func TestRevokedRetentionWaitsForTheConsumersFree(t *testing.T) {
	rp := exporttest.NewRetainingPair(t, producer.WithRetainedImports())
	rp.Cycle(t, "kv", 0x11)
	require.Equal(t, 1, exporttest.PoolStats(t, rp.Pr.Pool).Retentions)
	resume, err := rp.C.Dev.Stall(rp.C.Ord, consumer.ReleaseStream(rp.C.Imp))
	require.NoError(t, err)
	t.Cleanup(resume)
	require.NoError(t, rp.Pr.Pool.Trim()) // revokes; the consumer's free waits for the stall
	exporttest.WaitFor(t, "the revoke to be answered", func() bool { return exporttest.PoolStats(t, rp.Pr.Pool).Retentions == 0 })
	resume()
	exporttest.WaitFor(t, "the memory to go back", func() bool {
		s := exporttest.PoolStats(t, rp.Pr.Pool)
		return s.RevokingBuffers == 0 && s.UsedCurrent == 0
	})
	require.NoError(t, rp.Pr.Dev.StreamSynchronize(rp.Pr.Ord, 0))
	rp.Pr.CheckClean(t)
	rp.C.CheckClean(t)
}

// A revoke that arrives while the retained import is mapped again (leased anew) is
// answered once that mapping is released: Exporter.Close, which revokes, returns then.
func TestRevokeWhileMappedAgainIsAnsweredAtRelease(t *testing.T) {
	rp := exporttest.NewRetainingPair(t, producer.WithRetainedImports())
	ctx := exporttest.Ctx(t)
	rp.Cycle(t, "kv", 0x11)
	b := rp.Pr.Publish(t, "kv", 2<<20, 0x22) // the recycled memory
	m, err := rp.C.Imp.Open(ctx, "kv", rp.C.Stream)
	require.NoError(t, err)
	assert.Equal(t, int64(1), rp.CCalls.Imports(), "the retained import mapped again")
	require.NoError(t, rp.Pr.Ex.Unpublish("kv"))
	require.NoError(t, b.Free(rp.Pr.Stream))
	closed := make(chan error, 1)
	go func() { closed <- rp.Pr.Ex.Close(ctx) }()
	exporttest.WaitFor(t, "the revoke to reach the mapped import", func() bool { return consumer.RevokedMapped(rp.C.Imp) == 1 })
	assert.Equal(t, 1, exporttest.PoolStats(t, rp.Pr.Pool).Retentions, "the retention, held while mapped")
	require.NoError(t, m.Release(ctx, rp.C.Stream))
	require.NoError(t, testwait.Recv(t, closed, "Close to return once the mapping was released"))
	assert.Zero(t, exporttest.PoolStats(t, rp.Pr.Pool).Retentions)
	assert.Equal(t, int64(1), rp.CCalls.Frees(), "the consumer freed its import at the release")
	rp.Pr.CheckClean(t)
	rp.C.CheckClean(t)
}
