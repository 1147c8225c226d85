package export

import (
	"context"
	"errors"
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

	"github.com/cudapool/cudapool/cudart"
	"github.com/cudapool/cudapool/cudart/cudarttest"
	"github.com/cudapool/cudapool/pool"
)

func TestPolicyRefusesWithReason(t *testing.T) {
	other := uint32(os.Getuid()) + 1
	pr := newProducer(t, nil, []ListenOption{WithPolicy(Policy{AllowUIDs: []uint32{other}})})
	s := newSide(t, 0)
	_, err := Dial(testCtx(t), pr.path, s.dev, 0)
	if !errors.Is(err, ErrRefused) || !strings.Contains(err.Error(), "is not allowed") {
		t.Fatalf("Dial = %v, want ErrRefused with the reason", err)
	}
	if _, err := QueryState(testCtx(t), pr.path); !errors.Is(err, ErrRefused) {
		t.Fatalf("QueryState = %v, want ErrRefused: the same policy applies", err)
	}
	if !strings.Contains(pr.log.String(), "level=WARN msg=\"export: connection not admitted\"") {
		t.Fatalf("refusal not logged as a warning:\n%s", pr.log.String())
	}
	if n := len(pr.ex.Peers()); n != 0 {
		t.Fatalf("%d peers after refusals", n)
	}
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
	if err != nil {
		t.Fatal(err)
	}
	st, err := QueryState(testCtx(t), pr.path)
	if err != nil {
		t.Fatal(err)
	}
	if st.Schema != StateSchema || st.Name != "unit-producer" || st.PID != os.Getpid() || len(st.Devices) != 2 {
		t.Fatalf("state header %+v", st)
	}
	if len(st.Pools) != 1 || st.Pools[0].Name != "kv" || st.Pools[0].SharedBuffers != 1 || st.Pools[0].ActiveLeases != 1 || st.Pools[0].HandleType != cudart.HandleTypePosixFD {
		t.Fatalf("pools %+v", st.Pools)
	}
	if st.Pools[0].RoundingOverhead() != 1<<20 {
		t.Fatalf("rounding overhead %d, want 1 MiB (3 MiB rounded to 4)", st.Pools[0].RoundingOverhead())
	}
	if len(st.Published) != 1 || st.Published[0].Name != "a" || st.Published[0].Size != 3<<20 {
		t.Fatalf("published %+v", st.Published)
	}
	// The consumer; QueryState's own connection, which takes no leases, is left out.
	if len(st.Peers) != 1 || st.Peers[0].Leases != 1 || st.Peers[0].BytesLeased != 3<<20 ||
		st.Peers[0].Device != c.imp.devUUID.String() || st.Peers[0].AwaitingExit {
		t.Fatalf("peers %+v, want the consumer alone", st.Peers)
	}
	m.Release(testCtx(t), c.stream)
}

func TestPushHandsBufferToHandler(t *testing.T) {
	pr := newProducer(t, nil, nil)
	pr.publish(t, "p", 1<<20, 0x11)
	got := make(chan *Mapping, 1)
	s := newSide(t, 0)
	imp, err := Dial(testCtx(t), pr.path, s.dev, 0, WithLogger(discardLogger), WithPushes(s.stream, func(name string, m *Mapping) {
		if name != "p" {
			t.Errorf("pushed name %q", name)
		}
		got <- m
	}))
	if err != nil {
		t.Fatal(err)
	}
	defer imp.Close(context.Background())
	ctx := testCtx(t)
	if err := pr.ex.Push(ctx, "p", os.Getpid()); err != nil {
		t.Fatal(err)
	}
	m := <-got
	c := &consumer{side: s, imp: imp}
	if b := c.read(t, m); !allAre(b, 0x11) {
		t.Fatal("pushed mapping reads wrong bytes")
	}
	if err := m.Release(ctx, s.stream); err != nil {
		t.Fatal(err)
	}
	if n := pr.activeLeases(t); n != 0 {
		t.Fatalf("%d leases after the pushed mapping was released", n)
	}
	if err := pr.ex.Push(ctx, "p", impossiblePID(t)); !errors.Is(err, ErrNoPeer) {
		t.Fatalf("Push to nobody = %v, want ErrNoPeer", err)
	}
	if err := pr.ex.Push(ctx, "nope", os.Getpid()); !errors.Is(err, ErrUnknownName) {
		t.Fatalf("Push of an unknown name = %v, want ErrUnknownName", err)
	}
	pr.checkClean(t)
	s.checkClean(t)
}

