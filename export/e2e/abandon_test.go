package e2e_test

import (
	"context"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/cudapool/cudapool/export/internal/exporttest"
	"github.com/cudapool/cudapool/export/producer"
)

// Close whose context ends while a live consumer maps a buffer abandons it: nothing is
// freed under the reader, the error says what was left, and the buffer goes back to
// the pool once the consumer releases it. (Close used to end such leases, and the
// producer then freed memory a living process mapped.)
func TestCloseAbandonsWhatALiveConsumerMaps(t *testing.T) {
	pr := exporttest.NewProducer(t, nil, nil)
	before, err := pr.Pool.Stats()
	require.NoError(t, err)
	b := pr.Publish(t, "a", 1<<20, 0x42)
	c := exporttest.NewConsumer(t, pr.Path, 0)
	ctx := exporttest.Ctx(t)
	m, err := c.Imp.Open(ctx, "a", c.Stream)
	require.NoError(t, err)
	require.NoError(t, b.Free(pr.Stream))

	short, cancel := context.WithTimeout(ctx, 20*time.Millisecond)
	defer cancel()
	err = pr.Ex.Close(short)
	require.ErrorIs(t, err, context.DeadlineExceeded)
	assert.ErrorIs(t, err, producer.ErrAbandoned)
	assert.Contains(t, err.Error(), "pid ")
	pr.CheckClean(t)
	assert.True(t, exporttest.AllAre(c.Read(t, m), 0x42), "the consumer still reads what it maps")
	s, err := pr.Pool.Stats()
	require.NoError(t, err)
	assert.Equal(t, 1, s.ActiveLeases, "the lease is kept")
	assert.Equal(t, 1, s.DeferredFrees, "the free still waits for the consumer")

	require.NoError(t, m.Release(ctx, c.Stream))
	require.Eventually(t, func() bool {
		s, _ := pr.Pool.Stats()
		return s.ActiveLeases == 0 && s.DeferredFrees == 0
	}, 5*time.Second, time.Millisecond, "the release after Close frees the buffer")
	pr.PoolBackTo(t, before)
	require.NoError(t, c.Imp.Close(ctx))
	pr.CheckClean(t)
	c.CheckClean(t)
}
