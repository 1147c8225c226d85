package e2e_test

import (
	"fmt"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/cudapool/cudapool/cudart"
	"github.com/cudapool/cudapool/cudart/cudarttest"
	"github.com/cudapool/cudapool/export"
	"github.com/cudapool/cudapool/export/consumer"
	"github.com/cudapool/cudapool/export/internal/exporttest"
	"github.com/cudapool/cudapool/internal/intercept"
	"github.com/cudapool/cudapool/pool"
)

// A replica on another GPU is copied through the exporter's device: a read of a dead
// exporter's memory from the consumer's own device is contained and loses the whole
// context (FACTS 14; on the GPU host, copies on the consumer's stream failed so as the
// producer was killed, and copies on the owner's all succeeded). The software device
// judges each access both as it is queued and as it runs.
func TestReplicaMadeAsItsProducerDies(t *testing.T) {
	t.Run("killed as the copy is queued", func(t *testing.T) {
		k, path := startProducerChild(t, 94)
		s := exporttest.NewSide(t, 1)
		// The producer dies as the first device-to-device copy is queued: the
		// replica's copy, made as its producer dies.
		rt := intercept.Wrap(s.Dev)
		rt.On.MemcpyDtoDAsync.Once(func() { exporttest.KillProducer(t, k) })
		ctx := exporttest.Ctx(t)
		imp, err := consumer.Dial(ctx, path, rt, 1, consumer.WithLogger(exporttest.DiscardLogger))
		require.NoError(t, err)
		m, err := imp.Open(ctx, "a", s.Stream, consumer.WithLocalCopy(nil))
		require.NoError(t, err, "a replica whose producer died as it was copied")
		c := &exporttest.Consumer{Side: s, Imp: imp}
		assert.True(t, exporttest.AllAre(c.Read(t, m), 94), "the replica holds the producer's bytes")
		assert.False(t, s.Dev.ContextLost(), "the copy read the dead exporter's memory from the consumer's device")
		require.NoError(t, m.Release(ctx, s.Stream))
		require.NoError(t, imp.Close(ctx))
		s.CheckClean(t)
	})
	t.Run("killed while the copy is queued", func(t *testing.T) {
		k, path := startProducerChild(t, 95)
		c := exporttest.NewConsumer(t, path, 1)
		ctx := exporttest.Ctx(t)
		// The caller's stream is held, so the copy waits behind it: it runs after the
		// death, as a copy in flight did on the GPU host.
		resume, err := c.Dev.Stall(1, c.Stream)
		require.NoError(t, err)
		m, err := c.Imp.Open(ctx, "a", c.Stream, consumer.WithLocalCopy(nil))
		if err != nil {
			resume()
		}
		require.NoError(t, err)
		exporttest.KillProducer(t, k)
		resume()
		assert.True(t, exporttest.AllAre(c.Read(t, m), 95), "the replica holds the producer's bytes")
		assert.False(t, c.Dev.ContextLost(), "the copy read the dead exporter's memory from the consumer's device")
		require.NoError(t, m.Release(ctx, c.Stream))
		require.NoError(t, c.Imp.Close(ctx))
		c.CheckClean(t)
	})
}

// The copy is ordered both ways on the device's queues: after the producer's writes
// and the replica's allocation (both queued on the caller's stream, held here until
// after Open), and before the work the caller queues after Open. The software device
// runs the streams in a random order and reports any access out of order.
func TestReplicaCopyIsOrdered(t *testing.T) {
	for _, dev := range []int{0, 1} { // through the exporter's device's stream, and on the caller's
		pr := exporttest.NewProducer(t, nil, nil)
		c := exporttest.NewConsumer(t, pr.Path, dev)
		ctx := exporttest.Ctx(t)
		for i := range 20 {
			b := pr.Publish(t, "a", 1<<20, byte(i))
			resume, err := c.Dev.Stall(dev, c.Stream)
			require.NoError(t, err)
			m, err := c.Imp.Open(ctx, "a", c.Stream, consumer.WithLocalCopy(nil))
			resume()
			require.NoError(t, err)
			assert.True(t, exporttest.AllAre(c.Read(t, m), byte(i)), "replica %d on device %d", i, dev)
			require.NoError(t, c.Dev.MemsetAsync(dev, m.Ptr(), 0xee, m.Size(), c.Stream), "the caller writes its replica")
			require.NoError(t, m.Release(ctx, c.Stream))
			require.NoError(t, pr.Ex.Unpublish("a"))
			require.NoError(t, b.Free(pr.Stream))
		}
		require.NoError(t, c.Imp.Close(ctx))
		require.NoError(t, c.Dev.Synchronize())
		c.CheckClean(t)
		pr.CheckClean(t)
	}
}

