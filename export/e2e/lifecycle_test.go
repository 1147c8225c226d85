package e2e_test

import (
	"context"
	"io/fs"
	"net"
	"os"
	"syscall"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/cudapool/cudapool/cudart"
	"github.com/cudapool/cudapool/cudart/cudarttest"
	"github.com/cudapool/cudapool/export"
	"github.com/cudapool/cudapool/export/consumer"
	"github.com/cudapool/cudapool/export/discover"
	"github.com/cudapool/cudapool/export/internal/exporttest"
	"github.com/cudapool/cudapool/export/producer"
	"github.com/cudapool/cudapool/internal/testwait"
	"github.com/cudapool/cudapool/pool"
)

func TestPolicyRefusesWithReason(t *testing.T) {
	other := uint32(os.Getuid()) + 1
	pr := exporttest.NewProducer(t, nil, []producer.ListenOption{producer.WithPolicy(export.Policy{AllowUIDs: []uint32{other}})})
	s := exporttest.NewSide(t, 0)
	_, err := consumer.Dial(exporttest.Ctx(t), pr.Path, s.Dev, 0)
	require.ErrorIs(t, err, export.ErrRefused, "Dial = %v, want export.ErrRefused with the reason", err)
	require.ErrorContains(t, err, "is not allowed", "Dial = %v, want export.ErrRefused with the reason", err)
	_, err = discover.QueryState(exporttest.Ctx(t), pr.Path)
	require.ErrorIs(t, err, export.ErrRefused, "QueryState, want export.ErrRefused: the same policy applies")
	require.Contains(t, pr.Log.String(), "level=WARN msg=\"producer: connection not admitted\"", "refusal not logged as a warning:\n%s", pr.Log.String())
	n := len(pr.Ex.Peers())
	require.EqualValues(t, 0, n, "%d peers after refusals", n)
	s.CheckClean(t)
}

func TestPolicyAdmits(t *testing.T) {
	uid, gid := uint32(os.Getuid()), uint32(os.Getgid())
	for _, p := range []export.Policy{{}, {AllowUIDs: []uint32{uid}}, {AllowGIDs: []uint32{gid}}, {AllowUIDs: []uint32{uid + 1}, AllowGIDs: []uint32{gid}}} {
		pr := exporttest.NewProducer(t, nil, []producer.ListenOption{producer.WithPolicy(p)})
		exporttest.NewConsumer(t, pr.Path, 0)
	}
}

func TestPushHandsBufferToHandler(t *testing.T) {
	pr := exporttest.NewProducer(t, nil, nil)
	pr.Publish(t, "p", 1<<20, 0x11)
	got := make(chan *consumer.Mapping, 1)
	s := exporttest.NewSide(t, 0)
	imp, err := consumer.Dial(exporttest.Ctx(t), pr.Path, s.Dev, 0, consumer.WithLogger(exporttest.DiscardLogger), consumer.WithPushes(func(name string, m *consumer.Mapping) {
		assert.EqualValues(t, "p", name, "pushed name %q", name)
		got <- m
	}, s.Stream))
	require.NoError(t, err)
	defer imp.Close(context.Background())
	ctx := exporttest.Ctx(t)
	require.NoError(t, pr.Ex.Push(ctx, "p", os.Getpid()))
	m := testwait.Recv(t, got, "the pushed mapping")
	c := &exporttest.Consumer{Side: s, Imp: imp}
	b := c.Read(t, m)
	require.True(t, exporttest.AllAre(b, 0x11), "pushed mapping reads wrong bytes")
	require.NoError(t, m.Release(ctx, s.Stream))
	n := pr.ActiveLeases(t)
	require.EqualValues(t, 0, n, "%d leases after the pushed mapping was released", n)
	require.ErrorIs(t, pr.Ex.Push(ctx, "p", exporttest.ImpossiblePID(t)), producer.ErrNoPeer, "Push to nobody, want ErrNoPeer")
	require.ErrorIs(t, pr.Ex.Push(ctx, "nope", os.Getpid()), export.ErrUnknownName, "Push of an unknown name, want export.ErrUnknownName")
	pr.CheckClean(t)
	s.CheckClean(t)
}

func TestPushWithoutHandlerIsGivenBack(t *testing.T) {
	pr := exporttest.NewProducer(t, nil, nil)
	pr.Publish(t, "p", 1<<20, 1)
	c := exporttest.NewConsumer(t, pr.Path, 0)
	require.NoError(t, pr.Ex.Push(exporttest.Ctx(t), "p", os.Getpid()))
	exporttest.WaitFor(t, "the pushed lease to come back", func() bool { return pr.ActiveLeases(t) == 0 })
	c.CheckClean(t)
}

