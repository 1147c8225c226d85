package producer

import (
	"fmt"
	"math"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/cudapool/cudapool/cudart"
	"github.com/cudapool/cudapool/cudart/cudarttest"
	"github.com/cudapool/cudapool/export/consumer"
	"github.com/cudapool/cudapool/export/internal/inspect"
	"github.com/cudapool/cudapool/export/internal/wire"
	"github.com/cudapool/cudapool/pool"
)

// killAtCopy is a consumer runtime that kills the producer as the first
// device-to-device copy is queued: the replica's copy, made as its producer dies.
type killAtCopy struct {
	cudart.Runtime
	once sync.Once
	kill func()
}

func (r *killAtCopy) MemcpyDtoDAsync(dev int, dst, src cudart.DevicePtr, n uint64, s cudart.Stream) error {
	r.once.Do(r.kill)
	return r.Runtime.MemcpyDtoDAsync(dev, dst, src, n, s)
}

// A replica on another GPU is copied through the exporter's device: a read of a dead
// exporter's memory from the consumer's own device is contained and loses the whole
// context (FACTS 14; on the GPU host, copies on the consumer's stream failed so as the
// producer was killed, and copies on the owner's all succeeded). The software device
// judges each access both as it is queued and as it runs.
func TestReplicaMadeAsItsProducerDies(t *testing.T) {
	t.Run("killed as the copy is queued", func(t *testing.T) {
		k, path := startProducerChild(t, 94)
		s := newSide(t, 1)
		rt := &killAtCopy{Runtime: s.dev, kill: func() { killProducer(t, k) }}
		ctx := testCtx(t)
		imp, err := consumer.Dial(ctx, path, rt, 1, consumer.WithLogger(discardLogger))
		require.NoError(t, err)
		m, err := imp.Open(ctx, "a", s.stream, consumer.WithReplica(nil))
		require.NoError(t, err, "a replica whose producer died as it was copied")
		c := &testConsumer{side: s, imp: imp}
		assert.True(t, allAre(c.read(t, m), 94), "the replica holds the producer's bytes")
		assert.False(t, s.dev.ContextLost(), "the copy read the dead exporter's memory from the consumer's device")
		require.NoError(t, m.Release(ctx, s.stream))
		require.NoError(t, imp.Close(ctx))
		s.checkClean(t)
	})
	t.Run("killed while the copy is queued", func(t *testing.T) {
		k, path := startProducerChild(t, 95)
		c := newConsumer(t, path, 1)
		ctx := testCtx(t)
		// The caller's stream is held, so the copy waits behind it: it runs after the
		// death, as a copy in flight did on the GPU host.
		resume, err := c.dev.Stall(1, c.stream)
		require.NoError(t, err)
		m, err := c.imp.Open(ctx, "a", c.stream, consumer.WithReplica(nil))
		if err != nil {
			resume()
		}
		require.NoError(t, err)
		killProducer(t, k)
		resume()
		assert.True(t, allAre(c.read(t, m), 95), "the replica holds the producer's bytes")
		assert.False(t, c.dev.ContextLost(), "the copy read the dead exporter's memory from the consumer's device")
		require.NoError(t, m.Release(ctx, c.stream))
		require.NoError(t, c.imp.Close(ctx))
		c.checkClean(t)
	})
}

// The copy is ordered both ways on the device's queues: after the producer's writes
// and the replica's allocation (both queued on the caller's stream, held here until
// after Open), and before the work the caller queues after Open. The software device
// runs the streams in a random order and reports any access out of order.
func TestReplicaCopyIsOrdered(t *testing.T) {
	for _, dev := range []int{0, 1} { // through the exporter's device's stream, and on the caller's
		pr := newProducer(t, nil, nil)
		c := newConsumer(t, pr.path, dev)
		ctx := testCtx(t)
		for i := range 20 {
			b := pr.publish(t, "a", 1<<20, byte(i))
			resume, err := c.dev.Stall(dev, c.stream)
			require.NoError(t, err)
			m, err := c.imp.Open(ctx, "a", c.stream, consumer.WithReplica(nil))
			resume()
			require.NoError(t, err)
			assert.True(t, allAre(c.read(t, m), byte(i)), "replica %d on device %d", i, dev)
			require.NoError(t, c.dev.MemsetAsync(dev, m.Ptr(), 0xee, m.Size(), c.stream), "the caller writes its replica")
			require.NoError(t, m.Release(ctx, c.stream))
			require.NoError(t, pr.ex.Unpublish("a"))
			require.NoError(t, b.Free(pr.stream))
		}
		require.NoError(t, c.imp.Close(ctx))
		require.NoError(t, c.dev.Synchronize())
		c.checkClean(t)
		pr.checkClean(t)
	}
}

