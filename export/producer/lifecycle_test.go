package producer

import (
	"context"
	"fmt"
	"io"
	"io/fs"
	"net"
	"os"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/cudapool/cudapool/cudart"
	"github.com/cudapool/cudapool/cudart/cudarttest"
	"github.com/cudapool/cudapool/export/consumer"
	"github.com/cudapool/cudapool/export/discover"
	"github.com/cudapool/cudapool/export/internal/inspect"
	"github.com/cudapool/cudapool/export/internal/wire"
	"github.com/cudapool/cudapool/internal/testwait"
	"github.com/cudapool/cudapool/pool"
)

func TestPolicyRefusesWithReason(t *testing.T) {
	other := uint32(os.Getuid()) + 1
	pr := newProducer(t, nil, []ListenOption{WithPolicy(Policy{AllowUIDs: []uint32{other}})})
	s := newSide(t, 0)
	_, err := consumer.Dial(testCtx(t), pr.path, s.dev, 0)
	require.ErrorIs(t, err, ErrRefused, "Dial = %v, want ErrRefused with the reason", err)
	require.ErrorContains(t, err, "is not allowed", "Dial = %v, want ErrRefused with the reason", err)
	_, err = discover.QueryState(testCtx(t), pr.path)
	require.ErrorIs(t, err, ErrRefused, "QueryState, want ErrRefused: the same policy applies")
	require.Contains(t, pr.log.String(), "level=WARN msg=\"producer: connection not admitted\"", "refusal not logged as a warning:\n%s", pr.log.String())
	n := len(pr.ex.Peers())
	require.EqualValues(t, 0, n, "%d peers after refusals", n)
	s.checkClean(t)
}

func TestPolicyAdmits(t *testing.T) {
	uid, gid := uint32(os.Getuid()), uint32(os.Getgid())
	for _, p := range []Policy{{}, {AllowUIDs: []uint32{uid}}, {AllowGIDs: []uint32{gid}}, {AllowUIDs: []uint32{uid + 1}, AllowGIDs: []uint32{gid}}} {
		pr := newProducer(t, nil, []ListenOption{WithPolicy(p)})
		newConsumer(t, pr.path, 0)
	}
}

func TestQueryStateDescribesPoolsAndPeers(t *testing.T) {
	pr := newProducer(t, []pool.Option{pool.WithName("kv")}, []ListenOption{WithName("unit-producer")})
	pr.publish(t, "a", 3<<20, 1)
	c := newConsumer(t, pr.path, 1)
	m, err := c.imp.Open(testCtx(t), "a", c.stream)
	require.NoError(t, err)
	st, err := discover.QueryState(testCtx(t), pr.path)
	require.NoError(t, err)
	require.Equal(t, discover.StateSchema, st.Schema)
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
	require.Equal(t, inspect.DeviceUUID(c.imp).String(), peer.Device)
	require.False(t, peer.AwaitingExit)
	m.Release(testCtx(t), c.stream)
}

func TestPushHandsBufferToHandler(t *testing.T) {
	pr := newProducer(t, nil, nil)
	pr.publish(t, "p", 1<<20, 0x11)
	got := make(chan *consumer.Mapping, 1)
	s := newSide(t, 0)
	imp, err := consumer.Dial(testCtx(t), pr.path, s.dev, 0, consumer.WithLogger(discardLogger), consumer.WithPushes(s.stream, func(name string, m *consumer.Mapping) {
		assert.EqualValues(t, "p", name, "pushed name %q", name)
		got <- m
	}))
	require.NoError(t, err)
	defer imp.Close(context.Background())
	ctx := testCtx(t)
	require.NoError(t, pr.ex.Push(ctx, "p", os.Getpid()))
	m := testwait.Recv(t, got, "the pushed mapping")
	c := &testConsumer{side: s, imp: imp}
	b := c.read(t, m)
	require.True(t, allAre(b, 0x11), "pushed mapping reads wrong bytes")
	require.NoError(t, m.Release(ctx, s.stream))
	n := pr.activeLeases(t)
	require.EqualValues(t, 0, n, "%d leases after the pushed mapping was released", n)
	require.ErrorIs(t, pr.ex.Push(ctx, "p", impossiblePID(t)), ErrNoPeer, "Push to nobody, want ErrNoPeer")
	require.ErrorIs(t, pr.ex.Push(ctx, "nope", os.Getpid()), ErrUnknownName, "Push of an unknown name, want ErrUnknownName")
	pr.checkClean(t)
	s.checkClean(t)
}

