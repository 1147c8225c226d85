package producer

import (
	"fmt"
	"sync"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/cudapool/cudapool/cudart"
	"github.com/cudapool/cudapool/export/consumer"
)

func TestOpenTwiceSharesOneMapping(t *testing.T) {
	pr := newProducer(t, nil, nil)
	pr.publish(t, "a", 1<<20, 7)
	require.NoError(t, pr.ex.Publish(testCtx(t), "alias", pr.ex.pubs["a"].buf, pr.stream))
	c := newConsumer(t, pr.path, 0)
	ctx := testCtx(t)
	m1, err := c.imp.Open(ctx, "a", c.stream)
	require.NoError(t, err)
	m2, err := c.imp.Open(ctx, "alias", c.stream)
	require.NoError(t, err)
	require.Same(t, m1, m2, "the same buffer opened twice gave two Mappings")
	require.NoError(t, m1.Release(ctx, c.stream))
	// Still mapped: the second reference holds it.
	got := c.read(t, m2)
	require.True(t, allAre(got, 7), "mapping unreadable after the first of two releases")
	// Both grants stay with the exporter until the last reference goes: the import
	// is one, and it is freed once.
	n := pr.activeLeases(t)
	require.EqualValues(t, 2, n, "%d pool leases while one of two references is held, want 2", n)
	require.NoError(t, m2.Release(ctx, c.stream))
	n = pr.activeLeases(t)
	require.EqualValues(t, 0, n, "%d pool leases after the last release, want 0", n)
	require.ErrorIs(t, m2.Release(ctx, c.stream), consumer.ErrReleased, "third release, want ErrReleased")
	pr.checkClean(t)
	c.checkClean(t)
}

func TestConsumerOnOtherDeviceReadsProducerBytes(t *testing.T) {
	pr := newProducer(t, nil, nil)
	pr.publish(t, "a", 3<<20, 0xc3)
	c := newConsumer(t, pr.path, 1)
	ctx := testCtx(t)
	m, err := c.imp.Open(ctx, "a", c.stream)
	require.NoError(t, err)
	got := c.read(t, m)
	require.True(t, allAre(got, 0xc3), "device 1 read wrong bytes")
	require.NoError(t, m.Release(ctx, c.stream))
	pr.checkClean(t)
	c.checkClean(t)
}

func TestFreeWhileLeasedWaitsForRelease(t *testing.T) {
	pr := newProducer(t, nil, nil)
	b := pr.publish(t, "a", 1<<20, 1)
	c := newConsumer(t, pr.path, 0)
	ctx := testCtx(t)
	m, err := c.imp.Open(ctx, "a", c.stream)
	require.NoError(t, err)
	require.NoError(t, b.Free(pr.stream))
	s, _ := pr.pool.Stats()
	require.EqualValues(t, 1, s.DeferredFrees, "free of a leased buffer: %d deferred, %d live; want 1, 1", s.DeferredFrees, s.LiveBuffers)
	require.EqualValues(t, 1, s.LiveBuffers, "free of a leased buffer: %d deferred, %d live; want 1, 1", s.DeferredFrees, s.LiveBuffers)
	got := c.read(t, m)
	require.True(t, allAre(got, 1), "leased buffer changed after the producer freed it")
	// A new open must not get the freed buffer.
	_, err = c.imp.Open(ctx, "a", c.stream)
	require.ErrorIs(t, err, ErrBufferGone, "open of a freed buffer, want ErrBufferGone")
	require.NoError(t, m.Release(ctx, c.stream))
	s, _ = pr.pool.Stats()
	require.EqualValues(t, 0, s.DeferredFrees, "after release: %d deferred, %d live, %d leases; want 0, 0, 0", s.DeferredFrees, s.LiveBuffers, s.ActiveLeases)
	require.EqualValues(t, 0, s.LiveBuffers, "after release: %d deferred, %d live, %d leases; want 0, 0, 0", s.DeferredFrees, s.LiveBuffers, s.ActiveLeases)
	require.EqualValues(t, 0, s.ActiveLeases, "after release: %d deferred, %d live, %d leases; want 0, 0, 0", s.DeferredFrees, s.LiveBuffers, s.ActiveLeases)
	pr.checkClean(t)
	c.checkClean(t)
}

// Many goroutines in several consumers open and release the same and different
// buffers at once; every read sees the producer's bytes and, at the end, nothing is
// held and no rule was broken.
func TestConcurrentOpensAndReleases(t *testing.T) {
	pr := newProducer(t, nil, nil)
	const names = 4
	for i := range names {
		pr.publish(t, fmt.Sprint("b", i), 1<<20, byte(i+1))
	}
	const consumers, workers, rounds = 3, 4, 25
	var wg sync.WaitGroup
	errs := make(chan error, consumers*workers)
	cs := make([]*testConsumer, consumers)
	for i := range cs {
		cs[i] = newConsumer(t, pr.path, i%2)
	}
	ctx := testCtx(t)
	for _, c := range cs {
		for w := range workers {
			wg.Add(1)
			go func() {
				defer wg.Done()
				s, err := c.dev.StreamCreate(c.ord, cudart.StreamNonBlocking)
				if err != nil {
					errs <- err
					return
				}
				buf := make([]byte, 1<<20)
				for r := range rounds {
					i := (w + r) % names
					m, err := c.imp.Open(ctx, fmt.Sprint("b", i), s)
					if err != nil {
						errs <- err
						return
					}
					if err := c.dev.MemcpyDtoHAsync(c.ord, buf, m.Ptr(), s); err != nil || !allAre(buf, byte(i+1)) {
						errs <- fmt.Errorf("read of b%d: %v", i, err)
						return
					}
					if err := m.Release(ctx, s); err != nil {
						errs <- err
						return
					}
				}
			}()
		}
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		assert.NoError(t, err)
	}
	n := pr.activeLeases(t)
	require.EqualValues(t, 0, n, "%d pool leases after every release", n)
	for _, p := range pr.ex.Peers() {
		require.EqualValues(t, 0, p.Leases, "peer %d still holds %d leases", p.PID, p.Leases)
	}
	pr.checkClean(t)
	for _, c := range cs {
		c.checkClean(t)
	}
}