func TestPushWithoutHandlerIsGivenBack(t *testing.T) {
	pr := newProducer(t, nil, nil)
	pr.publish(t, "p", 1<<20, 1)
	c := newConsumer(t, pr.path, 0)
	if err := pr.ex.Push(testCtx(t), "p", os.Getpid()); err != nil {
		t.Fatal(err)
	}
	waitFor(t, "the pushed lease to come back", func() bool { return pr.activeLeases(t) == 0 })
	c.checkClean(t)
}

func TestPublishChecks(t *testing.T) {
	pr := newProducer(t, nil, nil)
	b := pr.publish(t, "a", 1<<20, 1)
	ctx := testCtx(t)
	if err := pr.ex.Publish(ctx, "a", b, pr.stream); !errors.Is(err, ErrNameInUse) {
		t.Fatalf("Publish twice = %v, want ErrNameInUse", err)
	}
	for _, name := range []string{"", strings.Repeat("x", MaxNameLen+1), "a\nb", "\xff"} {
		if err := pr.ex.Publish(ctx, name, b, pr.stream); !errors.Is(err, ErrBadName) {
			t.Fatalf("Publish(%q) = %v, want ErrBadName", name, err)
		}
	}
	if err := pr.ex.Unpublish("a"); err != nil {
		t.Fatal(err)
	}
	if err := pr.ex.Unpublish("a"); !errors.Is(err, ErrUnknownName) {
		t.Fatalf("Unpublish twice = %v, want ErrUnknownName", err)
	}
	local, err := pool.New(pr.dev, 0, pool.WithHandleType(cudart.HandleTypeNone))
	if err != nil {
		t.Fatal(err)
	}
	defer local.Close(ctx, pool.Force())
	lb, err := local.Alloc(ctx, 4096, pr.stream)
	if err != nil {
		t.Fatal(err)
	}
	if err := pr.ex.Publish(ctx, "local", lb, pr.stream); !errors.Is(err, pool.ErrNotShareable) {
		t.Fatalf("Publish of a local pool's buffer = %v, want pool.ErrNotShareable", err)
	}
}

func TestFabricWithoutIMEXIsReported(t *testing.T) {
	pr := newProducer(t, []pool.Option{pool.WithHandleType(cudart.HandleTypeFabric)}, nil)
	ctx := testCtx(t)
	b, err := pr.pool.Alloc(ctx, 1<<20, pr.stream)
	if err != nil {
		t.Fatal(err)
	}
	err = pr.ex.Publish(ctx, "f", b, pr.stream)
	if !errors.Is(err, ErrIMEXRequired) || !errors.Is(err, cudart.ErrNotPermitted) || !strings.Contains(err.Error(), "IMEX channel") {
		t.Fatalf("Publish of a FABRIC buffer without IMEX = %v, want ErrIMEXRequired", err)
	}
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
	if err := pr.ex.Serve(l); err != nil {
		t.Fatal(err)
	}
	s := newSide(t, 1, cudarttest.WithFabric())
	ctx := testCtx(t)
	nc, err := net.Dial("tcp", l.Addr().String())
	if err != nil {
		t.Fatal(err)
	}
	imp, err := DialConn(ctx, nc, s.dev, 1, WithLogger(discardLogger))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { imp.Close(context.Background()) })
	c := &consumer{side: s, imp: imp}
	m, err := imp.Open(ctx, "f", s.stream)
	if err != nil {
		t.Fatal(err)
	}
	// Across nodes no event can carry the producer's writes over: the exporter waited
	// for them on its host before it answered, and the answer crossing the network
	// orders the consumer after them. The software device cannot see a network
	// message, so the test hands that order over with an event of its own, as the
	// network does for real.
	orderAfterProducer(t, pr, s)
	if b := c.read(t, m); !allAre(b, 0xfa) {
		t.Fatal("FABRIC mapping reads wrong bytes")
	}
	if p := pr.ex.Peers(); len(p) != 1 || !p[0].Remote {
		t.Fatalf("peers %+v, want one remote", p)
	}
	if err := m.Release(ctx, s.stream); err != nil {
		t.Fatal(err)
	}
	if n := pr.activeLeases(t); n != 0 {
		t.Fatalf("%d leases after release", n)
	}
	if err := imp.Close(ctx); err != nil {
		t.Fatal(err)
	}
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
		if err != nil {
			t.Fatal(err)
		}
		s := newSide(t, 0)
		imp, err := DialConn(testCtx(t), nc, s.dev, 0, WithLogger(discardLogger))
		if !remote {
			if !errors.Is(err, ErrRefused) || !strings.Contains(err.Error(), "AllowRemote") {
				t.Fatalf("DialConn without AllowRemote = %v, want ErrRefused naming AllowRemote", err)
			}
			continue
		}
		if err != nil {
			t.Fatal(err)
		}
		if _, err := imp.Open(testCtx(t), "a", s.stream); !errors.Is(err, ErrHandleType) {
			t.Fatalf("Open of a POSIX fd pool over TCP = %v, want ErrHandleType", err)
		}
		if n := pr.activeLeases(t); n != 0 {
			t.Fatalf("%d leases after a refused open", n)
		}
		imp.Close(testCtx(t))
	}
}

