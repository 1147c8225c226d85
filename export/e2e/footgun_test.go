package e2e_test

import (
	"context"
	"os"
	"path/filepath"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/cudapool/cudapool/cudart"
	"github.com/cudapool/cudapool/export"
	"github.com/cudapool/cudapool/export/consumer"
	"github.com/cudapool/cudapool/export/internal/exporttest"
	"github.com/cudapool/cudapool/internal/intercept"
)

// Dialing a path that is a regular file says so, not that the exporter is gone.
func TestDialRegularFileSaysItIsNotASocket(t *testing.T) {
	path := filepath.Join(exporttest.ShortDir(t), "plain")
	require.NoError(t, os.WriteFile(path, []byte("not a socket"), 0o600))
	s := exporttest.NewSide(t, 0)
	_, err := consumer.Dial(exporttest.Ctx(t), path, s.Dev, 0)
	require.ErrorIs(t, err, export.ErrNotSocket)
	assert.NotErrorIs(t, err, export.ErrExporterGone)
	assert.Contains(t, err.Error(), path)
}

// After Free a name is retired at once: a new buffer can be published under it
// without an Open having noticed the free first.
func TestFreeRetiresTheNameAtOnce(t *testing.T) {
	pr := exporttest.NewProducer(t, nil, nil)
	b := pr.Publish(t, "a", 1<<20, 1)
	require.NoError(t, b.Free(pr.Stream))
	pr.Publish(t, "a", 1<<20, 2)
	c := exporttest.NewConsumer(t, pr.Path, 0)
	m, err := c.Imp.Open(exporttest.Ctx(t), "a", c.Stream)
	require.NoError(t, err)
	assert.True(t, exporttest.AllAre(c.Read(t, m), 2))
	require.NoError(t, m.Release(exporttest.Ctx(t), c.Stream))
}

// A final Release whose free fails leaves the Mapping as it was: still mapped, its
// lease held, and a retry works (it used to say "already released" and keep the lease
// for good).
func TestFailedReleaseCanBeRetried(t *testing.T) {
	pr := exporttest.NewProducer(t, nil, nil)
	pr.Publish(t, "a", 1<<20, 5)
	s := exporttest.NewSide(t, 0)
	rt := intercept.Wrap(s.Dev)
	ctx := exporttest.Ctx(t)
	imp, err := consumer.Dial(ctx, pr.Path, rt, 0, consumer.WithLogger(exporttest.DiscardLogger))
	require.NoError(t, err)
	defer imp.Close(context.Background())
	m, err := imp.Open(ctx, "a", s.Stream)
	require.NoError(t, err)
	rt.On.FreeAsync.Fail(1, cudart.NewError("cudaFreeAsync", cudart.ErrUnknown)) // the next free, the import's
	err = m.Release(ctx, s.Stream)
	require.Error(t, err)
	assert.NotErrorIs(t, err, consumer.ErrReleased)
	assert.Equal(t, 1, pr.Ex.Peers()[0].Leases, "the lease is held while the import is mapped")
	require.NoError(t, m.Release(ctx, s.Stream), "the retry frees and releases")
	require.Eventually(t, func() bool { return pr.ActiveLeases(t) == 0 }, exporttest.HangGuard, time.Millisecond)
	assert.ErrorIs(t, m.Release(ctx, s.Stream), consumer.ErrReleased)
	s.CheckClean(t)
}