// FABRIC handles travel on a plain byte stream (TCP here), with no descriptors: the
// way between nodes of one NVLink domain.
func TestFabricOverTCP(t *testing.T) {
	pr := exporttest.NewProducer(t, []pool.Option{pool.WithHandleType(cudart.HandleTypeFabric)},
		[]producer.ListenOption{producer.WithPolicy(export.Policy{AllowRemote: true})}, cudarttest.WithFabric())
	pr.Publish(t, "f", 2<<20, 0xfa)
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Skipf("no TCP loopback: %v", err)
	}
	require.NoError(t, pr.Ex.Serve(l))
	s := exporttest.NewSide(t, 1, cudarttest.WithFabric())
	ctx := exporttest.Ctx(t)
	nc, err := net.Dial("tcp", l.Addr().String())
	require.NoError(t, err)
	imp, err := consumer.DialConn(ctx, nc, s.Dev, 1, consumer.WithLogger(exporttest.DiscardLogger))
	require.NoError(t, err)
	t.Cleanup(func() { imp.Close(context.Background()) })
	c := &exporttest.Consumer{Side: s, Imp: imp}
	m, err := imp.Open(ctx, "f", s.Stream)
	require.NoError(t, err)
	// Across nodes no event can carry the producer's writes over: the exporter waited
	// for them on its host before it answered, so the consumer reads at once.
	b := c.Read(t, m)
	require.True(t, exporttest.AllAre(b, 0xfa), "FABRIC mapping reads wrong bytes")
	p := pr.Ex.Peers()
	require.False(t, len(p) != 1 || !p[0].Remote, "peers %+v, want one remote", p)
	require.NoError(t, m.Release(ctx, s.Stream))
	n := pr.ActiveLeases(t)
	require.EqualValues(t, 0, n, "%d leases after release", n)
	require.NoError(t, imp.Close(ctx))
	pr.CheckClean(t)
	s.CheckClean(t)
}

func TestByteStreamPeers(t *testing.T) {
	// POSIX fd pools cannot travel on a byte stream; and a byte-stream peer needs
	// AllowRemote.
	for _, remote := range []bool{false, true} {
		pr := exporttest.NewProducer(t, nil, []producer.ListenOption{producer.WithPolicy(export.Policy{AllowRemote: remote})})
		pr.Publish(t, "a", 1<<20, 1)
		l, err := net.Listen("tcp", "127.0.0.1:0")
		if err != nil {
			t.Skipf("no TCP loopback: %v", err)
		}
		pr.Ex.Serve(l)
		nc, err := net.Dial("tcp", l.Addr().String())
		require.NoError(t, err)
		s := exporttest.NewSide(t, 0)
		imp, err := consumer.DialConn(exporttest.Ctx(t), nc, s.Dev, 0, consumer.WithLogger(exporttest.DiscardLogger))
		if !remote {
			require.ErrorIs(t, err, export.ErrRefused, "DialConn without AllowRemote = %v, want export.ErrRefused naming AllowRemote", err)
			require.ErrorContains(t, err, "AllowRemote", "DialConn without AllowRemote = %v, want export.ErrRefused naming AllowRemote", err)
			continue
		}
		require.NoError(t, err)
		_, err = imp.Open(exporttest.Ctx(t), "a", s.Stream)
		require.ErrorIs(t, err, export.ErrHandleType, "Open of a POSIX fd pool over TCP, want export.ErrHandleType")
		n := pr.ActiveLeases(t)
		require.EqualValues(t, 0, n, "%d leases after a refused open", n)
		imp.Close(exporttest.Ctx(t))
	}
}

func TestSecondImporterToOneExporterIsRefused(t *testing.T) {
	pr := exporttest.NewProducer(t, nil, nil)
	c := exporttest.NewConsumer(t, pr.Path, 0)
	_, err := consumer.Dial(exporttest.Ctx(t), pr.Path, c.Dev, 0)
	require.ErrorIs(t, err, consumer.ErrDuplicateImporter, "second Dial, want ErrDuplicateImporter")
	c.Imp.Close(exporttest.Ctx(t))
	imp, err := consumer.Dial(exporttest.Ctx(t), pr.Path, c.Dev, 0)
	require.NoError(t, err, "Dial after the first Importer closed: %v", err)
	imp.Close(exporttest.Ctx(t))
}

// Dial says why nothing answers, as the error the system gave: a socket file nobody
// serves refuses the connection, a missing one does not exist.
func TestDialNothingListening(t *testing.T) {
	s := exporttest.NewSide(t, 0)
	dir := exporttest.ShortDir(t)
	_, err := consumer.Dial(exporttest.Ctx(t), dir+"/none.sock", s.Dev, 0)
	require.ErrorIs(t, err, export.ErrExporterGone, "Dial of a missing socket = %v, want export.ErrExporterGone and fs.ErrNotExist", err)
	require.ErrorIs(t, err, fs.ErrNotExist, "Dial of a missing socket = %v, want export.ErrExporterGone and fs.ErrNotExist", err)
	l, err := net.ListenUnix("unix", &net.UnixAddr{Name: dir + "/dead.sock", Net: "unix"})
	require.NoError(t, err)
	l.SetUnlinkOnClose(false)
	l.Close()
	_, err = consumer.Dial(exporttest.Ctx(t), dir+"/dead.sock", s.Dev, 0)
	require.ErrorIs(t, err, export.ErrExporterGone, "Dial of a socket nobody serves = %v, want export.ErrExporterGone and ECONNREFUSED", err)
	require.ErrorIs(t, err, syscall.ECONNREFUSED, "Dial of a socket nobody serves = %v, want export.ErrExporterGone and ECONNREFUSED", err)
}