func TestPushWithoutHandlerIsGivenBack(t *testing.T) {
	pr := newProducer(t, nil, nil)
	pr.publish(t, "p", 1<<20, 1)
	c := newConsumer(t, pr.path, 0)
	require.NoError(t, pr.ex.Push(testCtx(t), "p", os.Getpid()))
	waitFor(t, "the pushed lease to come back", func() bool { return pr.activeLeases(t) == 0 })
	c.checkClean(t)
}

func TestPublishChecks(t *testing.T) {
	pr := newProducer(t, nil, nil)
	b := pr.publish(t, "a", 1<<20, 1)
	ctx := testCtx(t)
	require.ErrorIs(t, pr.ex.Publish(ctx, "a", b, pr.stream), ErrNameInUse, "Publish twice, want ErrNameInUse")
	for _, name := range []string{"", strings.Repeat("x", wire.MaxNameLen+1), "a\nb", "\xff"} {
		require.ErrorIs(t, pr.ex.Publish(ctx, name, b, pr.stream), ErrBadName, "Publish(%q), want ErrBadName", name)
	}
	require.NoError(t, pr.ex.Unpublish("a"))
	require.ErrorIs(t, pr.ex.Unpublish("a"), ErrUnknownName, "Unpublish twice, want ErrUnknownName")
	local, err := pool.New(pr.dev, 0, pool.WithHandleType(cudart.HandleTypeNone))
	require.NoError(t, err)
	defer local.Close(ctx, pool.Force())
	lb, err := local.Alloc(ctx, 4096, pr.stream)
	require.NoError(t, err)
	require.ErrorIs(t, pr.ex.Publish(ctx, "local", lb, pr.stream), pool.ErrNotShareable, "Publish of a local pool's buffer, want pool.ErrNotShareable")
}

func TestFabricWithoutIMEXIsReported(t *testing.T) {
	pr := newProducer(t, []pool.Option{pool.WithHandleType(cudart.HandleTypeFabric)}, nil)
	ctx := testCtx(t)
	b, err := pr.pool.Alloc(ctx, 1<<20, pr.stream)
	require.NoError(t, err)
	err = pr.ex.Publish(ctx, "f", b, pr.stream)
	require.ErrorIs(t, err, ErrIMEXRequired, "Publish of a FABRIC buffer without IMEX = %v, want ErrIMEXRequired", err)
	require.ErrorIs(t, err, cudart.ErrNotPermitted, "Publish of a FABRIC buffer without IMEX = %v, want ErrIMEXRequired", err)
	require.Contains(t, err.Error(), "IMEX channel", "Publish of a FABRIC buffer without IMEX = %v, want ErrIMEXRequired", err)
}

// FABRIC handles travel on a plain byte stream (TCP here), with no descriptors: the
// way between nodes of one NVLink domain.
func TestFabricOverTCP(t *testing.T) {
	pr := newProducer(t, []pool.Option{pool.WithHandleType(cudart.HandleTypeFabric)},
		[]ListenOption{WithPolicy(Policy{AllowRemote: true})}, cudarttest.WithFabric())
	pr.publish(t, "f", 2<<20, 0xfa)
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Skipf("no TCP loopback: %v", err)
	}
	require.NoError(t, pr.ex.Serve(l))
	s := newSide(t, 1, cudarttest.WithFabric())
	ctx := testCtx(t)
	nc, err := net.Dial("tcp", l.Addr().String())
	require.NoError(t, err)
	imp, err := consumer.DialConn(ctx, nc, s.dev, 1, consumer.WithLogger(discardLogger))
	require.NoError(t, err)
	t.Cleanup(func() { imp.Close(context.Background()) })
	c := &testConsumer{side: s, imp: imp}
	m, err := imp.Open(ctx, "f", s.stream)
	require.NoError(t, err)
	// Across nodes no event can carry the producer's writes over: the exporter waited
	// for them on its host before it answered, so the consumer reads at once.
	b := c.read(t, m)
	require.True(t, allAre(b, 0xfa), "FABRIC mapping reads wrong bytes")
	p := pr.ex.Peers()
	require.False(t, len(p) != 1 || !p[0].Remote, "peers %+v, want one remote", p)
	require.NoError(t, m.Release(ctx, s.stream))
	n := pr.activeLeases(t)
	require.EqualValues(t, 0, n, "%d leases after release", n)
	require.NoError(t, imp.Close(ctx))
	pr.checkClean(t)
	s.checkClean(t)
}