func TestSecondImporterToOneExporterIsRefused(t *testing.T) {
	pr := newProducer(t, nil, nil)
	c := newConsumer(t, pr.path, 0)
	if _, err := Dial(testCtx(t), pr.path, c.dev, 0); !errors.Is(err, ErrDuplicateImporter) {
		t.Fatalf("second Dial = %v, want ErrDuplicateImporter", err)
	}
	c.imp.Close(testCtx(t))
	imp, err := Dial(testCtx(t), pr.path, c.dev, 0)
	if err != nil {
		t.Fatalf("Dial after the first Importer closed: %v", err)
	}
	imp.Close(testCtx(t))
}

// Dial says why nothing answers, as the error the system gave: a socket file nobody
// serves refuses the connection, a missing one does not exist.
func TestDialNothingListening(t *testing.T) {
	s := newSide(t, 0)
	dir := shortDir(t)
	_, err := Dial(testCtx(t), dir+"/none.sock", s.dev, 0)
	if !errors.Is(err, ErrExporterGone) || !errors.Is(err, fs.ErrNotExist) {
		t.Fatalf("Dial of a missing socket = %v, want ErrExporterGone and fs.ErrNotExist", err)
	}
	l, err := net.ListenUnix("unix", &net.UnixAddr{Name: dir + "/dead.sock", Net: "unix"})
	if err != nil {
		t.Fatal(err)
	}
	l.SetUnlinkOnClose(false)
	l.Close()
	_, err = Dial(testCtx(t), dir+"/dead.sock", s.dev, 0)
	if !errors.Is(err, ErrExporterGone) || !errors.Is(err, syscall.ECONNREFUSED) {
		t.Fatalf("Dial of a socket nobody serves = %v, want ErrExporterGone and ECONNREFUSED", err)
	}
}

// A liveness probe (Discover's) connects and hangs up without a word: that is logged
// for debugging only, not as a warning.
func TestProbeIsNotAWarning(t *testing.T) {
	pr := newProducer(t, nil, nil)
	if live, err := socketAnswers(pr.path); !live || err != nil {
		t.Fatalf("socketAnswers = %v, %v; want a live socket", live, err)
	}
	waitFor(t, "the probe to be logged", func() bool { return strings.Contains(pr.log.String(), "not admitted") })
	if log := pr.log.String(); !strings.Contains(log, "level=DEBUG msg=\"export: connection not admitted\"") || strings.Contains(log, "level=WARN") {
		t.Fatalf("probe logged as more than debugging:\n%s", log)
	}
}

