package owner_test

import (
	"encoding/json"
	"errors"
	"log/slog"
	"net"
	"os"
	"slices"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/cudapool/cudapool/cudart/cudarttest"
	"github.com/cudapool/cudapool/internal/testlog"
	"github.com/cudapool/cudapool/internal/testwait"
	"github.com/cudapool/cudapool/kv"
	"github.com/cudapool/cudapool/kv/internal/kvwire"
	"github.com/cudapool/cudapool/kv/owner"
	"github.com/cudapool/cudapool/kv/replica"
)

// listenWith starts an owner of small on device 0 with opts, and without an
// announcement.
func listenWith(t *testing.T, opts ...owner.Option) (*owner.Owner, string) {
	t.Helper()
	dir, err := os.MkdirTemp("", "kvs")
	require.NoError(t, err)
	t.Cleanup(func() { os.RemoveAll(dir) })
	dev := cudarttest.ForTest(t)
	ow, err := owner.Listen(dir, dev, small, opts...)
	require.NoError(t, err)
	t.Cleanup(func() {
		assert.NoError(t, ow.Close(bound(t)))
		assert.NoError(t, dev.Err(), "the owner's device saw broken rules")
	})
	return ow, dir
}

// failingOnce is a listener whose first Accept fails with EMFILE.
type failingOnce struct {
	net.Listener
	failed atomic.Bool
}

func (l *failingOnce) Accept() (net.Conn, error) {
	if !l.failed.Swap(true) {
		return nil, &net.OpError{Op: "accept", Net: "unix", Err: os.NewSyscallError("accept", syscall.EMFILE)}
	}
	return l.Listener.Accept()
}

// N1: one accept that fails for want of descriptors does not stop admission: the
// owner backs off and accepts again.
func TestAcceptOutlastsEMFILE(t *testing.T) {
	l := &failingOnce{}
	defer owner.SetWrapListener(func(in net.Listener) net.Listener { l.Listener = in; return l })()
	_, dir := listenWith(t)
	r := dialRaw(t, dir)
	r.hello()
	assert.True(t, l.failed.Load(), "the first accept failed")
}

// N3: connections in their handshake are capped per uid; one past the cap is closed
// at once, without a word, while those within it wait for their Hello; the handshake
// timeout is the owner's to set.
func TestHandshakesAreCapped(t *testing.T) {
	_, dir := listenWith(t, owner.WithHandshakeLimit(0, 3), owner.WithHandshakeTimeout(time.Hour))
	var silent []*raw
	for range 3 {
		silent = append(silent, dialRaw(t, dir))
	}
	over := dialRaw(t, dir)
	over.closed("a connection past the handshake cap")
	for i, r := range silent {
		_ = r.nc.SetReadDeadline(time.Now().Add(50 * time.Millisecond))
		_, _, err := r.next()
		var ne net.Error
		require.True(t, errors.As(err, &ne) && ne.Timeout(), "connection %d within the cap was closed: %v", i, err)
		_ = r.nc.SetDeadline(time.Now().Add(testwait.Bound))
	}
	silent[0].hello() // within its hour; then its slot is free
	late := dialRaw(t, dir)
	late.hello()
}

// N3: the handshake timeout is configurable: a connection that says nothing is
// closed by the owner once it has passed. The test's own read deadline
// (testwait.Bound) is far longer, and closed fails if that deadline, not the owner's
// close, ends the read.
func TestHandshakeTimeoutIsConfigurable(t *testing.T) {
	_, dir := listenWith(t, owner.WithHandshakeTimeout(20*time.Millisecond))
	r := dialRaw(t, dir)
	r.closed("a connection silent past the handshake timeout")
}

// A replica that stops reading its answers is dropped once a write to it has waited
// the owner's bound, rather than holding the owner's write (and its connection's
// goroutine) forever. The replica here sends Stats requests and reads nothing: once
// both sockets' buffers are full, the owner's answer blocks, its bound (made short)
// passes and it closes the connection, which this side's writes then see. Without
// the bound, the owner would stop reading too, and this side's write would end at its
// own deadline (testwait.Bound) instead: the test fails.
func TestReplicaThatStopsReadingIsDropped(t *testing.T) {
	t.Cleanup(owner.SetWriteTimeout(20 * time.Millisecond)) // after the owner's Close, registered below
	_, dir := listenWith(t)
	r := dialRaw(t, dir)
	r.hello()
	req, err := kvwire.AppendEmpty(nil, kvwire.TypeStats, 1)
	require.NoError(t, err)
	var werr error
	for werr == nil { // the owner's close ends it; dialRaw's deadline bounds it
		_, werr = r.nc.Write(req)
	}
	require.False(t, errors.Is(werr, os.ErrDeadlineExceeded), "the owner never dropped a replica that stopped reading: this side's write waited out its own deadline (%v)", werr)
	require.True(t, errors.Is(werr, syscall.EPIPE) || errors.Is(werr, syscall.ECONNRESET), "the owner closed the connection: %v", werr)
	for { // the answers the owner wrote before its bound passed, then the end
		h, _, err := r.next()
		if err != nil {
			require.False(t, errors.Is(err, os.ErrDeadlineExceeded), "the connection was not closed: %v", err)
			break
		}
		require.Equal(t, kvwire.TypeStatsReply, h.Type)
	}
}