// An allocator of the caller's for replicas on another GPU must let the exporter's
// device write its memory, since the copy runs there: a pool that does not is refused
// before anything is allocated, and the lease is given back.
func TestReplicaAllocatorMustGrantTheExportersDevice(t *testing.T) {
	pr := newProducer(t, nil, nil)
	pr.publish(t, "a", 1<<20, 0x21)
	c := newConsumer(t, pr.path, 1)
	ctx := testCtx(t)

	private, err := pool.New(c.dev, 1, pool.WithHandleType(cudart.HandleTypeNone))
	require.NoError(t, err)
	defer private.Close(ctx)
	_, err = c.imp.Open(ctx, "a", c.stream, consumer.WithReplica(private))
	require.ErrorIs(t, err, pool.ErrNoPeerAccess)
	assert.Contains(t, err.Error(), "pool.WithPeerAccess(0)")
	require.Eventually(t, func() bool { return pr.activeLeases(t) == 0 }, promptly, time.Millisecond, "the lease was not given back")
	st, err := private.Stats()
	require.NoError(t, err)
	assert.Zero(t, st.LiveBuffers, "nothing was allocated")

	// One that cannot be asked fails at the copy, which the driver refuses, and says why.
	hidden := struct{ pool.Allocator }{private}
	_, err = c.imp.Open(ctx, "a", c.stream, consumer.WithReplica(hidden))
	require.ErrorIs(t, err, cudart.ErrInvalidValue)
	assert.Contains(t, err.Error(), "pool.WithPeerAccess(0)")
	require.Eventually(t, func() bool { return pr.activeLeases(t) == 0 }, promptly, time.Millisecond, "the lease was not given back")
	st, err = private.Stats()
	require.NoError(t, err)
	assert.Zero(t, st.LiveBuffers, "the replica was freed")
	var v cudarttest.Violation
	require.ErrorAs(t, c.dev.Err(), &v, "the software device saw the copy refused")
	assert.Equal(t, cudarttest.ViolationAccessDenied, v.Kind)

	granted, err := pool.New(c.dev, 1, pool.WithHandleType(cudart.HandleTypeNone), pool.WithPeerAccess(0))
	require.NoError(t, err)
	defer granted.Close(ctx)
	m, err := c.imp.Open(ctx, "a", c.stream, consumer.WithReplica(granted))
	require.NoError(t, err)
	assert.True(t, allAre(c.read(t, m), 0x21))
	require.NoError(t, m.Release(ctx, c.stream))
	require.NoError(t, c.imp.Close(ctx))
}

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
	pr := newProducer(t, nil, nil)
	pr.publish(t, "a", 1<<20, 0x42)
	s := newSide(t, 1)
	rt := &countPools{Runtime: s.dev, created: map[cudart.MemPool]bool{}}
	ctx := testCtx(t)
	imp, err := consumer.Dial(ctx, pr.path, rt, 1, consumer.WithLogger(discardLogger))
	require.NoError(t, err)
	c := &testConsumer{side: s, imp: imp}
	m1, err := imp.Open(ctx, "a", s.stream, consumer.WithReplica(nil))
	require.NoError(t, err)
	m2, err := imp.Open(ctx, "a", s.stream, consumer.WithReplica(nil))
	require.NoError(t, err)
	assert.NotEqual(t, m1.Ptr(), m2.Ptr(), "each Open makes its own replica")
	assert.EqualValues(t, 1, rt.pools(), "one pool for the replicas of one exporter's device")
	replicaPool := inspect.ReplicaPool(imp)
	keep, err := s.dev.MemPoolGetAttribute(1, replicaPool, cudart.PoolReleaseThreshold)
	require.NoError(t, err)
	assert.Equal(t, uint64(math.MaxUint64), keep, "released replicas' memory is kept, so that the next replica does not map its memory afresh")

	require.NoError(t, m1.Release(ctx, s.stream))
	require.NoError(t, imp.Close(ctx))
	assert.EqualValues(t, 1, rt.pools(), "the pool went before its last replica")
	assert.Zero(t, rt.streams.Load(), "the Importer's streams outlived it")
	assert.True(t, allAre(c.read(t, m2), 0x42), "a replica reads right after its Importer closed")
	require.NoError(t, m2.Release(ctx, s.stream))
	assert.Zero(t, rt.pools(), "the replicas' pool outlived the last replica")
	require.NoError(t, s.dev.Synchronize())
	s.checkClean(t)
}

// killAtReadyWait is a consumer runtime whose producer's ready events never report
// completion, and that kills the producer as a stream is made to wait on one: the
// producer dies in the one window Open cannot close, between its last look at the
// process and the wait.
type killAtReadyWait struct {
	cudart.Runtime
	mu    sync.Mutex
	ready map[cudart.Event]bool
	once  sync.Once
	kill  func()
}

