package e2e_test

import (
	"context"
	"fmt"
	"path/filepath"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/cudapool/cudapool/export"
	"github.com/cudapool/cudapool/export/consumer"
	"github.com/cudapool/cudapool/export/internal/exporttest"
	"github.com/cudapool/cudapool/internal/intercept"
	"github.com/cudapool/cudapool/internal/proctest"
	"github.com/cudapool/cudapool/internal/testwait"
)

// startProducerChild runs a producer process publishing "a" (1 MiB of fill) and
// returns it once it is ready, with its socket path.
func startProducerChild(t *testing.T, fill int) (*proctest.Child, string) {
	t.Helper()
	path := filepath.Join(exporttest.ShortDir(t), "p.sock")
	k := proctest.Start(t, "producer", "test", path, "default", fmt.Sprintf("a=1048576:%d", fill))
	k.Expect("ready")
	return k, path
}

// The Importer learns of its exporter's death at once, through a channel a user can
// select on, and says why.
func TestImporterDoneWhenExporterDies(t *testing.T) {
	k, path := startProducerChild(t, 90)
	c := exporttest.NewConsumer(t, path, 0)
	select {
	case <-c.Imp.Done():
		t.Fatal("Done before the exporter died")
	default:
	}
	assert.NoError(t, c.Imp.Err())
	exporttest.KillProducer(t, k)
	select {
	case <-c.Imp.Done():
	case <-time.After(exporttest.Promptly):
		t.Fatal("the Importer did not learn of its exporter's death")
	}
	assert.ErrorIs(t, c.Imp.Err(), export.ErrExporterGone)
}

// A mapping on another GPU than its exporter's must not be touched once the exporter
// is gone (FACTS 14: the read is contained and the whole process's context lost). Its
// context ends at once, Err says why, and Release and Close complete without touching
// the memory: the process keeps its context. A mapping on the owner GPU stays usable
// (FACTS 7).
func TestPeerMappingRefusedOnceExporterGone(t *testing.T) {
	k, path := startProducerChild(t, 90)
	peerSide := exporttest.NewConsumer(t, path, 1)
	ctx := exporttest.Ctx(t)
	m, err := peerSide.Imp.Open(ctx, "a", peerSide.Stream)
	require.NoError(t, err)
	assert.True(t, exporttest.AllAre(peerSide.Read(t, m), 90))
	require.NoError(t, m.Err())
	require.NoError(t, m.Context().Err())

	exporttest.KillProducer(t, k)
	select {
	case <-m.Context().Done():
	case <-time.After(exporttest.Promptly):
		t.Fatal("the peer-GPU mapping's context did not end when its exporter died")
	}
	assert.ErrorIs(t, context.Cause(m.Context()), consumer.ErrMappingLost)
	require.ErrorIs(t, m.Err(), consumer.ErrMappingLost)
	assert.ErrorIs(t, m.Err(), export.ErrExporterGone)
	assert.Contains(t, m.Err().Error(), "another GPU")
	require.NoError(t, m.Release(ctx, peerSide.Stream))
	require.NoError(t, peerSide.Imp.Close(ctx))
	assert.False(t, peerSide.Dev.ContextLost(), "releasing and closing touched the dead exporter's memory from a peer GPU")
	peerSide.CheckClean(t)
}

// WithLocalCopy makes a local copy on the Importer's device and gives the lease back at
// once: the replica outlives its producer on any GPU, and reads the right bytes.
func TestReplicaSurvivesProducerDeath(t *testing.T) {
	k, path := startProducerChild(t, 92)
	c := exporttest.NewConsumer(t, path, 1)
	ctx := exporttest.Ctx(t)
	m, err := c.Imp.Open(ctx, "a", c.Stream, consumer.WithLocalCopy(nil))
	require.NoError(t, err)
	exporttest.KillProducer(t, k)
	testwait.Recv(t, c.Imp.Done(), "the Importer to see its producer die")
	require.NoError(t, m.Err())
	assert.True(t, exporttest.AllAre(c.Read(t, m), 92))
	assert.False(t, c.Dev.ContextLost())
	require.NoError(t, m.Release(ctx, c.Stream))
	require.NoError(t, c.Imp.Close(ctx))
	c.CheckClean(t)
}

func TestReplicaReturnsTheLeaseAtOnce(t *testing.T) {
	pr := exporttest.NewProducer(t, nil, nil)
	b := pr.Publish(t, "a", 3<<20, 0x33)
	c := exporttest.NewConsumer(t, pr.Path, 1)
	ctx := exporttest.Ctx(t)
	m, err := c.Imp.Open(ctx, "a", c.Stream, consumer.WithLocalCopy(nil))
	require.NoError(t, err)
	assert.NotEqual(t, b.Ptr(), m.Ptr(), "a replica lives at an address of its own")
	assert.Equal(t, uint64(3<<20), m.Size())
	require.Eventually(t, func() bool { return pr.ActiveLeases(t) == 0 }, exporttest.Promptly, time.Millisecond)
	require.NoError(t, b.Free(pr.Stream))
	require.Eventually(t, func() bool { s, _ := pr.Pool.Stats(); return s.DeferredFrees == 0 }, exporttest.Promptly, time.Millisecond)
	assert.True(t, exporttest.AllAre(c.Read(t, m), 0x33), "the replica keeps its bytes after the producer freed the buffer")
	require.NoError(t, m.Release(ctx, c.Stream))
	assert.ErrorIs(t, m.Release(ctx, c.Stream), consumer.ErrReleased)
	pr.CheckClean(t)
	c.CheckClean(t)
}

// A producer that dies while an Open is in flight: the Open fails with
// export.ErrExporterGone, and no stream is left waiting on (nor queries) the dead process's
// ready event, which the driver may never complete.
func TestOpenInFlightWhenProducerDies(t *testing.T) {
	k, path := startProducerChild(t, 93)
	s := exporttest.NewSide(t, 0)
	// The producer dies the moment the Importer opens its ready event: with an Open
	// in flight.
	rt := intercept.Wrap(s.Dev)
	rt.On.IpcOpenEventHandle.Once(func() { exporttest.KillProducer(t, k) })
	ctx := exporttest.Ctx(t)
	imp, err := consumer.Dial(ctx, path, rt, 0, consumer.WithLogger(exporttest.DiscardLogger))
	require.NoError(t, err)
	defer imp.Close(ctx)
	_, err = imp.Open(ctx, "a", s.Stream)
	require.ErrorIs(t, err, export.ErrExporterGone)
	s.CheckClean(t)
}
