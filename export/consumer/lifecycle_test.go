package consumer_test

import (
	"context"
	"fmt"
	"os"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/cudapool/cudapool/cudart"
	"github.com/cudapool/cudapool/export"
	"github.com/cudapool/cudapool/export/consumer"
	"github.com/cudapool/cudapool/export/discover"
	"github.com/cudapool/cudapool/export/internal/exporttest"
	"github.com/cudapool/cudapool/export/internal/wire"
	"github.com/cudapool/cudapool/export/producer"
	"github.com/cudapool/cudapool/internal/testwait"
	"github.com/cudapool/cudapool/pool"
)

func TestQueryStateDescribesPoolsAndPeers(t *testing.T) {
	pr := exporttest.NewProducer(t, []pool.Option{pool.WithName("kv")}, []producer.ListenOption{producer.WithName("unit-producer")})
	pr.Publish(t, "a", 3<<20, 1)
	c := exporttest.NewConsumer(t, pr.Path, 1)
	m, err := c.Imp.Open(exporttest.Ctx(t), "a", c.Stream)
	require.NoError(t, err)
	st, err := discover.QueryState(exporttest.Ctx(t), pr.Path)
	require.NoError(t, err)
	require.Equal(t, export.StateSchema, st.Schema)
	require.Equal(t, "unit-producer", st.Name)
	require.Equal(t, os.Getpid(), st.PID)
	require.Len(t, st.Devices, 2, "state header %+v", st)
	require.Len(t, st.Pools, 1)
	pl := st.Pools[0]
	require.Equal(t, "kv", pl.Name, "pools %+v", st.Pools)
	require.Equal(t, 1, pl.SharedBuffers, "pools %+v", st.Pools)
	require.Equal(t, 1, pl.ActiveLeases, "pools %+v", st.Pools)
	require.Equal(t, cudart.HandleTypePosixFD, pl.HandleType, "pools %+v", st.Pools)
	require.EqualValues(t, 1<<20, st.Pools[0].RoundingOverhead(), "rounding overhead %d, want 1 MiB (3 MiB rounded to 4)", st.Pools[0].RoundingOverhead())
	require.Len(t, st.Published, 1)
	require.Equal(t, "a", st.Published[0].Name)
	require.EqualValues(t, 3<<20, st.Published[0].Size)
	// The consumer; QueryState's own connection, which takes no leases, is left out.
	require.Len(t, st.Peers, 1, "peers %+v, want the consumer alone", st.Peers)
	peer := st.Peers[0]
	require.Equal(t, 1, peer.Leases)
	require.EqualValues(t, 3<<20, peer.BytesLeased)
	require.Equal(t, consumer.DeviceUUID(c.Imp).String(), peer.Device)
	require.False(t, peer.AwaitingExit)
	m.Release(exporttest.Ctx(t), c.Stream)
}

