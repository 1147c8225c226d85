package producer_test

import (
	"bytes"
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"syscall"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/cudapool/cudapool/cudart"
	"github.com/cudapool/cudapool/export"
	"github.com/cudapool/cudapool/export/internal/exporttest"
	"github.com/cudapool/cudapool/export/internal/wire"
	"github.com/cudapool/cudapool/export/producer"
)

// Connection ids never run out: past the id space of one key the exporter starts
// another, and lease ids of every connection are still told apart as stale, foreign
// or forged. (With 24-bit ids and no reuse, 16.7M handshakes bricked the exporter.)
func TestConnectionIDsNeverRunOut(t *testing.T) {
	producer.SetConnIDLimit(t, 3)
	pr := exporttest.NewProducer(t, nil, nil)
	pr.Publish(t, "buf", 1<<20, 1)
	first := admitted(t, pr.Path)
	l1, ok := first.Open(1, "buf").(*wire.LeaseMsg)
	require.True(t, ok)
	var last *exporttest.RawPeer
	for i := range 10 {
		r := admitted(t, pr.Path) // the fourth and later start new id spaces
		if i < 9 {
			r.Nc.Close()
		}
		last = r
	}
	l2, ok := last.Open(1, "buf").(*wire.LeaseMsg)
	require.True(t, ok)
	wantStale(t, last.Release(2, l1.LeaseID, 1), 2, staleForeign)
	wantStale(t, last.Release(3, l2.LeaseID^0x5a5a5a5a5a5a, 1), 3, staleForged)
	assert.Equal(t, wire.MsgReleased, last.Release(4, l2.LeaseID, 1).Kind())
	wantStale(t, last.Release(5, l2.LeaseID, 1), 5, staleReleased)
	wantStale(t, first.Release(2, l2.LeaseID, 1), 2, staleForeign)
	assert.Equal(t, wire.MsgReleased, first.Release(3, l1.LeaseID, 1).Kind())
	wantStale(t, first.Release(4, l1.LeaseID, 1), 4, staleReleased)
}

// A peer cannot take grants without end: past the cap an Open fails with a clear
// error and holds nothing more. (1M grants of one buffer took an exporter from 14 to
// 72 MB.)
func TestGrantsPerPeerAreCapped(t *testing.T) {
	pr := exporttest.NewProducer(t, nil, []producer.ListenOption{producer.WithMaxGrants(5)})
	pr.Publish(t, "buf", 1<<20, 1)
	r := admitted(t, pr.Path)
	var l *wire.LeaseMsg
	for i := range 5 {
		m, ok := r.Open(uint64(i+1), "buf").(*wire.LeaseMsg)
		require.True(t, ok, "grant %d", i+1)
		l = m
	}
	wantError(t, r.Open(6, "buf"), 6, export.ErrTooManyGrants)
	assert.Equal(t, 5, pr.Ex.Peers()[0].Grants)
	assert.Equal(t, wire.MsgReleased, r.Release(7, l.LeaseID, 5).Kind())
	_, ok := r.Open(8, "buf").(*wire.LeaseMsg)
	assert.True(t, ok, "released grants make room again")
}

