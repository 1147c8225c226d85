package producer_test

import (
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/cudapool/cudapool/export/consumer"
	"github.com/cudapool/cudapool/export/internal/exporttest"
)

func TestOpenTwiceSharesOneMapping(t *testing.T) {
	pr := exporttest.NewProducer(t, nil, nil)
	pr.Publish(t, "a", 1<<20, 7)
	require.NoError(t, pr.Ex.Publish(exporttest.Ctx(t), "alias", pr.Ex.PublishedBuffer("a"), pr.Stream))
	c := exporttest.NewConsumer(t, pr.Path, 0)
	ctx := exporttest.Ctx(t)
	m1, err := c.Imp.Open(ctx, "a", c.Stream)
	require.NoError(t, err)
	m2, err := c.Imp.Open(ctx, "alias", c.Stream)
	require.NoError(t, err)
	require.Same(t, m1, m2, "the same buffer opened twice gave two Mappings")
	require.NoError(t, m1.Release(ctx, c.Stream))
	// Still mapped: the second reference holds it.
	got := c.Read(t, m2)
	require.True(t, exporttest.AllAre(got, 7), "mapping unreadable after the first of two releases")
	// Both grants stay with the exporter until the last reference goes: the import
	// is one, and it is freed once.
	n := pr.ActiveLeases(t)
	require.EqualValues(t, 2, n, "%d pool leases while one of two references is held, want 2", n)
	require.NoError(t, m2.Release(ctx, c.Stream))
	n = pr.ActiveLeases(t)
	require.EqualValues(t, 0, n, "%d pool leases after the last release, want 0", n)
	require.ErrorIs(t, m2.Release(ctx, c.Stream), consumer.ErrReleased, "third release, want ErrReleased")
	pr.CheckClean(t)
	c.CheckClean(t)
}
