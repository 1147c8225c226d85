package e2e_test

import (
	"fmt"
	"sync"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/cudapool/cudapool/cudart"
	"github.com/cudapool/cudapool/export"
	"github.com/cudapool/cudapool/export/internal/exporttest"
)

func TestConsumerOnOtherDeviceReadsProducerBytes(t *testing.T) {
	pr := exporttest.NewProducer(t, nil, nil)
	pr.Publish(t, "a", 3<<20, 0xc3)
	c := exporttest.NewConsumer(t, pr.Path, 1)
	ctx := exporttest.Ctx(t)
	m, err := c.Imp.Open(ctx, "a", c.Stream)
	require.NoError(t, err)
	got := c.Read(t, m)
	require.True(t, exporttest.AllAre(got, 0xc3), "device 1 read wrong bytes")
	require.NoError(t, m.Release(ctx, c.Stream))
	pr.CheckClean(t)
	c.CheckClean(t)
}

func TestFreeWhileLeasedWaitsForRelease(t *testing.T) {
	pr := exporttest.NewProducer(t, nil, nil)
	b := pr.Publish(t, "a", 1<<20, 1)
	c := exporttest.NewConsumer(t, pr.Path, 0)
	ctx := exporttest.Ctx(t)
	m, err := c.Imp.Open(ctx, "a", c.Stream)
	require.NoError(t, err)
	require.NoError(t, b.Free(pr.Stream))
	s, _ := pr.Pool.Stats()
	require.EqualValues(t, 1, s.DeferredFrees, "free of a leased buffer: %d deferred, %d live; want 1, 1", s.DeferredFrees, s.LiveBuffers)
	require.EqualValues(t, 1, s.LiveBuffers, "free of a leased buffer: %d deferred, %d live; want 1, 1", s.DeferredFrees, s.LiveBuffers)
	got := c.Read(t, m)
	require.True(t, exporttest.AllAre(got, 1), "leased buffer changed after the producer freed it")
	// A new open must not get the freed buffer.
	_, err = c.Imp.Open(ctx, "a", c.Stream)
	require.ErrorIs(t, err, export.ErrBufferGone, "open of a freed buffer, want export.ErrBufferGone")
	require.ErrorIs(t, err, export.ErrUnknownName, "the freed buffer's name is unpublished: an unknown name")
	require.NoError(t, m.Release(ctx, c.Stream))
	s, _ = pr.Pool.Stats()
	require.EqualValues(t, 0, s.DeferredFrees, "after release: %d deferred, %d live, %d leases; want 0, 0, 0", s.DeferredFrees, s.LiveBuffers, s.ActiveLeases)
	require.EqualValues(t, 0, s.LiveBuffers, "after release: %d deferred, %d live, %d leases; want 0, 0, 0", s.DeferredFrees, s.LiveBuffers, s.ActiveLeases)
	require.EqualValues(t, 0, s.ActiveLeases, "after release: %d deferred, %d live, %d leases; want 0, 0, 0", s.DeferredFrees, s.LiveBuffers, s.ActiveLeases)
	pr.CheckClean(t)
	c.CheckClean(t)
}

// Many goroutines in several consumers open and release the same and different
// buffers at once; every read sees the producer's bytes and, at the end, nothing is
// held and no rule was broken.
func TestConcurrentOpensAndReleases(t *testing.T) {
	pr := exporttest.NewProducer(t, nil, nil)
	const names = 4
	for i := range names {
		pr.Publish(t, fmt.Sprint("b", i), 1<<20, byte(i+1))
	}
	const consumers, workers, rounds = 3, 4, 25
	var wg sync.WaitGroup
	errs := make(chan error, consumers*workers)
	cs := make([]*exporttest.Consumer, consumers)
	for i := range cs {
		cs[i] = exporttest.NewConsumer(t, pr.Path, i%2)
	}
	ctx := exporttest.Ctx(t)
	for _, c := range cs {
		for w := range workers {
			wg.Add(1)
			go func() {
				defer wg.Done()
				s, err := c.Dev.StreamCreate(c.Ord, cudart.StreamNonBlocking)
				if err != nil {
					errs <- err
					return
				}
				buf := make([]byte, 1<<20)
				for r := range rounds {
					i := (w + r) % names
					m, err := c.Imp.Open(ctx, fmt.Sprint("b", i), s)
					if err != nil {
						errs <- err
						return
					}
					if err := c.Dev.MemcpyDtoHAsync(c.Ord, buf, m.Ptr(), s); err != nil || !exporttest.AllAre(buf, byte(i+1)) {
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
	n := pr.ActiveLeases(t)
	require.EqualValues(t, 0, n, "%d pool leases after every release", n)
	for _, p := range pr.Ex.Peers() {
		require.EqualValues(t, 0, p.Leases, "peer %d still holds %d leases", p.PID, p.Leases)
	}
	pr.CheckClean(t)
	for _, c := range cs {
		c.CheckClean(t)
	}
}