func TestByteStreamPeers(t *testing.T) {
	// POSIX fd pools cannot travel on a byte stream; and a byte-stream peer needs
	// AllowRemote.
	for _, remote := range []bool{false, true} {
		pr := newProducer(t, nil, []ListenOption{WithPolicy(Policy{AllowRemote: remote})})
		pr.publish(t, "a", 1<<20, 1)
		l, err := net.Listen("tcp", "127.0.0.1:0")
		if err != nil {
			t.Skipf("no TCP loopback: %v", err)
		}
		pr.ex.Serve(l)
		nc, err := net.Dial("tcp", l.Addr().String())
		require.NoError(t, err)
		s := newSide(t, 0)
		imp, err := consumer.DialConn(testCtx(t), nc, s.dev, 0, consumer.WithLogger(discardLogger))
		if !remote {
			require.ErrorIs(t, err, ErrRefused, "DialConn without AllowRemote = %v, want ErrRefused naming AllowRemote", err)
			require.ErrorContains(t, err, "AllowRemote", "DialConn without AllowRemote = %v, want ErrRefused naming AllowRemote", err)
			continue
		}
		require.NoError(t, err)
		_, err = imp.Open(testCtx(t), "a", s.stream)
		require.ErrorIs(t, err, ErrHandleType, "Open of a POSIX fd pool over TCP, want ErrHandleType")
		n := pr.activeLeases(t)
		require.EqualValues(t, 0, n, "%d leases after a refused open", n)
		imp.Close(testCtx(t))
	}
}

func TestSecondImporterToOneExporterIsRefused(t *testing.T) {
	pr := newProducer(t, nil, nil)
	c := newConsumer(t, pr.path, 0)
	_, err := consumer.Dial(testCtx(t), pr.path, c.dev, 0)
	require.ErrorIs(t, err, consumer.ErrDuplicateImporter, "second Dial, want ErrDuplicateImporter")
	c.imp.Close(testCtx(t))
	imp, err := consumer.Dial(testCtx(t), pr.path, c.dev, 0)
	require.NoError(t, err, "Dial after the first Importer closed: %v", err)
	imp.Close(testCtx(t))
}

// Dial says why nothing answers, as the error the system gave: a socket file nobody
// serves refuses the connection, a missing one does not exist.
func TestDialNothingListening(t *testing.T) {
	s := newSide(t, 0)
	dir := shortDir(t)
	_, err := consumer.Dial(testCtx(t), dir+"/none.sock", s.dev, 0)
	require.ErrorIs(t, err, wire.ErrExporterGone, "Dial of a missing socket = %v, want ErrExporterGone and fs.ErrNotExist", err)
	require.ErrorIs(t, err, fs.ErrNotExist, "Dial of a missing socket = %v, want ErrExporterGone and fs.ErrNotExist", err)
	l, err := net.ListenUnix("unix", &net.UnixAddr{Name: dir + "/dead.sock", Net: "unix"})
	require.NoError(t, err)
	l.SetUnlinkOnClose(false)
	l.Close()
	_, err = consumer.Dial(testCtx(t), dir+"/dead.sock", s.dev, 0)
	require.ErrorIs(t, err, wire.ErrExporterGone, "Dial of a socket nobody serves = %v, want ErrExporterGone and ECONNREFUSED", err)
	require.ErrorIs(t, err, syscall.ECONNREFUSED, "Dial of a socket nobody serves = %v, want ErrExporterGone and ECONNREFUSED", err)
}