// The same connection number in a later id space (here the 4th connection, number 1
// of the second space of 3) issues lease ids apart from the earlier space's number 1:
// ids never collide, and each connection's lease is foreign to the other.
func TestLeaseIDsOfAReusedConnectionNumberNeverCollide(t *testing.T) {
	producer.SetConnIDLimit(t, 3)
	pr := exporttest.NewProducer(t, nil, nil)
	for i := range 3 {
		pr.Publish(t, fmt.Sprintf("buf%d", i), 1<<20, 1)
	}
	first := admitted(t, pr.Path) // space 1, number 1
	for range 2 {
		admitted(t, pr.Path) // numbers 2 and 3
	}
	again := admitted(t, pr.Path) // space 2, number 1
	ids := map[uint64]string{}
	for i := range 3 {
		for _, r := range []*exporttest.RawPeer{first, again} {
			l, ok := r.Open(uint64(10+i), fmt.Sprintf("buf%d", i)).(*wire.LeaseMsg)
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
		wantStale(t, other.Release(20, id, 1), 20, staleForeign)
		assert.Equal(t, wire.MsgReleased, mine.Release(21, id, 1).Kind(), "lease %#x released by its own connection", id)
	}
}

// A peer that connects and says nothing is closed by the exporter once its handshake
// timeout has passed, and its handshake slot comes back, so that silent connections
// cannot hold a user's slots for ever. The raw peer's own read deadline
// (exporttest.HangGuard) is far longer, and ClosedByExporter is false when that
// deadline, not the exporter's close, ends the read.
func TestSilentPeerIsClosedAtTheHandshakeTimeout(t *testing.T) {
	pr := exporttest.NewProducer(t, nil, []producer.ListenOption{producer.WithHandshakeTimeout(20 * time.Millisecond)})
	r := exporttest.DialRaw(t, pr.Path)
	require.True(t, r.ClosedByExporter(), "the exporter left a silent peer connected past its handshake timeout")
	exporttest.WaitFor(t, "the silent peer's handshake slot to come back", func() bool { return handshakes(pr) == 0 })
}

// Connections that never finish their handshake are capped per uid (and in total):
// past the cap a connection is closed at once, and the slots come back as those
// connections go, so a user cannot hold the exporter's handshakes forever.
func TestHandshakesInProgressAreCapped(t *testing.T) {
	pr := exporttest.NewProducer(t, nil, []producer.ListenOption{producer.WithHandshakeLimit(64, 3)})
	var idle []net.Conn
	for range 3 {
		nc, err := net.Dial("unix", pr.Path)
		require.NoError(t, err)
		idle = append(idle, nc)
	}
	require.Eventually(t, func() bool { return handshakes(pr) == 3 }, 5*time.Second, time.Millisecond)
	over := exporttest.DialRaw(t, pr.Path)
	over.Nc.SetDeadline(time.Now().Add(5 * time.Second))
	assert.True(t, over.ClosedByExporter(), "a fourth handshake of one uid is cut at once")
	assert.Contains(t, pr.Log.String(), "handshakes in progress")
	for _, nc := range idle {
		nc.Close()
	}
	require.Eventually(t, func() bool { return handshakes(pr) == 0 }, 5*time.Second, time.Millisecond)
	c := exporttest.NewConsumer(t, pr.Path, 0)
	require.NoError(t, c.Imp.Close(exporttest.Ctx(t)))
}

// Admitted connections are capped per process, as kv.sock's are: one past the cap is
// refused naming it, the others are served on, and a slot comes back when its
// connection goes.
func TestConnectionsPerProcessAreCapped(t *testing.T) {
	pr := exporttest.NewProducer(t, nil, []producer.ListenOption{producer.WithConnLimit(0, 2)})
	pr.Publish(t, "a", 1<<20, 1)
	a, b := admitted(t, pr.Path), admitted(t, pr.Path)
	over := exporttest.DialRaw(t, pr.Path)
	over.Send(exporttest.LeasingHello())
	m, ok := over.Recv().(*wire.RefusedMsg)
	require.True(t, ok, "a third connection of one process is refused")
	assert.Contains(t, m.Reason, "connection limit per process")
	assert.True(t, over.ClosedByExporter(), "and closed")
	_, ok = a.Open(1, "a").(*wire.LeaseMsg)
	assert.True(t, ok, "the others are served on")
	b.Send(&wire.ByeMsg{})
	require.True(t, b.ClosedByExporter(), "after Bye")
	exporttest.WaitFor(t, "b's slot to come back", func() bool { _, n := pr.Ex.ConnCount(); return n == 1 })
	admitted(t, pr.Path)
}

// A consumer that stops reading the exporter's answers is dropped once a write to it
// has waited the exporter's bound, rather than holding the write (and its
// connection's goroutine, descriptor and slot) forever. The peer here sends Opens of
// a name not published and reads nothing: once both sockets' buffers are full, the
// exporter's answer blocks, its bound (made short) passes, and it stops writing
// (the end of the stream, after the answers written before) and reads on for what the
// peer had sent. Without the bound the exporter would stop reading too, and this
// side's write would end at its own deadline (exporttest.HangGuard) instead: the test
// fails.
func TestPeerThatStopsReadingIsDropped(t *testing.T) {
	t.Cleanup(producer.SetWriteTimeout(20 * time.Millisecond)) // after the exporter's Close, registered below
	pr := exporttest.NewProducer(t, nil, nil)
	r := admitted(t, pr.Path)
	const perWrite, writes = 1000, 20 // answers far past any socket buffer
	batch := bytes.Repeat(wire.AppendFrame(nil, &wire.OpenMsg{ReqID: 1, Name: "nothing"}), perWrite)
	for range writes {
		_, err := r.Nc.Write(batch)
		require.False(t, errors.Is(err, os.ErrDeadlineExceeded), "the exporter never dropped a peer that stopped reading: this side's write waited out its own deadline (%v)", err)
		if err != nil { // the exporter gave up reading too: this side paused past its drain window
			require.True(t, isReset(err), "the exporter closed the connection: %v", err)
			break
		}
	}
	answers := 0
	for { // the answers the exporter wrote before its bound passed, then the end
		m, _, err := r.C.Recv()
		if err != nil {
			require.False(t, errors.Is(err, os.ErrDeadlineExceeded), "the exporter never ended the stream: %v", err)
			require.True(t, errors.Is(err, io.EOF) || isReset(err), "the end of the stream: %v", err)
			break
		}
		require.Equal(t, wire.MsgError, m.Kind())
		answers++
	}
	assert.Less(t, answers, perWrite*writes, "the exporter stopped answering once its write had waited its bound")
	exporttest.WaitFor(t, "the peer to be dropped", func() bool { return len(pr.Ex.Peers()) == 0 })
}

// A byte stream (TCP) is served as the socket is: a silent connection is closed at
// the handshake timeout, and admitted ones are capped, the remote peers of one host
// counting as one process.
func TestByteStreamsShareTheSocketsCaps(t *testing.T) {
	// Two exporters: a handshake timeout short enough for the test to wait for would
	// cut the Hellos of the second part on a loaded machine.
	dial := func(opts ...producer.ListenOption) *wire.Conn {
		pr := exporttest.NewProducer(t, nil, append(opts, producer.WithPolicy(export.Policy{AllowRemote: true})))
		l, err := net.Listen("tcp", "127.0.0.1:0")
		require.NoError(t, err)
		require.NoError(t, pr.Ex.Serve(l))
		return dialTCP(t, l.Addr().String())
	}
	_, _, err := dial(producer.WithHandshakeTimeout(20 * time.Millisecond)).Recv()
	require.False(t, errors.Is(err, os.ErrDeadlineExceeded), "the exporter never closed a silent connection: the test's own read deadline ended the read (%v)", err)
	require.ErrorIs(t, err, io.EOF, "a silent connection past the handshake timeout")

	first := dial(producer.WithConnLimit(0, 1))
	addr := first.Nc.RemoteAddr().String()
	hello := &wire.HelloMsg{Version: export.ProtocolVersion, Flags: wire.HelloLeases, HandleTypes: uint32(cudart.HandleTypeFabric)}
	require.NoError(t, first.Send(exporttest.Ctx(t), hello, -1))
	m, _, err := first.Recv()
	require.NoError(t, err)
	require.EqualValues(t, wire.MsgWelcome, m.Kind())
	second := dialTCP(t, addr)
	require.NoError(t, second.Send(exporttest.Ctx(t), hello, -1))
	m, _, err = second.Recv()
	require.NoError(t, err)
	r, ok := m.(*wire.RefusedMsg)
	require.True(t, ok, "a second remote peer is refused: %s", m.Kind())
	assert.Contains(t, r.Reason, "peers on byte streams")
	assert.Contains(t, r.Reason, "connection limit per process")
}

// handshakes is how many of pr's connections are in their handshake.
func handshakes(pr *exporttest.Producer) int {
	n, _ := pr.Ex.ConnCount()
	return n
}

// dialTCP connects to addr, with a deadline that only ends a test that hangs.
func dialTCP(t *testing.T, addr string) *wire.Conn {
	nc, err := net.Dial("tcp", addr)
	require.NoError(t, err)
	t.Cleanup(func() { nc.Close() })
	require.NoError(t, nc.SetDeadline(time.Now().Add(exporttest.HangGuard)))
	return wire.NewConn(nc, true)
}

// isReset says whether err is the exporter's close seen as a reset: it closed with
// bytes of ours unread.
func isReset(err error) bool {
	return errors.Is(err, syscall.ECONNRESET) || errors.Is(err, syscall.EPIPE)
}
