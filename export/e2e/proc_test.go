package e2e_test

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/cudapool/cudapool/export"
	"github.com/cudapool/cudapool/export/consumer"
	"github.com/cudapool/cudapool/export/internal/exporttest"
	"github.com/cudapool/cudapool/internal/proctest"
	"github.com/cudapool/cudapool/internal/testwait"
)

// SIGKILL the producer: this consumer's mapping, on the producer's own GPU, stays
// readable (FACTS 7; on another GPU it would not, FACTS 14), new opens say the
// exporter is gone, and release and close complete without error.
func TestProcessProducerKilled(t *testing.T) {
	path := filepath.Join(exporttest.ShortDir(t), "p.sock")
	k := proctest.Start(t, "producer", "test", path, "default", "a=1048576:90")
	k.Expect("ready")
	c := exporttest.NewConsumer(t, path, 0)
	ctx := exporttest.Ctx(t)
	m, err := c.Imp.Open(ctx, "a", c.Stream)
	require.NoError(t, err)
	exporttest.KillProducer(t, k)
	testwait.Recv(t, c.Imp.Done(), "the importer to see its connection end")
	require.ErrorIs(t, c.Imp.Err(), export.ErrExporterGone)
	require.NoError(t, m.Err(), "a mapping on the owner GPU outlives its exporter")
	require.NoError(t, m.Context().Err())
	b := c.Read(t, m)
	require.True(t, exporttest.AllAre(b, 90), "mapping unreadable after the producer was killed: %v ... %v", b[:8], b[len(b)-8:])
	_, err = c.Imp.Open(ctx, "a", c.Stream)
	require.ErrorIs(t, err, export.ErrExporterGone, "Open after the producer was killed = %v, want export.ErrExporterGone", err)
	require.ErrorContains(t, err, "exporter is gone", "Open after the producer was killed = %v, want export.ErrExporterGone", err)
	require.NoError(t, m.Release(ctx, c.Stream), "Release, want nil")
	require.ErrorIs(t, context.Cause(m.Context()), consumer.ErrReleased)
	require.NoError(t, c.Imp.Close(ctx), "Close, want nil")
	c.CheckClean(t)
}

// A producer in another process whose policy does not admit our uid refuses us, and
// says why.
func TestProcessPolicyRefusal(t *testing.T) {
	path := filepath.Join(exporttest.ShortDir(t), "p.sock")
	k := proctest.Start(t, "producer", "test", path, "other-uid", "a=4096:1")
	k.Expect("ready")
	s := exporttest.NewSide(t, 0)
	_, err := consumer.Dial(exporttest.Ctx(t), path, s.Dev, 0)
	require.ErrorIs(t, err, export.ErrRefused, "Dial = %v, want export.ErrRefused naming our uid", err)
	require.ErrorContains(t, err, fmt.Sprintf("uid %d gid %d is not allowed", os.Getuid(), os.Getgid()), "Dial = %v, want export.ErrRefused naming our uid", err)
	k.Send("quit")
	k.Finish()
}

// A producer in another process, closed cleanly, waits for our release first.
func TestProcessProducerClosesAfterRelease(t *testing.T) {
	path := filepath.Join(exporttest.ShortDir(t), "p.sock")
	k := proctest.Start(t, "producer", "test", path, "default", "a=2097152:3", "b=4096:4")
	k.Expect("ready")
	c := exporttest.NewConsumer(t, path, 0)
	ctx := exporttest.Ctx(t)
	m, err := c.Imp.Open(ctx, "a", c.Stream)
	require.NoError(t, err)
	k.Send("free a")
	k.Expect("freed")
	k.Send("stats")
	got := k.Next()
	require.EqualValues(t, "stats 2 1 1", got, "producer %q, want 2 live buffers, 1 lease, 1 deferred free", got)
	b := c.Read(t, m)
	require.True(t, exporttest.AllAre(b, 3), "freed-while-leased buffer changed")
	require.NoError(t, m.Release(ctx, c.Stream))
	k.Send("stats")
	got = k.Next()
	require.EqualValues(t, "stats 1 0 0", got, "producer %q after release, want 1 live buffer, no lease, no deferred free", got)
	require.NoError(t, c.Imp.Close(ctx))
	k.Send("quit")
	k.Finish()
	c.CheckClean(t)
}