// A liveness probe (Discover's) connects and hangs up without a word: that is logged
// for debugging only, not as a warning.
func TestProbeIsNotAWarning(t *testing.T) {
	pr := newProducer(t, nil, nil)
	live, err := wire.SocketAnswers(pr.path)
	require.False(t, !live || err != nil, "socketAnswers = %v, %v; want a live socket", live, err)
	waitFor(t, "the probe to be logged", func() bool { return strings.Contains(pr.log.String(), "not admitted") })
	log := pr.log.String()
	require.False(t, !strings.Contains(log, "level=DEBUG msg=\"producer: connection not admitted\"") || strings.Contains(log, "level=WARN"), "probe logged as more than debugging:\n%s", log)
}

// A consumer that closes its connection without Bye but lives on (here, the test's own
// process) may still map what it holds: its lease, and the free waiting on it, stay
// until its process exits, and no new lease reaches it. Close, whose ctx ends first,
// reports the lease and abandons it: the exporter cannot know the consumer released.
func TestLivePeerThatHangsUpKeepsItsLeases(t *testing.T) {
	pr := newProducer(t, nil, nil)
	before, _ := pr.pool.Stats()
	b := pr.publish(t, "a", 1<<20, 1)
	pr.publish(t, "b", 1<<20, 2)
	c := newConsumer(t, pr.path, 0)
	ctx := testCtx(t)
	m, err := c.imp.Open(ctx, "a", c.stream)
	require.NoError(t, err)
	require.NoError(t, b.Free(pr.stream))
	inspect.Client(c.imp).C.Close()
	waitFor(t, "the exporter to see the hang-up", func() bool {
		ps := pr.ex.Peers()
		return len(ps) == 0 || ps[0].AwaitingExit
	})
	s, _ := pr.pool.Stats()
	require.EqualValues(t, 1, s.ActiveLeases, "pool after a live consumer hung up: %+v, want its lease and the free waiting", s)
	require.EqualValues(t, 1, s.DeferredFrees, "pool after a live consumer hung up: %+v, want its lease and the free waiting", s)
	got := c.read(t, m)
	require.True(t, allAre(got, 1), "the mapping of a consumer that hung up changed")
	pr.checkClean(t)
	st, err := pr.ex.State()
	require.False(t, err != nil || len(st.Peers) != 1 || !st.Peers[0].AwaitingExit || st.Peers[0].Leases != 1, "State peers %+v, %v; want the consumer awaiting its exit with its lease", st.Peers, err)
	require.Contains(t, pr.log.String(), "held until its process exits", "the held leases are not logged:\n%s", pr.log.String())
	require.ErrorIs(t, pr.ex.Push(ctx, "b", os.Getpid()), ErrNoPeer, "Push to a consumer that hung up, want ErrNoPeer")

	// The consumer releases, but cannot tell the exporter any more; the exporter sees
	// nothing either, as the process lives on. Close, with its ctx ended, names the
	// lease and abandons it: it ends when the process exits, never before.
	require.NoError(t, m.Release(ctx, c.stream), "Release after hanging up, want nil: there is no one to tell")
	err = pr.ex.Close(ended())
	require.ErrorIs(t, err, context.Canceled, "Close = %v, want the lost consumer's lease reported", err)
	require.ErrorIs(t, err, ErrAbandoned)
	require.ErrorContains(t, err, fmt.Sprintf("pid %d, its connection lost but its process alive, holds 1 leases", os.Getpid()), "Close = %v, want the lost consumer's lease reported", err)
	after, _ := pr.pool.Stats()
	require.EqualValues(t, 1, after.ActiveLeases, "pool after Close %+v, before the buffers %+v: want the lease kept and the free waiting", after, before)
	require.EqualValues(t, 1, after.DeferredFrees, "pool after Close %+v, before the buffers %+v: want the lease kept and the free waiting", after, before)
	pr.checkClean(t)
}

