package consumer_test

import (
	"math"
	"sync"
	"sync/atomic"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/cudapool/cudapool/cudart"
	"github.com/cudapool/cudapool/export/consumer"
	"github.com/cudapool/cudapool/export/internal/exporttest"
)

// countPools counts the pools and streams the Importer creates and has not destroyed
// (imported pools are not counted).
type countPools struct {
	cudart.Runtime
	mu      sync.Mutex
	created map[cudart.MemPool]bool
	streams atomic.Int32
}

func (r *countPools) MemPoolCreate(props cudart.PoolProps) (cudart.MemPool, error) {
	p, err := r.Runtime.MemPoolCreate(props)
	if err == nil {
		r.mu.Lock()
		r.created[p] = true
		r.mu.Unlock()
	}
	return p, err
}

func (r *countPools) MemPoolDestroy(dev int, p cudart.MemPool) error {
	r.mu.Lock()
	delete(r.created, p)
	r.mu.Unlock()
	return r.Runtime.MemPoolDestroy(dev, p)
}

func (r *countPools) pools() int {
	r.mu.Lock()
	defer r.mu.Unlock()
	return len(r.created)
}

func (r *countPools) StreamCreate(dev int, flags cudart.StreamFlags) (cudart.Stream, error) {
	s, err := r.Runtime.StreamCreate(dev, flags)
	if err == nil {
		r.streams.Add(1)
	}
	return s, err
}

func (r *countPools) StreamDestroy(dev int, s cudart.Stream) error {
	r.streams.Add(-1)
	return r.Runtime.StreamDestroy(dev, s)
}

// Replicas outlive their Importer: the pool they come from is the Importer's, and is
// destroyed with the last of them, whichever comes last.
func TestReplicasOutliveTheirImporter(t *testing.T) {
	pr := exporttest.NewProducer(t, nil, nil)
	pr.Publish(t, "a", 1<<20, 0x42)
	s := exporttest.NewSide(t, 1)
	rt := &countPools{Runtime: s.Dev, created: map[cudart.MemPool]bool{}}
	ctx := exporttest.Ctx(t)
	imp, err := consumer.Dial(ctx, pr.Path, rt, 1, consumer.WithLogger(exporttest.DiscardLogger))
	require.NoError(t, err)
	c := &exporttest.Consumer{Side: s, Imp: imp}
	m1, err := imp.Open(ctx, "a", s.Stream, consumer.WithReplica(nil))
	require.NoError(t, err)
	m2, err := imp.Open(ctx, "a", s.Stream, consumer.WithReplica(nil))
	require.NoError(t, err)
	assert.NotEqual(t, m1.Ptr(), m2.Ptr(), "each Open makes its own replica")
	assert.EqualValues(t, 1, rt.pools(), "one pool for the replicas of one exporter's device")
	replicaPool := consumer.ReplicaPool(imp)
	keep, err := s.Dev.MemPoolGetAttribute(1, replicaPool, cudart.PoolReleaseThreshold)
	require.NoError(t, err)
	assert.Equal(t, uint64(math.MaxUint64), keep, "released replicas' memory is kept, so that the next replica does not map its memory afresh")

	require.NoError(t, m1.Release(ctx, s.Stream))
	require.NoError(t, imp.Close(ctx))
	assert.EqualValues(t, 1, rt.pools(), "the pool went before its last replica")
	assert.Zero(t, rt.streams.Load(), "the Importer's streams outlived it")
	assert.True(t, exporttest.AllAre(c.Read(t, m2), 0x42), "a replica reads right after its Importer closed")
	require.NoError(t, m2.Release(ctx, s.Stream))
	assert.Zero(t, rt.pools(), "the replicas' pool outlived the last replica")
	require.NoError(t, s.Dev.Synchronize())
	s.CheckClean(t)
}
