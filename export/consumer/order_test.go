package consumer_test

import (
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/cudapool/cudapool/cudart"
	"github.com/cudapool/cudapool/export/consumer"
	"github.com/cudapool/cudapool/export/internal/exporttest"
)

// The Importer keeps an ordering event per stream released on, but not without
// bound: past maxIdleOrderEvents, those whose last record has run are destroyed.
func TestOrderEventsAreBounded(t *testing.T) {
	pr := exporttest.NewProducer(t, nil, nil)
	pr.Publish(t, "a", 1<<20, 1)
	c := exporttest.NewConsumer(t, pr.Path, 0)
	ctx := exporttest.Ctx(t)
	for range 3 * consumer.MaxIdleOrderEvents {
		s, err := c.Dev.StreamCreate(0, cudart.StreamNonBlocking)
		require.NoError(t, err)
		m, err := c.Imp.Open(ctx, "a", s)
		require.NoError(t, err)
		require.NoError(t, m.Release(ctx, s))
		require.NoError(t, c.Dev.StreamSynchronize(0, s))
		require.NoError(t, c.Dev.StreamDestroy(0, s))
	}
	kept := consumer.OrderEvents(c.Imp)
	assert.LessOrEqual(t, kept, consumer.MaxIdleOrderEvents+1)
	require.NoError(t, c.Imp.Close(ctx))
	c.CheckClean(t)
}
