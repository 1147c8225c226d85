package producer

import (
	"context"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/cudapool/cudapool/cudart"
	"github.com/cudapool/cudapool/cudart/cudarttest"
	"github.com/cudapool/cudapool/export/consumer"
	"github.com/cudapool/cudapool/export/internal/inspect"
	"github.com/cudapool/cudapool/export/internal/wire"
	"github.com/cudapool/cudapool/internal/proctest"
	"github.com/cudapool/cudapool/internal/testwait"
)

// promptly bounds how long "at once" may take in these tests: a socket's end reaches
// the reader in microseconds; this only keeps a broken test from hanging.
const promptly = 5 * time.Second

// startProducerChild runs a producer process publishing "a" (1 MiB of fill) and
// returns it once it is ready, with its socket path.
func startProducerChild(t *testing.T, fill int) (*proctest.Child, string) {
	t.Helper()
	path := filepath.Join(shortDir(t), "p.sock")
	k := proctest.Start(t, "producer", "test", path, "default", fmt.Sprintf("a=1048576:%d", fill))
	k.Expect("ready")
	return k, path
}

// killProducer SIGKILLs a producer child and reaps it.
func killProducer(t *testing.T, k *proctest.Child) {
	t.Helper()
	k.Kill()
	killedBySIGKILL(t, k)
}

// The Importer learns of its exporter's death at once, through a channel a user can
// select on, and says why.
func TestImporterDoneWhenExporterDies(t *testing.T) {
	k, path := startProducerChild(t, 90)
	c := newConsumer(t, path, 0)
	select {
	case <-c.imp.Done():
		t.Fatal("Done before the exporter died")
	default:
	}
	assert.NoError(t, c.imp.Err())
	killProducer(t, k)
	select {
	case <-c.imp.Done():
	case <-time.After(promptly):
		t.Fatal("the Importer did not learn of its exporter's death")
	}
	assert.ErrorIs(t, c.imp.Err(), wire.ErrExporterGone)
}

// A mapping on another GPU than its exporter's must not be touched once the exporter
// is gone (FACTS 14: the read is contained and the whole process's context lost). Its
// context ends at once, Err says why, and Release and Close complete without touching
// the memory: the process keeps its context. A mapping on the owner GPU stays usable
// (FACTS 7).
func TestPeerMappingRefusedOnceExporterGone(t *testing.T) {
	k, path := startProducerChild(t, 90)
	peerSide := newConsumer(t, path, 1)
	ctx := testCtx(t)
	m, err := peerSide.imp.Open(ctx, "a", peerSide.stream)
	require.NoError(t, err)
	assert.True(t, allAre(peerSide.read(t, m), 90))
	require.NoError(t, m.Err())
	require.NoError(t, m.Context().Err())

	killProducer(t, k)
	select {
	case <-m.Context().Done():
	case <-time.After(promptly):
		t.Fatal("the peer-GPU mapping's context did not end when its exporter died")
	}
	assert.ErrorIs(t, context.Cause(m.Context()), consumer.ErrMappingLost)
	require.ErrorIs(t, m.Err(), consumer.ErrMappingLost)
	assert.ErrorIs(t, m.Err(), wire.ErrExporterGone)
	assert.Contains(t, m.Err().Error(), "another GPU")
	require.NoError(t, m.Release(ctx, peerSide.stream))
	require.NoError(t, peerSide.imp.Close(ctx))
	assert.False(t, peerSide.dev.ContextLost(), "releasing and closing touched the dead exporter's memory from a peer GPU")
	peerSide.checkClean(t)
}

// WithReplica makes a local copy on the Importer's device and gives the lease back at
// once: the replica outlives its producer on any GPU, and reads the right bytes.
func TestReplicaSurvivesProducerDeath(t *testing.T) {
	k, path := startProducerChild(t, 92)
	c := newConsumer(t, path, 1)
	ctx := testCtx(t)
	m, err := c.imp.Open(ctx, "a", c.stream, consumer.WithReplica(nil))
	require.NoError(t, err)
	killProducer(t, k)
	testwait.Recv(t, c.imp.Done(), "the Importer to see its producer die")
	require.NoError(t, m.Err())
	assert.True(t, allAre(c.read(t, m), 92))
	assert.False(t, c.dev.ContextLost())
	require.NoError(t, m.Release(ctx, c.stream))
	require.NoError(t, c.imp.Close(ctx))
	c.checkClean(t)
}

