package consumer_test

import (
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/cudapool/cudapool/export/consumer"
	"github.com/cudapool/cudapool/export/internal/exporttest"
)

// A record released a moment ago is imported again only once its free has run: the
// pending free would otherwise unmap the new import, which has the same address
// (FACTS 4).
func TestReopenAfterReleaseAwaitsTheFree(t *testing.T) {
	pr := exporttest.NewProducer(t, nil, nil)
	pr.Publish(t, "a", 1<<20, 5)
	c, busy := exporttest.NewBusyConsumer(t, pr.Path)
	s, imp, ctx := c.Side, c.Imp, exporttest.Ctx(t)
	m, err := imp.Open(ctx, "a", s.Stream)
	require.NoError(t, err)
	busy.Stall(t, s) // the free of the import waits for it
	require.NoError(t, m.Release(ctx, s.Stream))
	require.Equal(t, 1, consumer.FreesPending(imp), "frees tracked after a release")
	m2, err := imp.Open(ctx, "a", s.Stream)
	require.NoError(t, err)
	busy.End() // had Open not waited for the free, it would run now, under the new import
	require.NotSame(t, m, m2, "reopen returned the released mapping")
	require.Zero(t, consumer.FreesPending(imp), "frees still tracked after a reopen that waited for them")
	require.True(t, exporttest.AllAre(c.Read(t, m2), 5), "reopened mapping reads wrong bytes")
	require.NoError(t, m2.Release(ctx, s.Stream))
	c.CheckClean(t)
	pr.CheckClean(t)
}