// A producer that vanishes: the mapping stays readable, opens say the exporter is
// gone, release and close complete without error.
func TestProducerCrashLeavesMappingsReadable(t *testing.T) {
	pr := newProducer(t, nil, nil)
	pr.publish(t, "a", 1<<20, 0x77)
	c := newConsumer(t, pr.path, 0)
	ctx := testCtx(t)
	m, err := c.imp.Open(ctx, "a", c.stream)
	require.NoError(t, err)
	require.NoError(t, pr.dev.Synchronize()) // it dies after its writes ran
	pr.dev.Close()
	for _, p := range pr.ex.peerList() {
		p.c.Close()
	}
	testwait.Recv(t, inspect.Client(c.imp).ReaderDone, "the importer to see its connection end")
	b := c.read(t, m)
	require.True(t, allAre(b, 0x77), "mapping unreadable after the producer died")
	_, err = c.imp.Open(ctx, "a", c.stream)
	require.ErrorIs(t, err, wire.ErrExporterGone, "Open after the producer died, want ErrExporterGone")
	require.NoError(t, m.Release(ctx, c.stream), "Release after the producer died, want nil")
	require.NoError(t, c.imp.Close(ctx), "Close after the producer died, want nil")
	c.checkClean(t)
}

// Exporter.Close waits for consumers to release what they hold; Opens after it
// began fail with ErrExporterGone.
func TestExporterCloseWaitsForReleases(t *testing.T) {
	pr := newProducer(t, nil, nil)
	pr.publish(t, "a", 1<<20, 1)
	c := newConsumer(t, pr.path, 0)
	ctx := testCtx(t)
	m, err := c.imp.Open(ctx, "a", c.stream)
	require.NoError(t, err)
	closed := make(chan error, 1)
	go func() { closed <- pr.ex.Close(ctx) }()
	waitFor(t, "the importer to hear Bye", func() bool {
		inspect.Client(c.imp).Mu.Lock()
		defer inspect.Client(c.imp).Mu.Unlock()
		return inspect.Client(c.imp).Bye
	})
	_, err = c.imp.Open(ctx, "a", c.stream)
	require.ErrorIs(t, err, wire.ErrExporterGone, "Open during Close, want ErrExporterGone")
	select {
	case err := <-closed:
		t.Fatalf("Close returned %v while a lease was held", err)
	default:
	}
	require.NoError(t, m.Release(ctx, c.stream))
	require.NoError(t, testwait.Recv(t, closed, "Close to return"))
	require.NoError(t, c.imp.Close(ctx))
	pr.checkClean(t)
	c.checkClean(t)
}

// Close returns when its context ends, and abandons the leases still held: they are
// kept (the consumer still maps the buffer) and end when the consumer releases.
func TestExporterCloseGivesUpWhenContextEnds(t *testing.T) {
	pr := newProducer(t, nil, nil)
	pr.publish(t, "a", 1<<20, 1)
	c := newConsumer(t, pr.path, 0)
	m, err := c.imp.Open(testCtx(t), "a", c.stream)
	require.NoError(t, err)
	err = pr.ex.Close(ended())
	require.ErrorIs(t, err, context.Canceled, "Close with a held lease and an ended ctx = %v", err)
	require.ErrorIs(t, err, ErrAbandoned)
	require.ErrorContains(t, err, "holds 1 leases", "Close with a held lease and an ended ctx = %v", err)
	require.EqualValues(t, 1, pr.activeLeases(t), "the abandoned lease is kept")
	require.NoError(t, m.Release(testCtx(t), c.stream))
	waitFor(t, "the abandoned lease to end at its release", func() bool { return pr.activeLeases(t) == 0 })
}

