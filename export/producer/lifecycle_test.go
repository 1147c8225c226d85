package producer_test

import (
	"context"
	"io"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/cudapool/cudapool/cudart"
	"github.com/cudapool/cudapool/cudart/cudarttest"
	"github.com/cudapool/cudapool/export"
	"github.com/cudapool/cudapool/export/internal/exporttest"
	"github.com/cudapool/cudapool/export/internal/wire"
	"github.com/cudapool/cudapool/export/producer"
	"github.com/cudapool/cudapool/internal/intercept"
	"github.com/cudapool/cudapool/internal/session"
	"github.com/cudapool/cudapool/internal/testwait"
	"github.com/cudapool/cudapool/pool"
)

func TestPublishChecks(t *testing.T) {
	pr := exporttest.NewProducer(t, nil, nil)
	b := pr.Publish(t, "a", 1<<20, 1)
	ctx := exporttest.Ctx(t)
	require.ErrorIs(t, pr.Ex.Publish(ctx, "a", b, pr.Stream), producer.ErrNameInUse, "Publish twice, want ErrNameInUse")
	for _, name := range []string{"", strings.Repeat("x", export.MaxNameLen+1), "a\nb", "\xff"} {
		require.ErrorIs(t, pr.Ex.Publish(ctx, name, b, pr.Stream), export.ErrBadName, "Publish(%q), want export.ErrBadName", name)
	}
	require.NoError(t, pr.Ex.Unpublish("a"))
	require.ErrorIs(t, pr.Ex.Unpublish("a"), export.ErrUnknownName, "Unpublish twice, want export.ErrUnknownName")
	local, err := pool.New(pr.Dev, 0, pool.WithHandleType(cudart.HandleTypeNone))
	require.NoError(t, err)
	defer local.Close(ctx, pool.Force())
	lb, err := local.Alloc(ctx, 4096, pr.Stream)
	require.NoError(t, err)
	require.ErrorIs(t, pr.Ex.Publish(ctx, "local", lb, pr.Stream), pool.ErrNotShareable, "Publish of a local pool's buffer, want pool.ErrNotShareable")
}

func TestFabricWithoutIMEXIsReported(t *testing.T) {
	pr := exporttest.NewProducer(t, []pool.Option{pool.WithHandleType(cudart.HandleTypeFabric)}, nil)
	ctx := exporttest.Ctx(t)
	b, err := pr.Pool.Alloc(ctx, 1<<20, pr.Stream)
	require.NoError(t, err)
	err = pr.Ex.Publish(ctx, "f", b, pr.Stream)
	require.ErrorIs(t, err, export.ErrIMEXRequired, "Publish of a FABRIC buffer without IMEX = %v, want export.ErrIMEXRequired", err)
	require.ErrorIs(t, err, cudart.ErrNotPermitted, "Publish of a FABRIC buffer without IMEX = %v, want export.ErrIMEXRequired", err)
	require.Contains(t, err.Error(), "IMEX channel", "Publish of a FABRIC buffer without IMEX = %v, want export.ErrIMEXRequired", err)
}

// A liveness probe (Discover's) connects and hangs up without a word: that is logged
// for debugging only, not as a warning.
func TestProbeIsNotAWarning(t *testing.T) {
	pr := exporttest.NewProducer(t, nil, nil)
	live, err := session.Answers(pr.Path)
	require.False(t, !live || err != nil, "socketAnswers = %v, %v; want a live socket", live, err)
	exporttest.WaitFor(t, "the probe to be logged", func() bool { return strings.Contains(pr.Log.String(), "not admitted") })
	log := pr.Log.String()
	require.False(t, !strings.Contains(log, "level=DEBUG msg=\"producer: connection not admitted\"") || strings.Contains(log, "level=WARN"), "probe logged as more than debugging:\n%s", log)
}

// A producer that vanishes: the mapping stays readable, opens say the exporter is
// gone, release and close complete without error.
func TestProducerCrashLeavesMappingsReadable(t *testing.T) {
	pr := exporttest.NewProducer(t, nil, nil)
	pr.Publish(t, "a", 1<<20, 0x77)
	c := exporttest.NewConsumer(t, pr.Path, 0)
	ctx := exporttest.Ctx(t)
	m, err := c.Imp.Open(ctx, "a", c.Stream)
	require.NoError(t, err)
	require.NoError(t, pr.Dev.Synchronize()) // it dies after its writes ran
	pr.Dev.Close()
	for _, p := range pr.Ex.PeerList() {
		_ = p.HangUp() // as a crash does; its error is not the point
	}
	testwait.Recv(t, c.Imp.Done(), "the importer to see its connection end")
	b := c.Read(t, m)
	require.True(t, exporttest.AllAre(b, 0x77), "mapping unreadable after the producer died")
	_, err = c.Imp.Open(ctx, "a", c.Stream)
	require.ErrorIs(t, err, export.ErrExporterGone, "Open after the producer died, want export.ErrExporterGone")
	require.NoError(t, m.Release(ctx, c.Stream), "Release after the producer died, want nil")
	require.NoError(t, c.Imp.Close(ctx), "Close after the producer died, want nil")
	c.CheckClean(t)
}

// A peer that connects and says nothing must not hold Close up until its handshake
// times out.
func TestCloseCutsSilentPeers(t *testing.T) {
	pr := exporttest.NewProducer(t, nil, []producer.ListenOption{producer.WithHandshakeTimeout(exporttest.HangGuard * 10)})
	r := exporttest.DialRaw(t, pr.Path)
	exporttest.WaitFor(t, "the silent peer to be accepted", func() bool {
		return handshakes(pr) == 1
	})
	require.NoError(t, pr.Ex.Close(exporttest.Ctx(t)))
	require.True(t, r.ClosedByExporter(), "the silent peer's connection stayed open")
	b, err := pr.Pool.Alloc(exporttest.Ctx(t), 4096, pr.Stream)
	require.NoError(t, err)
	require.ErrorIs(t, pr.Ex.Publish(exporttest.Ctx(t), "late", b, pr.Stream), export.ErrClosed, "Publish after Close, want export.ErrClosed")
}