// An allocator of the caller's for replicas on another GPU must let the exporter's
// device write its memory, since the copy runs there: a pool that does not is refused
// before anything is allocated, and the lease is given back.
func TestReplicaAllocatorMustGrantTheExportersDevice(t *testing.T) {
	pr := exporttest.NewProducer(t, nil, nil)
	pr.Publish(t, "a", 1<<20, 0x21)
	c := exporttest.NewConsumer(t, pr.Path, 1)
	ctx := exporttest.Ctx(t)

	private, err := pool.New(c.Dev, 1, pool.WithHandleType(cudart.HandleTypeNone))
	require.NoError(t, err)
	defer private.Close(ctx)
	_, err = c.Imp.Open(ctx, "a", c.Stream, consumer.WithLocalCopy(private))
	require.ErrorIs(t, err, pool.ErrNoPeerAccess)
	assert.Contains(t, err.Error(), "pool.WithPeerAccess(0)")
	require.Eventually(t, func() bool { return pr.ActiveLeases(t) == 0 }, exporttest.Promptly, time.Millisecond, "the lease was not given back")
	st, err := private.Stats()
	require.NoError(t, err)
	assert.Zero(t, st.LiveBuffers, "nothing was allocated")

	// One that cannot be asked fails at the copy, which the driver refuses, and says why.
	hidden := struct{ pool.Allocator }{private}
	_, err = c.Imp.Open(ctx, "a", c.Stream, consumer.WithLocalCopy(hidden))
	require.ErrorIs(t, err, cudart.ErrInvalidValue)
	assert.Contains(t, err.Error(), "pool.WithPeerAccess(0)")
	require.Eventually(t, func() bool { return pr.ActiveLeases(t) == 0 }, exporttest.Promptly, time.Millisecond, "the lease was not given back")
	st, err = private.Stats()
	require.NoError(t, err)
	assert.Zero(t, st.LiveBuffers, "the replica was freed")
	var v cudarttest.Violation
	require.ErrorAs(t, c.Dev.Err(), &v, "the software device saw the copy refused")
	assert.Equal(t, cudarttest.ViolationAccessDenied, v.Kind)

	granted, err := pool.New(c.Dev, 1, pool.WithHandleType(cudart.HandleTypeNone), pool.WithPeerAccess(0))
	require.NoError(t, err)
	defer granted.Close(ctx)
	m, err := c.Imp.Open(ctx, "a", c.Stream, consumer.WithLocalCopy(granted))
	require.NoError(t, err)
	assert.True(t, exporttest.AllAre(c.Read(t, m), 0x21))
	require.NoError(t, m.Release(ctx, c.Stream))
	require.NoError(t, c.Imp.Close(ctx))
}

// killAtReadyWait makes rt's producer's ready events never report completion, and
// kills the producer as a stream is made to wait on one: the producer dies in the one
// window Open cannot close, between its last look at the process and the wait.
func killAtReadyWait(rt *intercept.Runtime, kill func()) {
	ready := intercept.TrackLive[cudart.Event](&rt.On.IpcOpenEventHandle, nil)
	rt.On.EventQuery.Around(func(next intercept.EventQueryFunc, dev int, e cudart.Event) (bool, error) {
		if ready.Has(e) {
			return false, nil
		}
		return next(dev, e)
	})
	var once sync.Once
	rt.On.StreamWaitEvent.Before(func(_ int, _ cudart.Stream, e cudart.Event) error {
		if ready.Has(e) {
			once.Do(kill)
		}
		return nil
	})
}

