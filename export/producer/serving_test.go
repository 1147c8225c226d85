package producer

import (
	"context"
	"fmt"
	"net"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"golang.org/x/sys/unix"

	"github.com/cudapool/cudapool/export/consumer"
	"github.com/cudapool/cudapool/export/internal/wire"
)

// exhaustFDs fills this process's descriptor table, leaving free slots, and returns
// the function that gives the rest back.
func exhaustFDs(t *testing.T, free int) func() {
	t.Helper()
	var held []int
	for {
		fd, err := unix.Open("/dev/null", unix.O_RDONLY|unix.O_CLOEXEC, 0)
		if err != nil {
			require.ErrorIs(t, err, unix.EMFILE)
			break
		}
		held = append(held, fd)
	}
	for range free {
		unix.Close(held[len(held)-1])
		held = held[:len(held)-1]
	}
	released := false
	release := func() {
		if !released {
			wire.CloseFDs(held)
			released = true
		}
	}
	t.Cleanup(release)
	return release
}

// lowerFDLimit caps this process's descriptors near what it has open, so that a test
// can exhaust them quickly, and restores the limit when the test ends.
func lowerFDLimit(t *testing.T, spare uint64) {
	t.Helper()
	var old unix.Rlimit
	require.NoError(t, unix.Getrlimit(unix.RLIMIT_NOFILE, &old))
	entries, err := os.ReadDir("/proc/self/fd")
	require.NoError(t, err)
	lim := old
	lim.Cur = uint64(len(entries)) + spare
	require.NoError(t, unix.Setrlimit(unix.RLIMIT_NOFILE, &lim))
	t.Cleanup(func() { unix.Setrlimit(unix.RLIMIT_NOFILE, &old) })
}

// An accept that fails for want of descriptors (EMFILE) does not stop the exporter:
// it backs off and accepts again once descriptors are free. (It used to log the
// failure and accept nothing more, ever.)
func TestAcceptSurvivesDescriptorExhaustion(t *testing.T) {
	pr := newProducer(t, nil, nil)
	pr.publish(t, "a", 1<<20, 7)
	lowerFDLimit(t, 64)
	release := exhaustFDs(t, 1)
	// The one free descriptor goes to this client's socket; the exporter's accept of
	// it then finds none.
	nc, err := net.Dial("unix", pr.path)
	require.NoError(t, err)
	defer nc.Close()
	require.Eventually(t, func() bool { return strings.Contains(pr.log.String(), "too many open files") }, 5*time.Second, time.Millisecond,
		"the exporter's accept should fail with EMFILE")
	release()
	s := newSide(t, 0)
	ctx, cancel := context.WithTimeout(testCtx(t), 5*time.Second)
	defer cancel()
	imp, err := consumer.Dial(ctx, pr.path, s.dev, 0, consumer.WithLogger(discardLogger))
	require.NoError(t, err, "the exporter accepts again once descriptors are free")
	m, err := imp.Open(ctx, "a", s.stream)
	require.NoError(t, err)
	require.NoError(t, m.Release(ctx, s.stream))
	require.NoError(t, imp.Close(ctx))
}

// Connections that never finish their handshake are capped per uid (and in total):
// past the cap a connection is closed at once, and the slots come back as those
// connections go, so a user cannot hold the exporter's handshakes forever.
func TestHandshakesInProgressAreCapped(t *testing.T) {
	pr := newProducer(t, nil, []ListenOption{WithHandshakeLimit(64, 3)})
	var idle []net.Conn
	for range 3 {
		nc, err := net.Dial("unix", pr.path)
		require.NoError(t, err)
		idle = append(idle, nc)
	}
	require.Eventually(t, func() bool { return pr.ex.greetingCount() == 3 }, 5*time.Second, time.Millisecond)
	over := dialRaw(t, pr.path)
	over.nc.SetDeadline(time.Now().Add(5 * time.Second))
	assert.True(t, over.closedByExporter(), "a fourth handshake of one uid is cut at once")
	assert.Contains(t, pr.log.String(), "handshakes in progress")
	for _, nc := range idle {
		nc.Close()
	}
	require.Eventually(t, func() bool { return pr.ex.greetingCount() == 0 }, 5*time.Second, time.Millisecond)
	c := newConsumer(t, pr.path, 0)
	require.NoError(t, c.imp.Close(testCtx(t)))
}

// Connection ids never run out: past the id space of one key the exporter starts
// another, and lease ids of every connection are still told apart as stale, foreign
// or forged. (With 24-bit ids and no reuse, 16.7M handshakes bricked the exporter.)
func TestConnectionIDsNeverRunOut(t *testing.T) {
	setConnIDLimit(t, 3)
	pr := newProducer(t, nil, nil)
	pr.publish(t, "buf", 1<<20, 1)
	first := admitted(t, pr.path)
	l1, ok := first.open(1, "buf").(*wire.LeaseMsg)
	require.True(t, ok)
	var last *rawPeer
	for i := range 10 {
		r := admitted(t, pr.path) // the fourth and later start new id spaces
		if i < 9 {
			r.nc.Close()
		}
		last = r
	}
	l2, ok := last.open(1, "buf").(*wire.LeaseMsg)
	require.True(t, ok)
	wantStale(t, last.release(2, l1.LeaseID, 1), 2, staleForeign)
	wantStale(t, last.release(3, l2.LeaseID^0x5a5a5a5a5a5a, 1), 3, staleForged)
	assert.Equal(t, wire.MsgReleased, last.release(4, l2.LeaseID, 1).Kind())
	wantStale(t, last.release(5, l2.LeaseID, 1), 5, staleReleased)
	wantStale(t, first.release(2, l2.LeaseID, 1), 2, staleForeign)
	assert.Equal(t, wire.MsgReleased, first.release(3, l1.LeaseID, 1).Kind())
	wantStale(t, first.release(4, l1.LeaseID, 1), 4, staleReleased)
}