// Close returns when its context ends, and abandons the leases still held: they are
// kept (the consumer still maps the buffer) and end when the consumer releases.
func TestExporterCloseGivesUpWhenContextEnds(t *testing.T) {
	pr := exporttest.NewProducer(t, nil, nil)
	pr.Publish(t, "a", 1<<20, 1)
	c := exporttest.NewConsumer(t, pr.Path, 0)
	m, err := c.Imp.Open(exporttest.Ctx(t), "a", c.Stream)
	require.NoError(t, err)
	err = pr.Ex.Close(exporttest.Ended())
	require.ErrorIs(t, err, context.Canceled, "Close with a held lease and an ended ctx = %v", err)
	require.ErrorIs(t, err, producer.ErrAbandoned)
	require.ErrorContains(t, err, "holds 1 leases", "Close with a held lease and an ended ctx = %v", err)
	require.EqualValues(t, 1, pr.ActiveLeases(t), "the abandoned lease is kept")
	require.NoError(t, m.Release(exporttest.Ctx(t), c.Stream))
	exporttest.WaitFor(t, "the abandoned lease to end at its release", func() bool { return pr.ActiveLeases(t) == 0 })
}

// Many consumers come and go, some releasing and some not; afterwards no descriptor,
// lease or peer is left over on either side.
func TestNoLeaksAfterManyConnections(t *testing.T) {
	pr := exporttest.NewProducer(t, nil, nil)
	pr.Publish(t, "a", 1<<20, 1)
	s := exporttest.NewSide(t, 0)
	exporttest.WarmEventArena(t, s)
	ctx := exporttest.Ctx(t)
	// One round first, so that what is made once per process exists already.
	cycle := func(i int) {
		imp, err := consumer.Dial(ctx, pr.Path, s.Dev, 0, consumer.WithLogger(exporttest.DiscardLogger))
		require.NoError(t, err)
		m, err := imp.Open(ctx, "a", s.Stream)
		require.NoError(t, err)
		if i%2 == 0 {
			require.NoError(t, m.Release(ctx, s.Stream))
		} // odd rounds leave the mapping to Close
		require.NoError(t, imp.Close(ctx))
	}
	cycle(0)
	exporttest.WaitFor(t, "the first peer to leave", func() bool { return len(pr.Ex.Peers()) == 0 })
	baseline := exporttest.OpenFDs(t)
	for i := range 100 {
		cycle(i)
	}
	exporttest.WaitFor(t, "every peer to leave", func() bool { return len(pr.Ex.Peers()) == 0 })
	got := exporttest.OpenFDs(t)
	require.EqualValues(t, baseline, got, "%d descriptors open after 100 connections, %d before", got, baseline)
	n := pr.ActiveLeases(t)
	require.EqualValues(t, 0, n, "%d leases left", n)
	pr.CheckClean(t)
	s.CheckClean(t)
}

// A Push whose context has ended before its Lease frame went out leaves the peer
// holding nothing: the grant it made is taken back, not left for a release that the
// peer, never told of it, will never send.
func TestPushCancelledBeforeSendHoldsNothing(t *testing.T) {
	pr := exporttest.NewProducer(t, nil, nil)
	pr.Publish(t, "p", 1<<20, 1)
	c := exporttest.NewConsumer(t, pr.Path, 0)
	ctx := exporttest.Ctx(t)
	// An Open first, so that the peer has the pool's handle and the Push's only send
	// is its Lease frame.
	m, err := c.Imp.Open(ctx, "p", c.Stream)
	require.NoError(t, err)
	require.NoError(t, m.Release(ctx, c.Stream))
	cancelled, cancel := context.WithCancel(ctx)
	cancel()
	require.ErrorIs(t, pr.Ex.Push(cancelled, "p", os.Getpid()), context.Canceled, "Push with an ended context, want context.Canceled")
	n := pr.ActiveLeases(t)
	require.EqualValues(t, 0, n, "%d pool leases held after a Push that sent nothing", n)
	for _, p := range pr.Ex.Peers() {
		require.EqualValues(t, 0, p.Leases, "peer pid %d holds %d leases after a Push that sent nothing", p.PID, p.Leases)
	}
	// The connection is intact: nothing was written.
	m, err = c.Imp.Open(ctx, "p", c.Stream)
	require.NoError(t, err)
	require.NoError(t, m.Release(ctx, c.Stream))
	c.CheckClean(t)
}
