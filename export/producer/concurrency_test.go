package producer

import (
	"context"
	"errors"
	"fmt"
	"os"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/cudapool/cudapool/cudart"
	"github.com/cudapool/cudapool/export/consumer"
	"github.com/cudapool/cudapool/internal/testwait"
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
			if !assert.NoError(t, err, "Open") {
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
		// The handler runs on the importer's goroutine: it reports to the test's
		// goroutine, which fails the test, and never fails it itself.
		imp, err := consumer.Dial(ctx, pr.path, s.dev, 0, consumer.WithLogger(discardLogger), consumer.WithPushes(s.stream, func(name string, m *consumer.Mapping) {
			b := make([]byte, m.Size())
			err := s.dev.MemcpyDtoHAsync(s.ord, b, m.Ptr(), s.stream)
			if err == nil && (name != "p" || !allAre(b, 0x31)) {
				err = fmt.Errorf("pushed mapping %q reads wrong bytes", name)
			}
			got <- errors.Join(err, m.Release(ctx, s.stream))
		}))
		require.NoError(t, err)
		t.Cleanup(func() { imp.Close(context.Background()) })
	}
	// Every connection is this process's: one pid, pushed to on all of them at once.
	require.NoError(t, pr.ex.PushAll(ctx, "p", os.Getpid()))
	for range overlapPeers {
		require.NoError(t, testwait.Recv(t, got, "a push handler to read and release its mapping"))
	}
	waitFor(t, "the pushed leases to be released", func() bool { return pr.activeLeases(t) == 0 })
	require.ErrorIs(t, pr.ex.PushAll(ctx, "p", impossiblePID(t)), ErrNoPeer, "PushAll to nobody, want ErrNoPeer")
	require.Error(t, pr.ex.PushAll(ctx, "p"), "PushAll without pids succeeded")
	require.ErrorIs(t, pr.ex.PushAll(ctx, "nope", os.Getpid()), ErrUnknownName, "PushAll of an unknown name, want ErrUnknownName")
	pr.checkClean(t)
}