// A consumer that closes its connection without Bye but lives on (here, the test's own
// process) may still map what it holds: its lease, and the free waiting on it, stay
// until its process exits, and no new lease reaches it. Close, whose ctx ends first,
// reports the lease and ends it.
func TestLivePeerThatHangsUpKeepsItsLeases(t *testing.T) {
	pr := newProducer(t, nil, nil)
	before, _ := pr.pool.Stats()
	b := pr.publish(t, "a", 1<<20, 1)
	pr.publish(t, "b", 1<<20, 2)
	c := newConsumer(t, pr.path, 0)
	ctx := testCtx(t)
	m, err := c.imp.Open(ctx, "a", c.stream)
	if err != nil {
		t.Fatal(err)
	}
	if err := b.Free(pr.stream); err != nil {
		t.Fatal(err)
	}
	c.imp.cl.c.close()
	waitFor(t, "the exporter to see the hang-up", func() bool {
		ps := pr.ex.Peers()
		return len(ps) == 0 || ps[0].AwaitingExit
	})
	if s, _ := pr.pool.Stats(); s.ActiveLeases != 1 || s.DeferredFrees != 1 {
		t.Fatalf("pool after a live consumer hung up: %+v, want its lease and the free waiting", s)
	}
	if got := c.read(t, m); !allAre(got, 1) {
		t.Fatal("the mapping of a consumer that hung up changed")
	}
	pr.checkClean(t)
	if st, err := pr.ex.State(); err != nil || len(st.Peers) != 1 || !st.Peers[0].AwaitingExit || st.Peers[0].Leases != 1 {
		t.Fatalf("State peers %+v, %v; want the consumer awaiting its exit with its lease", st.Peers, err)
	}
	if !strings.Contains(pr.log.String(), "held until its process exits") {
		t.Fatalf("the held leases are not logged:\n%s", pr.log.String())
	}
	if err := pr.ex.Push(ctx, "b", os.Getpid()); !errors.Is(err, ErrNoPeer) {
		t.Fatalf("Push to a consumer that hung up = %v, want ErrNoPeer", err)
	}

	// The consumer releases, but cannot tell the exporter any more; the exporter sees
	// nothing either, as the process lives on. Close, with its ctx ended, names the
	// lease and ends it as of the consumer's last release, which covers this one.
	if err := m.Release(ctx, c.stream); err != nil {
		t.Fatalf("Release after hanging up = %v, want nil: there is no one to tell", err)
	}
	ended, cancel := context.WithCancel(context.Background())
	cancel()
	err = pr.ex.Close(ended)
	if !errors.Is(err, context.Canceled) || !strings.Contains(err.Error(), fmt.Sprintf("pid %d, its connection lost but its process alive, holds 1 leases", os.Getpid())) {
		t.Fatalf("Close = %v, want the lost consumer's lease reported", err)
	}
	after, _ := pr.pool.Stats()
	if after.ActiveLeases != 0 || after.DeferredFrees != 0 || after.LiveBuffers != before.LiveBuffers+1 {
		t.Fatalf("pool after Close %+v, before the buffers %+v: want the lease ended and the free done", after, before)
	}
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
	if err != nil {
		t.Fatal(err)
	}
	pr.dev.Close()
	for _, p := range pr.ex.peerList() {
		p.c.close()
	}
	<-c.imp.cl.readerDone
	if b := c.read(t, m); !allAre(b, 0x77) {
		t.Fatal("mapping unreadable after the producer died")
	}
	if _, err := c.imp.Open(ctx, "a", c.stream); !errors.Is(err, ErrExporterGone) {
		t.Fatalf("Open after the producer died = %v, want ErrExporterGone", err)
	}
	if err := m.Release(ctx, c.stream); err != nil {
		t.Fatalf("Release after the producer died = %v, want nil", err)
	}
	if err := c.imp.Close(ctx); err != nil {
		t.Fatalf("Close after the producer died = %v, want nil", err)
	}
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
	if err != nil {
		t.Fatal(err)
	}
	closed := make(chan error, 1)
	go func() { closed <- pr.ex.Close(ctx) }()
	waitFor(t, "the importer to hear Bye", func() bool {
		c.imp.cl.mu.Lock()
		defer c.imp.cl.mu.Unlock()
		return c.imp.cl.bye
	})
	if _, err := c.imp.Open(ctx, "a", c.stream); !errors.Is(err, ErrExporterGone) {
		t.Fatalf("Open during Close = %v, want ErrExporterGone", err)
	}
	select {
	case err := <-closed:
		t.Fatalf("Close returned %v while a lease was held", err)
	default:
	}
	if err := m.Release(ctx, c.stream); err != nil {
		t.Fatal(err)
	}
	if err := <-closed; err != nil {
		t.Fatal(err)
	}
	if err := c.imp.Close(ctx); err != nil {
		t.Fatal(err)
	}
	pr.checkClean(t)
	c.checkClean(t)
}

