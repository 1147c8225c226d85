package consumer_test

import (
	"math"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/cudapool/cudapool/cudart"
	"github.com/cudapool/cudapool/export/consumer"
	"github.com/cudapool/cudapool/export/internal/exporttest"
	"github.com/cudapool/cudapool/internal/intercept"
)

// Replicas outlive their Importer: the pool they come from is the Importer's, and is
// destroyed with the last of them, whichever comes last.
func TestReplicasOutliveTheirImporter(t *testing.T) {
	pr := exporttest.NewProducer(t, nil, nil)
	pr.Publish(t, "a", 1<<20, 0x42)
	s := exporttest.NewSide(t, 1)
	rt := intercept.Wrap(s.Dev)
	pools := intercept.TrackLive(&rt.On.MemPoolCreate, &rt.On.MemPoolDestroy)
	streams := intercept.TrackLive(&rt.On.StreamCreate, &rt.On.StreamDestroy)
	ctx := exporttest.Ctx(t)
	imp, err := consumer.Dial(ctx, pr.Path, rt, 1, consumer.WithLogger(exporttest.DiscardLogger))
	require.NoError(t, err)
	c := &exporttest.Consumer{Side: s, Imp: imp}
	m1, err := imp.Open(ctx, "a", s.Stream, consumer.WithLocalCopy(nil))
	require.NoError(t, err)
	m2, err := imp.Open(ctx, "a", s.Stream, consumer.WithLocalCopy(nil))
	require.NoError(t, err)
	assert.NotEqual(t, m1.Ptr(), m2.Ptr(), "each Open makes its own replica")
	assert.EqualValues(t, 1, pools.Len(), "one pool for the replicas of one exporter's device")
	replicaPool := consumer.LocalCopyPool(imp)
	keep, err := s.Dev.MemPoolGetAttribute(1, replicaPool, cudart.PoolReleaseThreshold)
	require.NoError(t, err)
	assert.Equal(t, uint64(math.MaxUint64), keep, "released replicas' memory is kept, so that the next replica does not map its memory afresh")

	require.NoError(t, m1.Release(ctx, s.Stream))
	require.NoError(t, imp.Close(ctx))
	assert.EqualValues(t, 1, pools.Len(), "the pool went before its last replica")
	assert.Zero(t, streams.Len(), "the Importer's streams outlived it")
	assert.True(t, exporttest.AllAre(c.Read(t, m2), 0x42), "a replica reads right after its Importer closed")
	require.NoError(t, m2.Release(ctx, s.Stream))
	assert.Zero(t, pools.Len(), "the replicas' pool outlived the last replica")
	require.NoError(t, s.Dev.Synchronize())
	s.CheckClean(t)
}