func TestReplicaReturnsTheLeaseAtOnce(t *testing.T) {
	pr := newProducer(t, nil, nil)
	b := pr.publish(t, "a", 3<<20, 0x33)
	c := newConsumer(t, pr.path, 1)
	ctx := testCtx(t)
	m, err := c.imp.Open(ctx, "a", c.stream, consumer.WithReplica(nil))
	require.NoError(t, err)
	assert.NotEqual(t, b.Ptr(), m.Ptr(), "a replica lives at an address of its own")
	assert.Equal(t, uint64(3<<20), m.Size())
	require.Eventually(t, func() bool { return pr.activeLeases(t) == 0 }, promptly, time.Millisecond)
	require.NoError(t, b.Free(pr.stream))
	require.Eventually(t, func() bool { s, _ := pr.pool.Stats(); return s.DeferredFrees == 0 }, promptly, time.Millisecond)
	assert.True(t, allAre(c.read(t, m), 0x33), "the replica keeps its bytes after the producer freed the buffer")
	require.NoError(t, m.Release(ctx, c.stream))
	assert.ErrorIs(t, m.Release(ctx, c.stream), consumer.ErrReleased)
	pr.checkClean(t)
	c.checkClean(t)
}

// killAtEventOpen is a consumer runtime that kills the producer the moment the
// Importer opens the producer's ready event: the producer dies with an Open in flight.
type killAtEventOpen struct {
	cudart.Runtime
	once sync.Once
	kill func()
}

func (r *killAtEventOpen) IpcOpenEventHandle(dev int, h cudart.IpcEventHandle) (cudart.Event, error) {
	r.once.Do(r.kill)
	return r.Runtime.IpcOpenEventHandle(dev, h)
}

// A producer that dies while an Open is in flight: the Open fails with
// ErrExporterGone, and no stream is left waiting on (nor queries) the dead process's
// ready event, which the driver may never complete.
func TestOpenInFlightWhenProducerDies(t *testing.T) {
	k, path := startProducerChild(t, 93)
	s := newSide(t, 0)
	rt := &killAtEventOpen{Runtime: s.dev, kill: func() { killProducer(t, k) }}
	ctx := testCtx(t)
	imp, err := consumer.Dial(ctx, path, rt, 0, consumer.WithLogger(discardLogger))
	require.NoError(t, err)
	defer imp.Close(ctx)
	_, err = imp.Open(ctx, "a", s.stream)
	require.ErrorIs(t, err, wire.ErrExporterGone)
	s.checkClean(t)
}

// countEventOpens counts the IPC events the exporter opens.
type countEventOpens struct {
	cudart.Runtime
	opens atomic.Int32
}

func (r *countEventOpens) IpcOpenEventHandle(dev int, h cudart.IpcEventHandle) (cudart.Event, error) {
	r.opens.Add(1)
	return r.Runtime.IpcOpenEventHandle(dev, h)
}

// The exporter opens a consumer's release event on its first grant; a consumer whose
// process has exited by then (its socket kept open by another process) must not have
// its event opened: the exporter asks the process handle it holds first.
func TestReleaseEventOfExitedConsumerIsNotOpened(t *testing.T) {
	var counter *countEventOpens
	pr := newProducerOn(t, func(rt cudart.Runtime) cudart.Runtime {
		counter = &countEventOpens{Runtime: rt}
		return counter
	}, nil, nil)
	pr.publish(t, "a", 1<<20, 1)
	k := proctest.Start(t, "lingering-consumer", pr.path)
	f := strings.Fields(k.Next())
	require.Len(t, f, 2)
	require.Equal(t, "ready", f[0])
	holder, err := strconv.Atoi(f[1])
	require.NoError(t, err)
	defer func() {
		syscall.Kill(holder, syscall.SIGKILL)
		var ws syscall.WaitStatus
		syscall.Wait4(holder, &ws, 0, nil)
	}()
	k.Kill()
	killedBySIGKILL(t, k)
	err = pr.ex.Push(testCtx(t), "a", k.PID())
	require.Error(t, err)
	assert.ErrorIs(t, err, ErrNoPeer)
	assert.Zero(t, counter.opens.Load(), "the release event of an exited process was opened")
	pr.checkClean(t)
}

// roleLingeringConsumer: lingering-consumer SOCKET
// It connects an Importer on a software device of its own, hands a duplicate of the
// connection to a child that only sleeps (so the socket outlives this process), says
// "ready HOLDERPID" and waits to be killed.
func roleLingeringConsumer(args []string) int {
	fail := func(err error) int { fmt.Fprintln(os.Stderr, "lingering-consumer:", err); return 1 }
	d := cudarttest.New()
	imp, err := consumer.Dial(context.Background(), args[0], d, 0)
	if err != nil {
		return fail(err)
	}
	f, err := inspect.Client(imp).C.Nc.(interface{ File() (*os.File, error) }).File()
	if err != nil {
		return fail(err)
	}
	holder := exec.Command("sleep", "600")
	holder.ExtraFiles = []*os.File{f}
	if err := holder.Start(); err != nil {
		return fail(err)
	}
	fmt.Println("ready", holder.Process.Pid)
	for range proctest.Commands() {
	}
	return 0
}