// A peer cannot take grants without end: past the cap an Open fails with a clear
// error and holds nothing more. (1M grants of one buffer took an exporter from 14 to
// 72 MB.)
func TestGrantsPerPeerAreCapped(t *testing.T) {
	pr := newProducer(t, nil, []ListenOption{WithMaxGrants(5)})
	pr.publish(t, "buf", 1<<20, 1)
	r := admitted(t, pr.path)
	var l *wire.LeaseMsg
	for i := range 5 {
		m, ok := r.open(uint64(i+1), "buf").(*wire.LeaseMsg)
		require.True(t, ok, "grant %d", i+1)
		l = m
	}
	wantError(t, r.open(6, "buf"), 6, ErrTooManyGrants)
	assert.Equal(t, 5, pr.ex.Peers()[0].Grants)
	assert.Equal(t, wire.MsgReleased, r.release(7, l.LeaseID, 5).Kind())
	_, ok := r.open(8, "buf").(*wire.LeaseMsg)
	assert.True(t, ok, "released grants make room again")
}

// Importer.Close returns by its context even when the exporter pushed leases this
// Importer gives back and then stopped reading: the give-backs block on the full
// socket, and Close must not wait for them. (Close ignored its context there.)
func TestImporterCloseBoundedWhenGiveBacksAreStuck(t *testing.T) {
	path := filepath.Join(shortDir(t), "fake.sock")
	l, err := net.Listen("unix", path)
	require.NoError(t, err)
	defer l.Close()
	go func() {
		nc, err := l.Accept()
		if err != nil {
			return
		}
		defer nc.Close()
		c := wire.NewConn(nc, false)
		if _, _, err := c.Recv(); err != nil {
			return
		}
		ctx := context.Background()
		c.Send(ctx, &wire.WelcomeMsg{Version: wire.ProtocolVersion, PID: uint32(os.Getpid())}, -1)
		for i := range 100000 { // each is given back; nobody reads the give-backs
			if c.Send(ctx, &wire.PushMsg{LeaseMsg: wire.LeaseMsg{PoolID: 1, LeaseID: uint64(i + 1), Size: 1, Length: 1}, Name: "p"}, -1) != nil {
				return
			}
		}
		time.Sleep(hangGuard)
	}()
	s := newSide(t, 0)
	imp, err := consumer.Dial(testCtx(t), path, s.dev, 0, consumer.WithLogger(discardLogger))
	require.NoError(t, err)
	time.Sleep(200 * time.Millisecond) // let the give-backs fill the socket
	ctx, cancel := context.WithTimeout(context.Background(), 100*time.Millisecond)
	defer cancel()
	closed := make(chan error, 1)
	go func() { closed <- imp.Close(ctx) }()
	select {
	case err := <-closed:
		assert.ErrorIs(t, err, context.DeadlineExceeded)
	case <-time.After(5 * time.Second):
		t.Fatal("Importer.Close ignored its context")
	}
}

// greetingCount is how many connections are in their handshake.
func (ex *Exporter) greetingCount() int {
	ex.mu.Lock()
	defer ex.mu.Unlock()
	return len(ex.greeting)
}

// setConnIDLimit makes the id spaces of exporters the test starts from now on n
// connections long.
func setConnIDLimit(t *testing.T, n uint32) {
	old := connIDLimit
	connIDLimit = n
	t.Cleanup(func() { connIDLimit = old })
}

// The same connection number in a later id space (here the 4th connection, number 1
// of the second space of 3) issues lease ids apart from the earlier space's number 1:
// ids never collide, and each connection's lease is foreign to the other.
func TestLeaseIDsOfAReusedConnectionNumberNeverCollide(t *testing.T) {
	setConnIDLimit(t, 3)
	pr := newProducer(t, nil, nil)
	for i := range 3 {
		pr.publish(t, fmt.Sprintf("buf%d", i), 1<<20, 1)
	}
	first := admitted(t, pr.path) // space 1, number 1
	for range 2 {
		admitted(t, pr.path) // numbers 2 and 3
	}
	again := admitted(t, pr.path) // space 2, number 1
	ids := map[uint64]string{}
	for i := range 3 {
		for _, r := range []*rawPeer{first, again} {
			l, ok := r.open(uint64(10+i), fmt.Sprintf("buf%d", i)).(*wire.LeaseMsg)
			require.True(t, ok)
			_, seen := ids[l.LeaseID]
			require.False(t, seen, "lease id %#x issued twice", l.LeaseID)
			ids[l.LeaseID] = fmt.Sprintf("%p", r)
		}
	}
	for id, owner := range ids {
		mine, other := first, again
		if owner != fmt.Sprintf("%p", first) {
			mine, other = again, first
		}
		wantStale(t, other.release(20, id, 1), 20, staleForeign)
		assert.Equal(t, wire.MsgReleased, mine.release(21, id, 1).Kind(), "lease %#x released by its own connection", id)
	}
}