// A grant that reaches a peer after it left (PushAll picked it, then it hung up)
// fails, and opens nothing on its behalf that no one would destroy.
func TestGrantAfterPeerLeftLeaksNoEvent(t *testing.T) {
	var opened *intercept.Live[cudart.Event] // the IPC events opened and not destroyed
	pr := exporttest.NewProducerOn(t, func(r cudart.Runtime) cudart.Runtime {
		rt := intercept.Wrap(r)
		opened = intercept.TrackLive(&rt.On.IpcOpenEventHandle, &rt.On.EventDestroy)
		return rt
	}, nil, nil)
	pr.Publish(t, "p", 1<<20, 1)
	c := exporttest.NewConsumer(t, pr.Path, 0)
	ctx := exporttest.Ctx(t)
	m, err := c.Imp.Open(ctx, "p", c.Stream) // the peer has the pool's handle from now on
	require.NoError(t, err)
	require.NoError(t, m.Release(ctx, c.Stream))
	peers := pr.Ex.PeerList()
	require.Len(t, peers, 1, "%d peers, want 1", len(peers))
	p := peers[0]
	require.NoError(t, c.Imp.Close(ctx))
	exporttest.WaitFor(t, "the peer to leave", func() bool { return len(pr.Ex.PeerList()) == 0 })
	pub, err := pr.Ex.Lookup("p")
	require.NoError(t, err)
	require.ErrorIs(t, p.Push(ctx, pub), producer.ErrNoPeer, "push to a departed peer, want ErrNoPeer")
	n := pr.ActiveLeases(t)
	require.EqualValues(t, 0, n, "%d pool leases held after a push to a departed peer", n)
	n = opened.Len()
	require.EqualValues(t, 0, n, "%d of the departed peer's events left open", n)
}

// An unsent grant released after the peer released the lease it shares (the peer, holding
// the buffer already, released as many grants as it knew of, and the release took the
// newest) still leaves the lease with exactly the grants the peer knows of: none.
func TestUnsentGrantAfterOverlappingReleaseLeavesNothing(t *testing.T) {
	pr := exporttest.NewProducer(t, nil, nil)
	pr.Publish(t, "buf", 1<<20, 1)
	a := admitted(t, pr.Path)
	l, ok := a.Open(1, "buf").(*wire.LeaseMsg)
	require.True(t, ok, "open did not answer with a Lease")
	peers := pr.Ex.PeerList()
	require.Len(t, peers, 1, "%d peers, want 1", len(peers))
	p := peers[0]
	pub, err := pr.Ex.Lookup("buf")
	require.NoError(t, err)
	// A Push's grant, as if its frame were on its way when the peer released.
	pushed, pl, err := p.Grant(exporttest.Ctx(t), pub, 0)
	require.NoError(t, err)
	require.EqualValues(t, l.LeaseID, pushed.LeaseID, "a second grant of a held buffer got another lease id")
	m := a.Release(2, l.LeaseID, 1)
	require.EqualValues(t, wire.MsgReleased, m.Kind(), "release answered %s", m.Kind())
	p.ReleaseUnsent(pushed.LeaseID, pl) // the Push's frame failed to go out
	n := pr.ActiveLeases(t)
	require.EqualValues(t, 0, n, "%d pool leases held, though the peer released the one grant it knew of", n)
	i := p.State()
	require.EqualValues(t, 0, i.Leases, "peer holds %d leases, %d grants; want none", i.Leases, i.Grants)
	require.EqualValues(t, 0, i.Grants, "peer holds %d leases, %d grants; want none", i.Leases, i.Grants)
}

// A grant waiting for another grant's pool handle to go out, to a peer that stopped
// reading, gives up when its context ends.
func TestGrantBehindStuckPoolHandleHonoursContext(t *testing.T) {
	pr := exporttest.NewProducer(t, []pool.Option{pool.WithHandleType(cudart.HandleTypeFabric)},
		[]producer.ListenOption{producer.WithPolicy(export.Policy{AllowRemote: true})}, cudarttest.WithFabric())
	pr.Publish(t, "f", 2<<20, 1)
	l := exporttest.NewPipeListener()
	require.NoError(t, pr.Ex.Serve(l))
	c := l.Dial(t, &wire.HelloMsg{Version: export.ProtocolVersion, Flags: wire.HelloLeases, HandleTypes: uint32(cudart.HandleTypeFabric)})
	peers := pr.Ex.PeerList()
	require.Len(t, peers, 1, "%d peers, want 1", len(peers))
	p := peers[0]
	require.NoError(t, c.Send(exporttest.Ctx(t), &wire.OpenMsg{ReqID: 1, Name: "f"}, -1))
	var first [1]byte
	_, err := io.ReadFull(c.Nc, first[:]) // the pool handle is on its way
	require.NoError(t, err)
	pub, err := pr.Ex.Lookup("f")
	require.NoError(t, err)
	ctx, cancel := context.WithCancel(exporttest.Ctx(t))
	cancel()
	pushed := make(chan error, 1)
	go func() { pushed <- p.Push(ctx, pub) }()
	select {
	case err := <-pushed:
		require.ErrorIs(t, err, context.Canceled, "push = %v, want context.Canceled", err)
	case <-time.After(exporttest.HangGuard):
		t.Fatal("a grant behind a stuck pool handle ignored its ended context")
	}
}