// N2: admitted connections are capped per process: one past the cap is refused
// with kv.ErrLimit naming the cap, and the owner serves the others on.
func TestConnectionsPerProcessAreCapped(t *testing.T) {
	_, dir := listenWith(t, owner.WithConnLimit(0, 2))
	a, b := dialRaw(t, dir), dialRaw(t, dir)
	a.hello()
	b.hello()
	c := dialRaw(t, dir)
	err := c.helloRefused(kvwire.Hello{Version: kvwire.Version, PID: uint32(os.Getpid())}, kv.ErrLimit)
	assert.ErrorContains(t, err, "connection limit per process")
	c.closed("a connection past the cap")
	a.send(kvwire.AppendU32(nil, kvwire.TypeAlloc, 2, 1))
	h, _, err := a.next()
	require.NoError(t, err)
	assert.Equal(t, kvwire.TypeLeased, h.Type, "the others are served on")
	b.send(kvwire.AppendEmpty(nil, kvwire.TypeBye, 0))
	b.closed("after Bye")
	d := dialRaw(t, dir)
	d.hello() // b's slot is free again
}

// N2: a connection that hangs up without Bye and holds nothing ends at once, though
// its process lives on: its goroutine, descriptor and pidfd are not kept for the
// process's exit. One that holds a lease waits for the exit.
func TestLostConnectionWithoutLeasesEndsAtOnce(t *testing.T) {
	o, dir := listenWith(t)
	for range 20 {
		r := dialRaw(t, dir)
		r.hello()
		require.NoError(t, r.nc.Close())
	}
	holder := dialRaw(t, dir)
	holder.hello()
	holder.send(kvwire.AppendU32(nil, kvwire.TypeAlloc, 2, 1))
	h, _, err := holder.next()
	require.NoError(t, err)
	require.Equal(t, kvwire.TypeLeased, h.Type)
	require.NoError(t, holder.nc.Close())
	require.Eventually(t, func() bool {
		st := o.Stats()
		return len(st.Replicas) == 1 && st.Replicas[0].AwaitingExit && st.Replicas[0].Leases == 1
	}, testwait.Bound, time.Millisecond, "the lease-less lost connections end, and the holder awaits its exit: %+v", o.Stats().Replicas)
}

// A panic while serving one connection's request ends that connection alone: the
// owner serves the others on and admits new ones, and the connection's leases are
// held as if it had hung up. Under the owner's lock too: the lock is let go before
// the connection's cleanup takes it. (Before, that cleanup waited for the lock
// forever, and with it every replica and Close.)
func TestPanicEndsOnlyItsConnection(t *testing.T) {
	for _, c := range []struct {
		name  string
		panic func(kvwire.Type) func()
		req   []byte
	}{
		{"outside the lock", owner.PanicOn, must(kvwire.AppendEmpty(nil, kvwire.TypeStats, 3))},
		{"under the lock", owner.PanicLockedOn, must(kvwire.AppendMatch(nil, 3, []kv.Hash{{1}}))},
	} {
		t.Run(c.name, func(t *testing.T) {
			t.Cleanup(c.panic(kvwire.Type(c.req[4]))) // after the cleanups below, which end the connections
			o, dir := listenWith(t)
			dev := cudarttest.ForTest(t)
			good, err := replica.Dial(bound(t), dir, dev, 0)
			require.NoError(t, err)
			t.Cleanup(func() { good.Close(bound(t)) })
			bad := dialRaw(t, dir)
			bad.hello()
			bad.alloc(2, 3)
			bad.send(c.req, nil)
			bad.closed("the connection whose request panicked")
			l, err := good.Alloc(bound(t), 2)
			require.NoError(t, err, "the other replica is served on")
			require.NoError(t, good.Release(bound(t), l, 0))
			again := dialRaw(t, dir)
			again.hello()
			require.Eventually(t, func() bool {
				st := o.Stats()
				return slices.ContainsFunc(st.Replicas, func(r kv.ReplicaStats) bool { return r.AwaitingExit && r.Leases == 1 })
			}, testwait.Bound, time.Millisecond, "the panicking connection to hold its lease as if it had hung up: %+v", o.Stats().Replicas)
		})
	}
}

