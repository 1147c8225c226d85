package export

import (
	"context"
	"errors"
	"net"
	"os"
	"strings"
	"testing"

	"github.com/cudapool/cudapool/cudart"
	"github.com/cudapool/cudapool/cudart/cudarttest"
	"github.com/cudapool/cudapool/pool"
)

func TestPolicyRefusesWithReason(t *testing.T) {
	other := uint32(os.Getuid()) + 1
	pr := newProducer(t, nil, []Option{WithPolicy(Policy{AllowUIDs: []uint32{other}})})
	s := newSide(t, 0)
	_, err := Dial(testCtx(t), pr.path, s.dev, 0)
	if !errors.Is(err, ErrRefused) || !strings.Contains(err.Error(), "is not allowed") {
		t.Fatalf("Dial = %v, want ErrRefused with the reason", err)
	}
	if _, err := QueryState(testCtx(t), pr.path); !errors.Is(err, ErrRefused) {
		t.Fatalf("QueryState = %v, want ErrRefused: the same policy applies", err)
	}
	if !strings.Contains(pr.log.String(), "not admitted") {
		t.Fatalf("refusal not logged:\n%s", pr.log.String())
	}
	if n := len(pr.ex.Peers()); n != 0 {
		t.Fatalf("%d peers after refusals", n)
	}
	s.checkClean(t)
}

func TestPolicyAdmits(t *testing.T) {
	uid, gid := uint32(os.Getuid()), uint32(os.Getgid())
	for _, p := range []Policy{{}, {AllowUIDs: []uint32{uid}}, {AllowGIDs: []uint32{gid}}, {AllowUIDs: []uint32{uid + 1}, AllowGIDs: []uint32{gid}}} {
		pr := newProducer(t, nil, []Option{WithPolicy(p)})
		newConsumer(t, pr.path, 0)
	}
}

func TestQueryStateDescribesPoolsAndPeers(t *testing.T) {
	pr := newProducer(t, []pool.Option{pool.WithName("kv")}, []Option{WithName("unit-producer")})
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
	if len(st.Pools) != 1 || st.Pools[0].Name != "kv" || st.Pools[0].BuffersShared != 1 || st.Pools[0].ActiveLeases != 1 || st.Pools[0].HandleType != "posix-fd" {
		t.Fatalf("pools %+v", st.Pools)
	}
	if st.Pools[0].RoundingOverhead != 1<<20 {
		t.Fatalf("rounding overhead %d, want 1 MiB (3 MiB rounded to 4)", st.Pools[0].RoundingOverhead)
	}
	if len(st.Published) != 1 || st.Published[0].Name != "a" || st.Published[0].Size != 3<<20 {
		t.Fatalf("published %+v", st.Published)
	}
	// The consumer, and QueryState's own connection, which takes no leases.
	var leasing *PeerState
	for i, p := range st.Peers {
		if p.Device != "" {
			leasing = &st.Peers[i]
		}
	}
	if len(st.Peers) != 2 || leasing == nil || leasing.Leases != 1 || leasing.BytesLeased != 3<<20 || leasing.Device != c.imp.devUUID.String() {
		t.Fatalf("peers %+v", st.Peers)
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
	if err := pr.ex.Push(ctx, os.Getpid(), "p"); err != nil {
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
	if err := pr.ex.Push(ctx, impossiblePID(t), "p"); !errors.Is(err, ErrNoPeer) {
		t.Fatalf("Push to nobody = %v, want ErrNoPeer", err)
	}
	if err := pr.ex.Push(ctx, os.Getpid(), "nope"); !errors.Is(err, ErrUnknownName) {
		t.Fatalf("Push of an unknown name = %v, want ErrUnknownName", err)
	}
	pr.checkClean(t)
	s.checkClean(t)
}

func TestPushWithoutHandlerIsGivenBack(t *testing.T) {
	pr := newProducer(t, nil, nil)
	pr.publish(t, "p", 1<<20, 1)
	c := newConsumer(t, pr.path, 0)
	if err := pr.ex.Push(testCtx(t), os.Getpid(), "p"); err != nil {
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
		[]Option{WithPolicy(Policy{AllowRemote: true})}, cudarttest.WithFabric())
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
		pr := newProducer(t, nil, []Option{WithPolicy(Policy{AllowRemote: remote})})
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

func TestDialNothingListening(t *testing.T) {
	s := newSide(t, 0)
	_, err := Dial(testCtx(t), shortDir(t)+"/none.sock", s.dev, 0)
	if !errors.Is(err, ErrExporterGone) {
		t.Fatalf("Dial of a missing socket = %v, want ErrExporterGone", err)
	}
}

// A consumer that vanishes without a word (its process killed): the exporter ends its
// leases, the deferred free proceeds and the pool is back where it was.
func TestConsumerCrashEndsItsLeases(t *testing.T) {
	pr := newProducer(t, nil, nil)
	before, _ := pr.pool.Stats()
	b := pr.publish(t, "a", 1<<20, 1)
	c := newConsumer(t, pr.path, 0)
	if _, err := c.imp.Open(testCtx(t), "a", c.stream); err != nil {
		t.Fatal(err)
	}
	if err := b.Free(pr.stream); err != nil {
		t.Fatal(err)
	}
	// The process dies: the driver drops its imports, the kernel closes its socket.
	c.dev.Close()
	c.imp.c.close()
	waitFor(t, "the dead peer's leases to end", func() bool { return len(pr.ex.Peers()) == 0 })
	after, _ := pr.pool.Stats()
	if after.LiveBuffers != before.LiveBuffers || after.ActiveLeases != 0 || after.DeferredFrees != 0 || after.UsedCurrent != before.UsedCurrent {
		t.Fatalf("pool after the crash %+v, before %+v", after, before)
	}
	if !strings.Contains(pr.log.String(), "without Bye") {
		t.Fatalf("crash not logged:\n%s", pr.log.String())
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
	<-c.imp.readerDone
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
		c.imp.mu.Lock()
		defer c.imp.mu.Unlock()
		return c.imp.bye
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
	pr := newProducer(t, nil, []Option{WithHandshakeTimeout(hangGuard * 10)})
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