// A producer that dies as Open's stream is made to wait on its ready event: what
// the driver makes of the wait, Open says export.ErrExporterGone (as for a death anywhere
// else in Open), and the process keeps its context.
func TestOpenSaysGoneWhenTheProducerDiesAtTheWait(t *testing.T) {
	k, path := startProducerChild(t, 96)
	s := exporttest.NewSide(t, 1)
	rt := intercept.Wrap(s.Dev)
	killAtReadyWait(rt, func() { exporttest.KillProducer(t, k) })
	ctx := exporttest.Ctx(t)
	imp, err := consumer.Dial(ctx, path, rt, 1, consumer.WithLogger(exporttest.DiscardLogger))
	require.NoError(t, err)
	_, err = imp.Open(ctx, "a", s.Stream, consumer.WithLocalCopy(nil))
	require.ErrorIs(t, err, export.ErrExporterGone)
	require.NoError(t, imp.Close(ctx))
	assert.False(t, s.Dev.ContextLost())
}

// Replicas made at once by many goroutines, each on its own stream, share the
// Importer's stream on the exporter's device and its pool: each is filled from its
// own buffer, in order.
func TestConcurrentReplicas(t *testing.T) {
	pr := exporttest.NewProducer(t, nil, nil)
	const n = 8
	for i := range n {
		pr.Publish(t, fmt.Sprint("b", i), 1<<20, byte(0x50+i))
	}
	c := exporttest.NewConsumer(t, pr.Path, 1)
	ctx := exporttest.Ctx(t)
	c.EachOnItsStream(t, n, func(i int, s cudart.Stream) error {
		for range 5 {
			m, err := c.Imp.Open(ctx, fmt.Sprint("b", i), s, consumer.WithLocalCopy(nil))
			if err != nil {
				return err
			}
			got := make([]byte, m.Size())
			if err := c.Dev.MemcpyDtoHAsync(1, got, m.Ptr(), s); err != nil {
				return err
			}
			if !exporttest.AllAre(got, byte(0x50+i)) {
				return fmt.Errorf("replica of b%d holds other bytes", i)
			}
			if err := m.Release(ctx, s); err != nil {
				return err
			}
		}
		return nil
	})
	require.Eventually(t, func() bool { return pr.ActiveLeases(t) == 0 }, exporttest.Promptly, time.Millisecond)
	require.NoError(t, c.Imp.Close(ctx))
	require.NoError(t, c.Dev.Synchronize())
	c.CheckClean(t)
	pr.CheckClean(t)
}

// A producer that dies as Open imports its buffer: whatever the driver answers, Open
// says export.ErrExporterGone, as for a death anywhere else in Open.
func TestOpenSaysGoneWhenTheProducerDiesAtTheImport(t *testing.T) {
	k, path := startProducerChild(t, 97)
	s := exporttest.NewSide(t, 1)
	// The producer is killed as a buffer is imported, and the import fails as a
	// driver might for a dead process's pool.
	rt := intercept.Wrap(s.Dev)
	rt.On.MemPoolImportPointer.Once(func() { exporttest.KillProducer(t, k) })
	rt.On.MemPoolImportPointer.Fail(-1, cudart.NewError("cudaMemPoolImportPointer", cudart.ErrInvalidValue))
	ctx := exporttest.Ctx(t)
	imp, err := consumer.Dial(ctx, path, rt, 1, consumer.WithLogger(exporttest.DiscardLogger))
	require.NoError(t, err)
	_, err = imp.Open(ctx, "a", s.Stream, consumer.WithLocalCopy(nil))
	require.ErrorIs(t, err, export.ErrExporterGone)
	assert.ErrorIs(t, err, cudart.ErrInvalidValue, "and what the driver said")
	require.NoError(t, imp.Close(ctx))
	assert.False(t, s.Dev.ContextLost())
}