// Many consumers come and go, some releasing and some not; afterwards no descriptor,
// lease or peer is left over on either side.
func TestNoLeaksAfterManyConnections(t *testing.T) {
	pr := newProducer(t, nil, nil)
	pr.publish(t, "a", 1<<20, 1)
	s := newSide(t, 0)
	warmEventArena(t, s)
	ctx := testCtx(t)
	// One round first, so that what is made once per process exists already.
	cycle := func(i int) {
		imp, err := consumer.Dial(ctx, pr.path, s.dev, 0, consumer.WithLogger(discardLogger))
		require.NoError(t, err)
		m, err := imp.Open(ctx, "a", s.stream)
		require.NoError(t, err)
		if i%2 == 0 {
			require.NoError(t, m.Release(ctx, s.stream))
		} // odd rounds leave the mapping to Close
		require.NoError(t, imp.Close(ctx))
	}
	cycle(0)
	waitFor(t, "the first peer to leave", func() bool { return len(pr.ex.Peers()) == 0 })
	baseline := openFDs(t)
	for i := range 100 {
		cycle(i)
	}
	waitFor(t, "every peer to leave", func() bool { return len(pr.ex.Peers()) == 0 })
	got := openFDs(t)
	require.EqualValues(t, baseline, got, "%d descriptors open after 100 connections, %d before", got, baseline)
	n := pr.activeLeases(t)
	require.EqualValues(t, 0, n, "%d leases left", n)
	pr.checkClean(t)
	s.checkClean(t)
}

// A peer that connects and says nothing must not hold Close up until its handshake
// times out.
func TestCloseCutsSilentPeers(t *testing.T) {
	pr := newProducer(t, nil, []ListenOption{WithHandshakeTimeout(hangGuard * 10)})
	r := dialRaw(t, pr.path)
	waitFor(t, "the silent peer to be accepted", func() bool {
		pr.ex.mu.Lock()
		defer pr.ex.mu.Unlock()
		return len(pr.ex.greeting) == 1
	})
	require.NoError(t, pr.ex.Close(testCtx(t)))
	require.True(t, r.closedByExporter(), "the silent peer's connection stayed open")
	b, err := pr.pool.Alloc(testCtx(t), 4096, pr.stream)
	require.NoError(t, err)
	require.ErrorIs(t, pr.ex.Publish(testCtx(t), "late", b, pr.stream), ErrClosed, "Publish after Close, want ErrClosed")
}

// A Push whose context has ended before its Lease frame went out leaves the peer
// holding nothing: the grant it made is taken back, not left for a release that the
// peer, never told of it, will never send.
func TestPushCancelledBeforeSendHoldsNothing(t *testing.T) {
	pr := newProducer(t, nil, nil)
	pr.publish(t, "p", 1<<20, 1)
	c := newConsumer(t, pr.path, 0)
	ctx := testCtx(t)
	// An Open first, so that the peer has the pool's handle and the Push's only send
	// is its Lease frame.
	m, err := c.imp.Open(ctx, "p", c.stream)
	require.NoError(t, err)
	require.NoError(t, m.Release(ctx, c.stream))
	cancelled, cancel := context.WithCancel(ctx)
	cancel()
	require.ErrorIs(t, pr.ex.Push(cancelled, "p", os.Getpid()), context.Canceled, "Push with an ended context, want context.Canceled")
	n := pr.activeLeases(t)
	require.EqualValues(t, 0, n, "%d pool leases held after a Push that sent nothing", n)
	for _, p := range pr.ex.Peers() {
		require.EqualValues(t, 0, p.Leases, "peer pid %d holds %d leases after a Push that sent nothing", p.PID, p.Leases)
	}
	// The connection is intact: nothing was written.
	m, err = c.imp.Open(ctx, "p", c.stream)
	require.NoError(t, err)
	require.NoError(t, m.Release(ctx, c.stream))
	c.checkClean(t)
}

// eventTrackingRuntime tracks the IPC events opened from handles and not yet destroyed.
type eventTrackingRuntime struct {
	cudart.Runtime
	mu   sync.Mutex
	open map[cudart.Event]bool
}

func (r *eventTrackingRuntime) IpcOpenEventHandle(dev int, h cudart.IpcEventHandle) (cudart.Event, error) {
	ev, err := r.Runtime.IpcOpenEventHandle(dev, h)
	if err == nil {
		r.mu.Lock()
		r.open[ev] = true
		r.mu.Unlock()
	}
	return ev, err
}