// A consumer that closes its connection without Bye but lives on (here, the test's own
// process) may still map what it holds: its lease, and the free waiting on it, stay
// until its process exits, and no new lease reaches it. Close, whose ctx ends first,
// reports the lease and abandons it: the exporter cannot know the consumer released.
func TestLivePeerThatHangsUpKeepsItsLeases(t *testing.T) {
	pr := exporttest.NewProducer(t, nil, nil)
	before, _ := pr.Pool.Stats()
	b := pr.Publish(t, "a", 1<<20, 1)
	pr.Publish(t, "b", 1<<20, 2)
	c := exporttest.NewConsumer(t, pr.Path, 0)
	ctx := exporttest.Ctx(t)
	m, err := c.Imp.Open(ctx, "a", c.Stream)
	require.NoError(t, err)
	require.NoError(t, b.Free(pr.Stream))
	consumer.Client(c.Imp).C.Close()
	exporttest.WaitFor(t, "the exporter to see the hang-up", func() bool {
		ps := pr.Ex.Peers()
		return len(ps) == 0 || ps[0].AwaitingExit
	})
	s, _ := pr.Pool.Stats()
	require.EqualValues(t, 1, s.ActiveLeases, "pool after a live consumer hung up: %+v, want its lease and the free waiting", s)
	require.EqualValues(t, 1, s.DeferredFrees, "pool after a live consumer hung up: %+v, want its lease and the free waiting", s)
	got := c.Read(t, m)
	require.True(t, exporttest.AllAre(got, 1), "the mapping of a consumer that hung up changed")
	pr.CheckClean(t)
	st, err := pr.Ex.State()
	require.False(t, err != nil || len(st.Peers) != 1 || !st.Peers[0].AwaitingExit || st.Peers[0].Leases != 1, "State peers %+v, %v; want the consumer awaiting its exit with its lease", st.Peers, err)
	require.Contains(t, pr.Log.String(), "held until its process exits", "the held leases are not logged:\n%s", pr.Log.String())
	require.ErrorIs(t, pr.Ex.Push(ctx, "b", os.Getpid()), producer.ErrNoPeer, "Push to a consumer that hung up, want ErrNoPeer")

	// The consumer releases, but cannot tell the exporter any more; the exporter sees
	// nothing either, as the process lives on. Close, with its ctx ended, names the
	// lease and abandons it: it ends when the process exits, never before.
	require.NoError(t, m.Release(ctx, c.Stream), "Release after hanging up, want nil: there is no one to tell")
	err = pr.Ex.Close(exporttest.Ended())
	require.ErrorIs(t, err, context.Canceled, "Close = %v, want the lost consumer's lease reported", err)
	require.ErrorIs(t, err, producer.ErrAbandoned)
	require.ErrorContains(t, err, fmt.Sprintf("pid %d, its connection lost but its process alive, holds 1 leases", os.Getpid()), "Close = %v, want the lost consumer's lease reported", err)
	after, _ := pr.Pool.Stats()
	require.EqualValues(t, 1, after.ActiveLeases, "pool after Close %+v, before the buffers %+v: want the lease kept and the free waiting", after, before)
	require.EqualValues(t, 1, after.DeferredFrees, "pool after Close %+v, before the buffers %+v: want the lease kept and the free waiting", after, before)
	pr.CheckClean(t)
}

// Exporter.Close waits for consumers to release what they hold; Opens after it
// began fail with export.ErrExporterGone.
func TestExporterCloseWaitsForReleases(t *testing.T) {
	pr := exporttest.NewProducer(t, nil, nil)
	pr.Publish(t, "a", 1<<20, 1)
	c := exporttest.NewConsumer(t, pr.Path, 0)
	ctx := exporttest.Ctx(t)
	m, err := c.Imp.Open(ctx, "a", c.Stream)
	require.NoError(t, err)
	closed := make(chan error, 1)
	go func() { closed <- pr.Ex.Close(ctx) }()
	exporttest.WaitFor(t, "the importer to hear Bye", func() bool {
		return consumer.Client(c.Imp).SaidBye()
	})
	_, err = c.Imp.Open(ctx, "a", c.Stream)
	require.ErrorIs(t, err, export.ErrExporterGone, "Open during Close, want export.ErrExporterGone")
	select {
	case err := <-closed:
		t.Fatalf("Close returned %v while a lease was held", err)
	default:
	}
	require.NoError(t, m.Release(ctx, c.Stream))
	require.NoError(t, testwait.Recv(t, closed, "Close to return"))
	require.NoError(t, c.Imp.Close(ctx))
	pr.CheckClean(t)
	c.CheckClean(t)
}

// Peers that stopped reading keep neither Close's Bye from the others nor Close from
// waiting for the others' releases.
func TestCloseWaitsForReleasesPastPeersThatDoNotRead(t *testing.T) {
	pr := exporttest.NewProducer(t, nil, []producer.ListenOption{producer.WithPolicy(export.Policy{AllowRemote: true})})
	pr.Publish(t, "p", 1<<20, 1)
	l := exporttest.NewPipeListener()
	require.NoError(t, pr.Ex.Serve(l))
	// Several, so that the one reading peer is unlikely to be told first by chance.
	for range 4 {
		l.Dial(t, &wire.HelloMsg{Version: export.ProtocolVersion}) // and never read from again
	}
	c := exporttest.NewConsumer(t, pr.Path, 0)
	ctx := exporttest.Ctx(t)
	m, err := c.Imp.Open(ctx, "p", c.Stream)
	require.NoError(t, err)
	closed := make(chan error, 1)
	go func() { closed <- pr.Ex.Close(ctx) }()
	exporttest.WaitFor(t, "the consumer to be told Bye", func() bool {
		return consumer.Client(c.Imp).SaidBye()
	})
	require.NoError(t, m.Release(ctx, c.Stream))
	require.NoError(t, testwait.Recv(t, closed, "Close to return"), "Close, want nil: every lease was released before its context ended")
}
