package e2e_test

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
	"github.com/cudapool/cudapool/export"
	"github.com/cudapool/cudapool/export/consumer"
	"github.com/cudapool/cudapool/export/internal/exporttest"
	"github.com/cudapool/cudapool/export/producer"
	"github.com/cudapool/cudapool/internal/intercept"
	"github.com/cudapool/cudapool/internal/testwait"
)

// newRendezvousProducer is a producer whose first use of each peer's release event
// (IpcOpenEventHandle, in the peer's first grant) waits until n grants are in it at
// once. Grants to different peers that were served one after another would never all
// be there: the first fails after HangGuard instead, and so does the test.
func newRendezvousProducer(t *testing.T, n int) *exporttest.Producer {
	return exporttest.NewProducerOn(t, func(r cudart.Runtime) cudart.Runtime {
		rt := intercept.Wrap(r)
		var mu sync.Mutex
		arrived, all := 0, make(chan struct{})
		rt.On.IpcOpenEventHandle.Before(func(int, cudart.IpcEventHandle) error {
			mu.Lock()
			if arrived++; arrived == n {
				close(all)
			}
			mu.Unlock()
			select {
			case <-all:
				return nil
			case <-time.After(exporttest.HangGuard):
				return errors.New("test: the other peers' grants never came while this one waited")
			}
		})
		return rt
	}, nil, nil)
}

const overlapPeers = 3

func TestOpensOfManyConsumersOverlap(t *testing.T) {
	pr := newRendezvousProducer(t, overlapPeers)
	pr.Publish(t, "p", 1<<20, 0x21)
	ctx := exporttest.Ctx(t)
	var wg sync.WaitGroup
	for range overlapPeers {
		c := exporttest.NewConsumer(t, pr.Path, 0)
		wg.Go(func() {
			m, err := c.Imp.Open(ctx, "p", c.Stream)
			if !assert.NoError(t, err, "Open") {
				return
			}
			b := c.Read(t, m)
			assert.True(t, exporttest.AllAre(b, 0x21), "mapping reads wrong bytes")
			assert.NoError(t, m.Release(ctx, c.Stream), "Release")
		})
	}
	wg.Wait()
	n := pr.ActiveLeases(t)
	require.EqualValues(t, 0, n, "%d leases after every consumer released", n)
	pr.CheckClean(t)
}

func TestPushAllSendsToEveryPeerAtOnce(t *testing.T) {
	pr := newRendezvousProducer(t, overlapPeers)
	pr.Publish(t, "p", 1<<20, 0x31)
	ctx := exporttest.Ctx(t)
	got := make(chan error, overlapPeers)
	for range overlapPeers {
		s := exporttest.NewSide(t, 0)
		// The handler runs on the importer's goroutine: it reports to the test's
		// goroutine, which fails the test, and never fails it itself.
		imp, err := consumer.Dial(ctx, pr.Path, s.Dev, 0, consumer.WithLogger(exporttest.DiscardLogger), consumer.WithPushes(func(name string, m *consumer.Mapping) {
			b := make([]byte, m.Size())
			err := s.Dev.MemcpyDtoHAsync(s.Ord, b, m.Ptr(), s.Stream)
			if err == nil && (name != "p" || !exporttest.AllAre(b, 0x31)) {
				err = fmt.Errorf("pushed mapping %q reads wrong bytes", name)
			}
			got <- errors.Join(err, m.Release(ctx, s.Stream))
		}, s.Stream))
		require.NoError(t, err)
		t.Cleanup(func() { imp.Close(context.Background()) })
	}
	// Every connection is this process's: one pid, pushed to on all of them at once.
	require.NoError(t, pr.Ex.PushAll(ctx, "p", os.Getpid()))
	for range overlapPeers {
		require.NoError(t, testwait.Recv(t, got, "a push handler to read and release its mapping"))
	}
	exporttest.WaitFor(t, "the pushed leases to be released", func() bool { return pr.ActiveLeases(t) == 0 })
	require.ErrorIs(t, pr.Ex.PushAll(ctx, "p", exporttest.ImpossiblePID(t)), producer.ErrNoPeer, "PushAll to nobody, want ErrNoPeer")
	require.Error(t, pr.Ex.PushAll(ctx, "p"), "PushAll without pids succeeded")
	require.ErrorIs(t, pr.Ex.PushAll(ctx, "nope", os.Getpid()), export.ErrUnknownName, "PushAll of an unknown name, want export.ErrUnknownName")
	pr.CheckClean(t)
}