// must is b, for a frame that cannot fail to encode.
func must(b []byte, err error) []byte {
	if err != nil {
		panic(err)
	}
	return b
}

// N5: the Stats frame fits one frame however many replicas are connected: the list
// is cut, and the count of those left out says so. (3,000 replicas made a frame of
// 138 KB, over the 128 KiB limit, and stats failed for everyone.)
func TestStatsFitOneFrameForAnyNumberOfReplicas(t *testing.T) {
	for _, n := range []int{0, 10, kv.MaxListed, 3000, 100000} {
		st := owner.Stats{PID: 1, Devices: []kv.DeviceStats{{Device: 0}}, Replicas: make([]kv.ReplicaStats, n), ReplicaCount: n}
		for i := range st.Replicas {
			st.Replicas[i] = kv.ReplicaStats{PID: 4000000 + i, Device: 7, Leases: 1 << 20, Pages: 1 << 30, AwaitingExit: true}
		}
		js, err := owner.EncodeStats(st)
		require.NoError(t, err, "%d replicas", n)
		assert.LessOrEqual(t, len(js), kvwire.MaxFrame-kvwire.HeaderLen, "%d replicas", n)
		var got kv.Stats
		require.NoError(t, json.Unmarshal(js, &got))
		assert.Equal(t, n, got.ReplicaCount)
		assert.Equal(t, n, len(got.Replicas)+got.ReplicasOmitted, "%d replicas: listed or counted", n)
		assert.LessOrEqual(t, len(got.Replicas), kv.MaxListed)
		if n <= kv.MaxListed {
			assert.Zero(t, got.ReplicasOmitted, "%d replicas all listed", n)
		}
	}
}

// N12: a replica whose connection was lost (cut off as a slow reader, or hung up
// without Bye) while its process lives on can release its leases on a new
// connection: they no longer pin their pages until the process exits, and the lost
// connection, left holding nothing, ends.
func TestANewConnectionReleasesTheLostOnesLeases(t *testing.T) {
	o, dir := listenWith(t)
	lost := dialRaw(t, dir)
	lost.hello()
	l := lost.alloc(2, 3)
	require.NoError(t, lost.nc.Close())
	require.Eventually(t, func() bool {
		st := o.Stats()
		return len(st.Replicas) == 1 && st.Replicas[0].AwaitingExit
	}, testwait.Bound, time.Millisecond, "the owner to see the connection lost")

	again := dialRaw(t, dir)
	again.hello()
	again.send(kvwire.AppendRelease(nil, 4, kvwire.Now, []uint64{l}))
	h, p, err := again.next()
	require.NoError(t, err)
	require.Equal(t, kvwire.TypeReleased, h.Type, "the lost connection's lease, released on a new one: %v", kvwire.ParseError(h.Type, p))
	require.Eventually(t, func() bool {
		st := o.Stats()
		return len(st.Replicas) == 1 && !st.Replicas[0].AwaitingExit && st.Devices[0].Free == small.Pages
	}, testwait.Bound, time.Millisecond, "the lost connection to end and its pages to be free: %+v", o.Stats())
}

// The owner logs nothing unless given a Logger (like producer and consumer): a
// connection closed for a malformed frame is logged to the Logger given, never to
// slog's default.
func TestOwnerIsSilentByDefault(t *testing.T) {
	var def, given testlog.Buffer
	prev := slog.Default()
	slog.SetDefault(slog.New(slog.NewTextHandler(&def, nil)))
	defer slog.SetDefault(prev)
	for _, logger := range []*slog.Logger{nil, slog.New(slog.NewTextHandler(&given, nil))} {
		o, dir := listenWith(t, owner.WithLogger(logger))
		r := dialRaw(t, dir)
		r.hello()
		r.send(header(8, 99, 0), nil)
		r.closed("a frame of an unknown type")
		require.Eventually(t, func() bool { return len(o.Stats().Replicas) == 0 }, testwait.Bound, time.Millisecond, "the connection to end")
	}
	assert.Empty(t, def.String(), "the owner logged to slog's default")
	assert.Contains(t, given.String(), "closing a replica's connection", "the owner logs to the Logger given")
}