func (r *eventTrackingRuntime) EventDestroy(dev int, ev cudart.Event) error {
	r.mu.Lock()
	delete(r.open, ev)
	r.mu.Unlock()
	return r.Runtime.EventDestroy(dev, ev)
}

func (r *eventTrackingRuntime) stillOpen() int {
	r.mu.Lock()
	defer r.mu.Unlock()
	return len(r.open)
}

// A grant that reaches a peer after it left (PushAll picked it, then it hung up)
// fails, and opens nothing on its behalf that no one would destroy.
func TestGrantAfterPeerLeftLeaksNoEvent(t *testing.T) {
	var rt *eventTrackingRuntime
	pr := newProducerOn(t, func(r cudart.Runtime) cudart.Runtime {
		rt = &eventTrackingRuntime{Runtime: r, open: map[cudart.Event]bool{}}
		return rt
	}, nil, nil)
	pr.publish(t, "p", 1<<20, 1)
	c := newConsumer(t, pr.path, 0)
	ctx := testCtx(t)
	m, err := c.imp.Open(ctx, "p", c.stream) // the peer has the pool's handle from now on
	require.NoError(t, err)
	require.NoError(t, m.Release(ctx, c.stream))
	peers := pr.ex.peerList()
	require.Len(t, peers, 1, "%d peers, want 1", len(peers))
	p := peers[0]
	require.NoError(t, c.imp.Close(ctx))
	waitFor(t, "the peer to leave", func() bool { return len(pr.ex.peerList()) == 0 })
	pub, err := pr.ex.lookup("p")
	require.NoError(t, err)
	require.ErrorIs(t, p.push(ctx, pub), ErrNoPeer, "push to a departed peer, want ErrNoPeer")
	n := pr.activeLeases(t)
	require.EqualValues(t, 0, n, "%d pool leases held after a push to a departed peer", n)
	n = rt.stillOpen()
	require.EqualValues(t, 0, n, "%d of the departed peer's events left open", n)
}

// An unsent grant released after the peer released the lease it shares (the peer, holding
// the buffer already, released as many grants as it knew of, and the release took the
// newest) still leaves the lease with exactly the grants the peer knows of: none.
func TestUnsentGrantAfterOverlappingReleaseLeavesNothing(t *testing.T) {
	pr := newProducer(t, nil, nil)
	pr.publish(t, "buf", 1<<20, 1)
	a := admitted(t, pr.path)
	l, ok := a.open(1, "buf").(*wire.LeaseMsg)
	require.True(t, ok, "open did not answer with a Lease")
	peers := pr.ex.peerList()
	require.Len(t, peers, 1, "%d peers, want 1", len(peers))
	p := peers[0]
	pub, err := pr.ex.lookup("buf")
	require.NoError(t, err)
	// A Push's grant, as if its frame were on its way when the peer released.
	pushed, pl, err := p.grant(testCtx(t), pub, 0)
	require.NoError(t, err)
	require.EqualValues(t, l.LeaseID, pushed.LeaseID, "a second grant of a held buffer got another lease id")
	m := a.release(2, l.LeaseID, 1)
	require.EqualValues(t, wire.MsgReleased, m.Kind(), "release answered %s", m.Kind())
	p.releaseUnsent(pushed.LeaseID, pl) // the Push's frame failed to go out
	n := pr.activeLeases(t)
	require.EqualValues(t, 0, n, "%d pool leases held, though the peer released the one grant it knew of", n)
	i := p.state()
	require.EqualValues(t, 0, i.Leases, "peer holds %d leases, %d grants; want none", i.Leases, i.Grants)
	require.EqualValues(t, 0, i.Grants, "peer holds %d leases, %d grants; want none", i.Leases, i.Grants)
}

// pipeListener hands the exporter one end of in-memory pipes, which hold no bytes: a
// write to a peer that does not read blocks for certain.
type pipeListener struct {
	conns chan net.Conn
	done  chan struct{}
	once  sync.Once
}

func newPipeListener() *pipeListener {
	return &pipeListener{conns: make(chan net.Conn), done: make(chan struct{})}
}