func TestExporterCloseGivesUpWhenContextEnds(t *testing.T) {
	pr := newProducer(t, nil, nil)
	pr.publish(t, "a", 1<<20, 1)
	c := newConsumer(t, pr.path, 0)
	if _, err := c.imp.Open(testCtx(t), "a", c.stream); err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	err := pr.ex.Close(ctx)
	if !errors.Is(err, context.Canceled) || !strings.Contains(err.Error(), "holds 1 leases") {
		t.Fatalf("Close with a held lease and an ended ctx = %v", err)
	}
	if n := pr.activeLeases(t); n != 0 {
		t.Fatalf("%d leases left after Close ended them", n)
	}
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
		imp, err := Dial(ctx, pr.path, s.dev, 0, WithLogger(discardLogger))
		if err != nil {
			t.Fatal(err)
		}
		m, err := imp.Open(ctx, "a", s.stream)
		if err != nil {
			t.Fatal(err)
		}
		if i%2 == 0 {
			if err := m.Release(ctx, s.stream); err != nil {
				t.Fatal(err)
			}
		} // odd rounds leave the mapping to Close
		if err := imp.Close(ctx); err != nil {
			t.Fatal(err)
		}
	}
	cycle(0)
	waitFor(t, "the first peer to leave", func() bool { return len(pr.ex.Peers()) == 0 })
	baseline := openFDs(t)
	for i := range 100 {
		cycle(i)
	}
	waitFor(t, "every peer to leave", func() bool { return len(pr.ex.Peers()) == 0 })
	if got := openFDs(t); got != baseline {
		t.Fatalf("%d descriptors open after 100 connections, %d before", got, baseline)
	}
	if n := pr.activeLeases(t); n != 0 {
		t.Fatalf("%d leases left", n)
	}
	pr.checkClean(t)
	s.checkClean(t)
}

// orderAfterProducer orders the consumer's stream after all the producer's work so
// far, through an IPC event the test makes: it stands in for a message that crossed a
// network after the producer's host synchronised.
func orderAfterProducer(t testing.TB, pr *producer, c *side) {
	t.Helper()
	ev, err := pr.dev.EventCreate(pr.ord, cudart.EventIPC)
	if err != nil {
		t.Fatal(err)
	}
	defer pr.dev.EventDestroy(pr.ord, ev)
	if err := pr.dev.EventRecord(pr.ord, ev, pr.stream); err != nil {
		t.Fatal(err)
	}
	h, err := pr.dev.IpcGetEventHandle(pr.ord, ev)
	if err != nil {
		t.Fatal(err)
	}
	opened, err := c.dev.IpcOpenEventHandle(c.ord, h)
	if err != nil {
		t.Fatal(err)
	}
	defer c.dev.EventDestroy(c.ord, opened)
	if err := c.dev.StreamWaitEvent(c.ord, c.stream, opened); err != nil {
		t.Fatal(err)
	}
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
	if err := pr.ex.Close(testCtx(t)); err != nil {
		t.Fatal(err)
	}
	if !r.closedByExporter() {
		t.Fatal("the silent peer's connection stayed open")
	}
	b, err := pr.pool.Alloc(testCtx(t), 4096, pr.stream)
	if err != nil {
		t.Fatal(err)
	}
	if err := pr.ex.Publish(testCtx(t), "late", b, pr.stream); !errors.Is(err, ErrClosed) {
		t.Fatalf("Publish after Close = %v, want ErrClosed", err)
	}
}

