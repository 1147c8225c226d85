package producer

import (
	"testing"

	"github.com/stretchr/testify/require"
)

func TestSmokeOpenReadRelease(t *testing.T) {
	pr := newProducer(t, nil, nil)
	pr.publish(t, "a", 1<<20, 0x5a)
	c := newConsumer(t, pr.path, 0)
	ctx := testCtx(t)
	m, err := c.imp.Open(ctx, "a", c.stream)
	require.NoError(t, err)
	got := c.read(t, m)
	require.True(t, allAre(got, 0x5a), "read %x...", got[:8])
	require.NoError(t, m.Release(ctx, c.stream))
	require.NoError(t, c.imp.Close(ctx))
	require.NoError(t, pr.ex.Close(ctx))
	pr.checkClean(t)
	c.checkClean(t)
	t.Log(pr.log.String())
}