func (l *pipeListener) Accept() (net.Conn, error) {
	select {
	case c := <-l.conns:
		return c, nil
	case <-l.done:
		return nil, net.ErrClosed
	}
}

func (l *pipeListener) Close() error {
	l.once.Do(func() { close(l.done) })
	return nil
}

func (l *pipeListener) Addr() net.Addr { return &net.UnixAddr{Name: "pipe", Net: "pipe"} }

// dial connects a peer that says h, and returns it once admitted.
func (l *pipeListener) dial(t *testing.T, h *wire.HelloMsg) *wire.Conn {
	t.Helper()
	a, b := net.Pipe()
	t.Cleanup(func() { b.Close() })
	l.conns <- a
	c := wire.NewConn(b, true)
	require.NoError(t, c.Send(testCtx(t), h, -1))
	m, _, err := c.Recv()
	require.NoError(t, err, "handshake: %v %v", m, err)
	require.EqualValues(t, wire.MsgWelcome, m.Kind(), "handshake: %v %v", m, err)
	return c
}

// Peers that stopped reading keep neither Close's Bye from the others nor Close from
// waiting for the others' releases.
func TestCloseWaitsForReleasesPastPeersThatDoNotRead(t *testing.T) {
	pr := newProducer(t, nil, []ListenOption{WithPolicy(Policy{AllowRemote: true})})
	pr.publish(t, "p", 1<<20, 1)
	l := newPipeListener()
	require.NoError(t, pr.ex.Serve(l))
	// Several, so that the one reading peer is unlikely to be told first by chance.
	for range 4 {
		l.dial(t, &wire.HelloMsg{Version: wire.ProtocolVersion}) // and never read from again
	}
	c := newConsumer(t, pr.path, 0)
	ctx := testCtx(t)
	m, err := c.imp.Open(ctx, "p", c.stream)
	require.NoError(t, err)
	closed := make(chan error, 1)
	go func() { closed <- pr.ex.Close(ctx) }()
	waitFor(t, "the consumer to be told Bye", func() bool {
		inspect.Client(c.imp).Mu.Lock()
		defer inspect.Client(c.imp).Mu.Unlock()
		return inspect.Client(c.imp).Bye
	})
	require.NoError(t, m.Release(ctx, c.stream))
	require.NoError(t, testwait.Recv(t, closed, "Close to return"), "Close, want nil: every lease was released before its context ended")
}

// A grant waiting for another grant's pool handle to go out, to a peer that stopped
// reading, gives up when its context ends.
func TestGrantBehindStuckPoolHandleHonoursContext(t *testing.T) {
	pr := newProducer(t, []pool.Option{pool.WithHandleType(cudart.HandleTypeFabric)},
		[]ListenOption{WithPolicy(Policy{AllowRemote: true})}, cudarttest.WithFabric())
	pr.publish(t, "f", 2<<20, 1)
	l := newPipeListener()
	require.NoError(t, pr.ex.Serve(l))
	c := l.dial(t, &wire.HelloMsg{Version: wire.ProtocolVersion, Flags: wire.HelloLeases, HandleTypes: uint32(cudart.HandleTypeFabric)})
	peers := pr.ex.peerList()
	require.Len(t, peers, 1, "%d peers, want 1", len(peers))
	p := peers[0]
	require.NoError(t, c.Send(testCtx(t), &wire.OpenMsg{ReqID: 1, Name: "f"}, -1))
	var first [1]byte
	_, err := io.ReadFull(c.Nc, first[:]) // the pool handle is on its way
	require.NoError(t, err)
	pub, err := pr.ex.lookup("f")
	require.NoError(t, err)
	ctx, cancel := context.WithCancel(testCtx(t))
	cancel()
	pushed := make(chan error, 1)
	go func() { pushed <- p.push(ctx, pub) }()
	select {
	case err := <-pushed:
		require.ErrorIs(t, err, context.Canceled, "push = %v, want context.Canceled", err)
	case <-time.After(hangGuard):
		t.Fatal("a grant behind a stuck pool handle ignored its ended context")
	}
}