// A buffer released and opened again is imported anew, after this process's earlier
// free of it is known complete (FACTS 4: a pending free would unmap the new import).
func TestReopenAfterReleaseSettlesTheFree(t *testing.T) {
	pr := newProducer(t, nil, nil)
	pr.publish(t, "a", 1<<20, 5)
	c := newConsumer(t, pr.path, 0)
	ctx := testCtx(t)
	m, err := c.imp.Open(ctx, "a", c.stream)
	if err != nil {
		t.Fatal(err)
	}
	if err := m.Release(ctx, c.stream); err != nil {
		t.Fatal(err)
	}
	if n := len(c.imp.freed); n != 1 {
		t.Fatalf("%d frees tracked after a release, want 1", n)
	}
	m2, err := c.imp.Open(ctx, "a", c.stream)
	if err != nil {
		t.Fatal(err)
	}
	if m2 == m || len(c.imp.freed) != 0 {
		t.Fatalf("reopen: same mapping %v, %d frees still tracked; want a new mapping and none", m2 == m, len(c.imp.freed))
	}
	if b := c.read(t, m2); !allAre(b, 5) {
		t.Fatal("reopened mapping reads wrong bytes")
	}
	if err := m2.Release(ctx, c.stream); err != nil {
		t.Fatal(err)
	}
	c.checkClean(t)
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
	if err != nil {
		t.Fatal(err)
	}
	if err := m.Release(ctx, c.stream); err != nil {
		t.Fatal(err)
	}
	cancelled, cancel := context.WithCancel(ctx)
	cancel()
	if err := pr.ex.Push(cancelled, "p", os.Getpid()); !errors.Is(err, context.Canceled) {
		t.Fatalf("Push with an ended context = %v, want context.Canceled", err)
	}
	if n := pr.activeLeases(t); n != 0 {
		t.Fatalf("%d pool leases held after a Push that sent nothing", n)
	}
	for _, p := range pr.ex.Peers() {
		if p.Leases != 0 {
			t.Fatalf("peer pid %d holds %d leases after a Push that sent nothing", p.PID, p.Leases)
		}
	}
	// The connection is intact: nothing was written.
	if m, err = c.imp.Open(ctx, "p", c.stream); err != nil {
		t.Fatal(err)
	}
	if err := m.Release(ctx, c.stream); err != nil {
		t.Fatal(err)
	}
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
	if err != nil {
		t.Fatal(err)
	}
	if err := m.Release(ctx, c.stream); err != nil {
		t.Fatal(err)
	}
	peers := pr.ex.peerList()
	if len(peers) != 1 {
		t.Fatalf("%d peers, want 1", len(peers))
	}
	p := peers[0]
	if err := c.imp.Close(ctx); err != nil {
		t.Fatal(err)
	}
	waitFor(t, "the peer to leave", func() bool { return len(pr.ex.peerList()) == 0 })
	pub, err := pr.ex.lookup("p")
	if err != nil {
		t.Fatal(err)
	}
	if err := p.push(ctx, pub); !errors.Is(err, ErrNoPeer) {
		t.Fatalf("push to a departed peer = %v, want ErrNoPeer", err)
	}
	if n := pr.activeLeases(t); n != 0 {
		t.Fatalf("%d pool leases held after a push to a departed peer", n)
	}
	if n := rt.stillOpen(); n != 0 {
		t.Fatalf("%d of the departed peer's events left open", n)
	}
}

