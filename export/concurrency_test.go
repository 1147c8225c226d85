package export

import (
	"context"
	"errors"
	"os"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/cudapool/cudapool/cudart"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// rendezvousRuntime makes the exporter's first use of each peer's release event
// (IpcOpenEventHandle, in the peer's first grant) wait until n grants are in it at
// once. Grants to different peers that were served one after another would never
// all be there: the first fails after hangGuard instead, and so does the test.
type rendezvousRuntime struct {
	cudart.Runtime
	n       int
	mu      sync.Mutex
	arrived int
	all     chan struct{}
}

func (r *rendezvousRuntime) IpcOpenEventHandle(dev int, h cudart.IpcEventHandle) (cudart.Event, error) {
	r.mu.Lock()
	if r.arrived++; r.arrived == r.n {
		close(r.all)
	}
	r.mu.Unlock()
	select {
	case <-r.all:
	case <-time.After(hangGuard):
		return 0, errors.New("test: the other peers' grants never came while this one waited")
	}
	return r.Runtime.IpcOpenEventHandle(dev, h)
}

func newRendezvousProducer(t *testing.T, n int) *producer {
	return newProducerOn(t, func(rt cudart.Runtime) cudart.Runtime {
		return &rendezvousRuntime{Runtime: rt, n: n, all: make(chan struct{})}
	}, nil, nil)
}

const overlapPeers = 3

func TestOpensOfManyConsumersOverlap(t *testing.T) {
	pr := newRendezvousProducer(t, overlapPeers)
	pr.publish(t, "p", 1<<20, 0x21)
	ctx := testCtx(t)
	var wg sync.WaitGroup
	for range overlapPeers {
		c := newConsumer(t, pr.path, 0)
		wg.Go(func() {
			m, err := c.imp.Open(ctx, "p", c.stream)
			if err != nil {
				t.Errorf("Open: %v", err)
				return
			}
			b := c.read(t, m)
			assert.True(t, allAre(b, 0x21), "mapping reads wrong bytes")
			assert.NoError(t, m.Release(ctx, c.stream), "Release")
		})
	}
	wg.Wait()
	n := pr.activeLeases(t)
	require.EqualValues(t, 0, n, "%d leases after every consumer released", n)
	pr.checkClean(t)
}

func TestPushAllSendsToEveryPeerAtOnce(t *testing.T) {
	pr := newRendezvousProducer(t, overlapPeers)
	pr.publish(t, "p", 1<<20, 0x31)
	ctx := testCtx(t)
	got := make(chan error, overlapPeers)
	for range overlapPeers {
		s := newSide(t, 0)
		c := &consumer{side: s}
		imp, err := Dial(ctx, pr.path, s.dev, 0, WithLogger(discardLogger), WithPushes(s.stream, func(name string, m *Mapping) {
			var err error
			if b := c.read(t, m); name != "p" || !allAre(b, 0x31) {
				err = errors.New("pushed mapping reads wrong bytes")
			}
			got <- errors.Join(err, m.Release(ctx, s.stream))
		}))
		require.NoError(t, err)
		t.Cleanup(func() { imp.Close(context.Background()) })
	}
	// Every connection is this process's: one pid, pushed to on all of them at once.
	require.NoError(t, pr.ex.PushAll(ctx, "p", os.Getpid()))
	for range overlapPeers {
		require.NoError(t, <-got)
	}
	waitFor(t, "the pushed leases to be released", func() bool { return pr.activeLeases(t) == 0 })
	require.ErrorIs(t, pr.ex.PushAll(ctx, "p", impossiblePID(t)), ErrNoPeer, "PushAll to nobody, want ErrNoPeer")
	require.Error(t, pr.ex.PushAll(ctx, "p"), "PushAll without pids succeeded")
	require.ErrorIs(t, pr.ex.PushAll(ctx, "nope", os.Getpid()), ErrUnknownName, "PushAll of an unknown name, want ErrUnknownName")
	pr.checkClean(t)
}

// countingRuntime counts the calls that make a stream or the host wait, and can
// report every event as not yet complete, as a busy GPU would.
type countingRuntime struct {
	cudart.Runtime
	busy  atomic.Bool
	waits atomic.Int64 // StreamWaitEvent
	syncs atomic.Int64 // StreamSynchronize, EventSynchronize
}

func (r *countingRuntime) StreamWaitEvent(dev int, s cudart.Stream, e cudart.Event) error {
	r.waits.Add(1)
	return r.Runtime.StreamWaitEvent(dev, s, e)
}

func (r *countingRuntime) StreamSynchronize(dev int, s cudart.Stream) error {
	r.syncs.Add(1)
	return r.Runtime.StreamSynchronize(dev, s)
}

func (r *countingRuntime) EventSynchronize(dev int, e cudart.Event) error {
	r.syncs.Add(1)
	return r.Runtime.EventSynchronize(dev, e)
}

func (r *countingRuntime) EventQuery(dev int, e cudart.Event) (bool, error) {
	if r.busy.Load() {
		return false, nil
	}
	return r.Runtime.EventQuery(dev, e)
}

// TestCyclesWaitOnlyForWorkNotDone cycles a consumer through a ring of published
// buffers, as the sustained benchmark does. With the other side's work done, no
// stream waits on the other process and the host never waits for the GPU: the only
// wait is the one Release orders its free with. With the work pending, every
// cross-process wait is made, and a record freed earlier is imported again only
// after its free.
func TestCyclesWaitOnlyForWorkNotDone(t *testing.T) {
	const ring, rounds = 4, 3
	var prt *countingRuntime
	pr := newProducerOn(t, func(rt cudart.Runtime) cudart.Runtime {
		prt = &countingRuntime{Runtime: rt}
		return prt
	}, nil, nil)
	names := make([]string, ring)
	for i := range names {
		names[i] = string(rune('a' + i))
		pr.publish(t, names[i], 1<<20, byte(i+1))
	}
	s := newSide(t, 0)
	crt := &countingRuntime{Runtime: s.dev}
	imp, err := Dial(testCtx(t), pr.path, crt, 0, WithLogger(discardLogger))
	require.NoError(t, err)
	t.Cleanup(func() { imp.Close(context.Background()) })
	c := &consumer{side: s, imp: imp}
	ctx := testCtx(t)
	cycle := func() {
		t.Helper()
		for i := range ring * rounds {
			m, err := imp.Open(ctx, names[i%ring], s.stream)
			require.NoError(t, err)
			b := c.read(t, m)
			require.True(t, allAre(b, byte(i%ring+1)), "cycle %d reads wrong bytes", i)
			require.NoError(t, m.Release(ctx, s.stream))
		}
	}
	type counts struct{ prodWaits, consWaits, consSyncs int64 }
	measure := func() counts {
		return counts{prt.waits.Load(), crt.waits.Load(), crt.syncs.Load()}
	}
	const n = ring * rounds
	before := measure()
	cycle()
	after := measure()
	got, want := (counts{after.prodWaits - before.prodWaits, after.consWaits - before.consWaits, after.consSyncs - before.consSyncs}), (counts{0, n, 0})
	require.EqualValues(t, want, got, "with the GPU done: producer stream waits, consumer stream waits, consumer host waits = %+v, want %+v", got, want)

	prt.busy.Store(true)
	crt.busy.Store(true)
	before = measure()
	cycle()
	after = measure()
	require.EqualValues(t, n, after.prodWaits-before.prodWaits, "with the consumer's frees pending, the producer's stream's waits for %d releases", n)
	require.EqualValues(t, 2*n, after.consWaits-before.consWaits, "with the producer's writes pending, the consumer's streams' waits for %d opens and releases", n)
	// Each Open re-imports the record freed a ring ago, only once that free is done:
	// one wait covers the frees of a whole turn of the ring.
	require.EqualValues(t, rounds, after.consSyncs-before.consSyncs, "with frees pending, the consumer's waits for them in %d turns of the ring", rounds)
	pr.checkClean(t)
	s.checkClean(t)
}
