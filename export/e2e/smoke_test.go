package e2e_test

import (
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/cudapool/cudapool/export/internal/exporttest"
)

func TestSmokeOpenReadRelease(t *testing.T) {
	pr := exporttest.NewProducer(t, nil, nil)
	pr.Publish(t, "a", 1<<20, 0x5a)
	c := exporttest.NewConsumer(t, pr.Path, 0)
	ctx := exporttest.Ctx(t)
	m, err := c.Imp.Open(ctx, "a", c.Stream)
	require.NoError(t, err)
	got := c.Read(t, m)
	require.True(t, exporttest.AllAre(got, 0x5a), "read %x...", got[:8])
	require.NoError(t, m.Release(ctx, c.Stream))
	require.NoError(t, c.Imp.Close(ctx))
	require.NoError(t, pr.Ex.Close(ctx))
	pr.CheckClean(t)
	c.CheckClean(t)
	t.Log(pr.Log.String())
}