func (r *killAtReadyWait) IpcOpenEventHandle(dev int, h cudart.IpcEventHandle) (cudart.Event, error) {
	ev, err := r.Runtime.IpcOpenEventHandle(dev, h)
	if err == nil {
		r.mu.Lock()
		r.ready[ev] = true
		r.mu.Unlock()
	}
	return ev, err
}

func (r *killAtReadyWait) isReady(ev cudart.Event) bool {
	r.mu.Lock()
	defer r.mu.Unlock()
	return r.ready[ev]
}

func (r *killAtReadyWait) EventQuery(dev int, ev cudart.Event) (bool, error) {
	if r.isReady(ev) {
		return false, nil
	}
	return r.Runtime.EventQuery(dev, ev)
}

func (r *killAtReadyWait) StreamWaitEvent(dev int, s cudart.Stream, ev cudart.Event) error {
	if r.isReady(ev) {
		r.once.Do(r.kill)
	}
	return r.Runtime.StreamWaitEvent(dev, s, ev)
}

// A producer that dies as Open's stream is made to wait on its ready event: what
// the driver makes of the wait, Open says ErrExporterGone (as for a death anywhere
// else in Open), and the process keeps its context.
func TestOpenSaysGoneWhenTheProducerDiesAtTheWait(t *testing.T) {
	k, path := startProducerChild(t, 96)
	s := newSide(t, 1)
	rt := &killAtReadyWait{Runtime: s.dev, ready: map[cudart.Event]bool{}, kill: func() { killProducer(t, k) }}
	ctx := testCtx(t)
	imp, err := consumer.Dial(ctx, path, rt, 1, consumer.WithLogger(discardLogger))
	require.NoError(t, err)
	_, err = imp.Open(ctx, "a", s.stream, consumer.WithReplica(nil))
	require.ErrorIs(t, err, wire.ErrExporterGone)
	require.NoError(t, imp.Close(ctx))
	assert.False(t, s.dev.ContextLost())
}

// Replicas made at once by many goroutines, each on its own stream, share the
// Importer's stream on the exporter's device and its pool: each is filled from its
// own buffer, in order.
func TestConcurrentReplicas(t *testing.T) {
	pr := newProducer(t, nil, nil)
	const n = 8
	for i := range n {
		pr.publish(t, fmt.Sprint("b", i), 1<<20, byte(0x50+i))
	}
	c := newConsumer(t, pr.path, 1)
	ctx := testCtx(t)
	c.eachOnItsStream(t, n, func(i int, s cudart.Stream) error {
		for range 5 {
			m, err := c.imp.Open(ctx, fmt.Sprint("b", i), s, consumer.WithReplica(nil))
			if err != nil {
				return err
			}
			got := make([]byte, m.Size())
			if err := c.dev.MemcpyDtoHAsync(1, got, m.Ptr(), s); err != nil {
				return err
			}
			if !allAre(got, byte(0x50+i)) {
				return fmt.Errorf("replica of b%d holds other bytes", i)
			}
			if err := m.Release(ctx, s); err != nil {
				return err
			}
		}
		return nil
	})
	require.Eventually(t, func() bool { return pr.activeLeases(t) == 0 }, promptly, time.Millisecond)
	require.NoError(t, c.imp.Close(ctx))
	require.NoError(t, c.dev.Synchronize())
	c.checkClean(t)
	pr.checkClean(t)
}

// killAtImport is a consumer runtime that kills the producer as a buffer is imported,
// and fails the import as a driver might for a dead process's pool.
type killAtImport struct {
	cudart.Runtime
	kill func()
}

func (r *killAtImport) MemPoolImportPointer(dev int, p cudart.MemPool, data cudart.PtrExportData) (cudart.DevicePtr, error) {
	r.kill()
	return 0, cudart.NewError("cudaMemPoolImportPointer", cudart.ErrInvalidValue)
}

// A producer that dies as Open imports its buffer: whatever the driver answers, Open
// says ErrExporterGone, as for a death anywhere else in Open.
func TestOpenSaysGoneWhenTheProducerDiesAtTheImport(t *testing.T) {
	k, path := startProducerChild(t, 97)
	s := newSide(t, 1)
	var once sync.Once
	rt := &killAtImport{Runtime: s.dev, kill: func() { once.Do(func() { killProducer(t, k) }) }}
	ctx := testCtx(t)
	imp, err := consumer.Dial(ctx, path, rt, 1, consumer.WithLogger(discardLogger))
	require.NoError(t, err)
	_, err = imp.Open(ctx, "a", s.stream, consumer.WithReplica(nil))
	require.ErrorIs(t, err, wire.ErrExporterGone)
	assert.ErrorIs(t, err, cudart.ErrInvalidValue, "and what the driver said")
	require.NoError(t, imp.Close(ctx))
	assert.False(t, s.dev.ContextLost())
}
