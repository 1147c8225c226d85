package producer

import (
	"fmt"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"golang.org/x/sync/errgroup"

	"github.com/cudapool/cudapool/cudart"
	"github.com/cudapool/cudapool/export/internal/inspect"
)

// Releases from many goroutines, each on its own stream with copies of its mapping
// still queued: each import is freed after the work on its own stream, never after
// another stream's later work alone. With one ordering event recorded on every
// caller's stream, the software device saw imports freed under queued reads in
// every run.
func TestConcurrentReleasesOnManyStreams(t *testing.T) {
	pr := newProducer(t, nil, nil)
	const n = 8
	for i := range n {
		pr.publish(t, fmt.Sprint("b", i), 1<<20, byte(0x50+i))
	}
	c := newConsumer(t, pr.path, 1)
	ctx := testCtx(t)
	c.eachOnItsStream(t, n, func(i int, s cudart.Stream) error {
		p, err := c.dev.MemPoolCreate(cudart.PoolProps{Location: cudart.DeviceLocation(1)})
		if err != nil {
			return err
		}
		dst, err := c.dev.MallocFromPoolAsync(1, 1<<20, p, s)
		if err != nil {
			return err
		}
		for range 5 {
			m, err := c.imp.Open(ctx, fmt.Sprint("b", i), s)
			if err != nil {
				return err
			}
			for range 4 { // reads still queued at Release
				if err := c.dev.MemcpyDtoDAsync(1, dst, m.Ptr(), m.Size(), s); err != nil {
					return err
				}
			}
			if err := m.Release(ctx, s); err != nil {
				return err
			}
		}
		return c.dev.FreeAsync(1, dst, s)
	})
	require.NoError(t, c.imp.Close(ctx))
	require.NoError(t, c.dev.Synchronize())
	c.checkClean(t)
}

// The Importer keeps an ordering event per stream released on, but not without
// bound: past maxIdleOrderEvents, those whose last record has run are destroyed.
func TestOrderEventsAreBounded(t *testing.T) {
	pr := newProducer(t, nil, nil)
	pr.publish(t, "a", 1<<20, 1)
	c := newConsumer(t, pr.path, 0)
	ctx := testCtx(t)
	for range 3 * inspect.MaxIdleOrderEvents {
		s, err := c.dev.StreamCreate(0, cudart.StreamNonBlocking)
		require.NoError(t, err)
		m, err := c.imp.Open(ctx, "a", s)
		require.NoError(t, err)
		require.NoError(t, m.Release(ctx, s))
		require.NoError(t, c.dev.StreamSynchronize(0, s))
		require.NoError(t, c.dev.StreamDestroy(0, s))
	}
	kept := inspect.OrderEvents(c.imp)
	assert.LessOrEqual(t, kept, inspect.MaxIdleOrderEvents+1)
	require.NoError(t, c.imp.Close(ctx))
	c.checkClean(t)
}

// eachOnItsStream runs f(i, s) for every i below n at once, each with a stream of its
// own on the consumer's device, which is synchronised after.
func (c *testConsumer) eachOnItsStream(t *testing.T, n int, f func(i int, s cudart.Stream) error) {
	t.Helper()
	var g errgroup.Group
	for i := range n {
		g.Go(func() error {
			s, err := c.dev.StreamCreate(c.ord, cudart.StreamNonBlocking)
			if err != nil {
				return err
			}
			if err := f(i, s); err != nil {
				return err
			}
			return c.dev.StreamSynchronize(c.ord, s)
		})
	}
	require.NoError(t, g.Wait())
}