// A grant withdrawn after the peer released the lease it shares (the peer, holding
// the buffer already, released as many grants as it knew of, and the release took the
// newest) still leaves the lease with exactly the grants the peer knows of: none.
func TestWithdrawAfterOverlappingReleaseLeavesNothing(t *testing.T) {
	pr := newProducer(t, nil, nil)
	pr.publish(t, "buf", 1<<20, 1)
	a := admitted(t, pr.path)
	l, ok := a.open(1, "buf").(*leaseMsg)
	if !ok {
		t.Fatal("open did not answer with a Lease")
	}
	peers := pr.ex.peerList()
	if len(peers) != 1 {
		t.Fatalf("%d peers, want 1", len(peers))
	}
	p := peers[0]
	pub, err := pr.ex.lookup("buf")
	if err != nil {
		t.Fatal(err)
	}
	// A Push's grant, as if its frame were on its way when the peer released.
	pushed, pl, err := p.grant(testCtx(t), pub, 0)
	if err != nil {
		t.Fatal(err)
	}
	if pushed.LeaseID != l.LeaseID {
		t.Fatal("a second grant of a held buffer got another lease id")
	}
	if m := a.release(2, l.LeaseID, 1); m.kind() != msgReleased {
		t.Fatalf("release answered %s", m.kind())
	}
	p.withdraw(pushed.LeaseID, pl) // the Push's frame failed to go out
	if n := pr.activeLeases(t); n != 0 {
		t.Fatalf("%d pool leases held, though the peer released the one grant it knew of", n)
	}
	if i := p.state(); i.Leases != 0 || i.Grants != 0 {
		t.Fatalf("peer holds %d leases, %d grants; want none", i.Leases, i.Grants)
	}
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
func (l *pipeListener) dial(t *testing.T, h *helloMsg) *conn {
	t.Helper()
	a, b := net.Pipe()
	t.Cleanup(func() { b.Close() })
	l.conns <- a
	c := newConn(b, true)
	if err := c.send(testCtx(t), h, -1); err != nil {
		t.Fatal(err)
	}
	if m, _, err := c.recv(); err != nil || m.kind() != msgWelcome {
		t.Fatalf("handshake: %v %v", m, err)
	}
	return c
}

// Peers that stopped reading keep neither Close's Bye from the others nor Close from
// waiting for the others' releases.
func TestCloseWaitsForReleasesPastPeersThatDoNotRead(t *testing.T) {
	pr := newProducer(t, nil, []ListenOption{WithPolicy(Policy{AllowRemote: true})})
	pr.publish(t, "p", 1<<20, 1)
	l := newPipeListener()
	if err := pr.ex.Serve(l); err != nil {
		t.Fatal(err)
	}
	// Several, so that the one reading peer is unlikely to be told first by chance.
	for range 4 {
		l.dial(t, &helloMsg{Version: ProtocolVersion}) // and never read from again
	}
	c := newConsumer(t, pr.path, 0)
	ctx := testCtx(t)
	m, err := c.imp.Open(ctx, "p", c.stream)
	if err != nil {
		t.Fatal(err)
	}
	closed := make(chan error, 1)
	go func() { closed <- pr.ex.Close(ctx) }()
	waitFor(t, "the consumer to be told Bye", func() bool {
		c.imp.cl.mu.Lock()
		defer c.imp.cl.mu.Unlock()
		return c.imp.cl.bye
	})
	if err := m.Release(ctx, c.stream); err != nil {
		t.Fatal(err)
	}
	if err := <-closed; err != nil {
		t.Fatalf("Close = %v, want nil: every lease was released before its context ended", err)
	}
}

// A grant waiting for another grant's pool handle to go out, to a peer that stopped
// reading, gives up when its context ends.
func TestGrantBehindStuckPoolHandleHonoursContext(t *testing.T) {
	pr := newProducer(t, []pool.Option{pool.WithHandleType(cudart.HandleTypeFabric)},
		[]ListenOption{WithPolicy(Policy{AllowRemote: true})}, cudarttest.WithFabric())
	pr.publish(t, "f", 2<<20, 1)
	l := newPipeListener()
	if err := pr.ex.Serve(l); err != nil {
		t.Fatal(err)
	}
	c := l.dial(t, &helloMsg{Version: ProtocolVersion, Flags: helloLeases, HandleTypes: uint32(cudart.HandleTypeFabric)})
	peers := pr.ex.peerList()
	if len(peers) != 1 {
		t.Fatalf("%d peers, want 1", len(peers))
	}
	p := peers[0]
	if err := c.send(testCtx(t), &openMsg{ReqID: 1, Name: "f"}, -1); err != nil {
		t.Fatal(err)
	}
	var first [1]byte
	if _, err := io.ReadFull(c.nc, first[:]); err != nil { // the pool handle is on its way
		t.Fatal(err)
	}
	pub, err := pr.ex.lookup("f")
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(testCtx(t))
	cancel()
	pushed := make(chan error, 1)
	go func() { pushed <- p.push(ctx, pub) }()
	select {
	case err := <-pushed:
		if !errors.Is(err, context.Canceled) {
			t.Fatalf("push = %v, want context.Canceled", err)
		}
	case <-time.After(hangGuard):
		t.Fatal("a grant behind a stuck pool handle ignored its ended context")
	}
}
