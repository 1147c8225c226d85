package producer

import (
	"context"
	"fmt"
	"net"
	"os"
	"path/filepath"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/cudapool/cudapool/cudart"
	"github.com/cudapool/cudapool/export/consumer"
	"github.com/cudapool/cudapool/export/internal/inspect"
	"github.com/cudapool/cudapool/export/internal/wire"
	"github.com/cudapool/cudapool/internal/testwait"
	"github.com/cudapool/cudapool/internal/unixfd"
)

// openFDs counts this process's open descriptors.
func openFDs(t testing.TB) int {
	t.Helper()
	ents, err := os.ReadDir("/proc/self/fd")
	if err != nil {
		t.Skipf("cannot count descriptors: %v", err)
	}
	return len(ents)
}

// Every malformed input closes the connection it came on, with the reason logged,
// and leaves the other peers served.
func TestMalformedInputClosesOnlyThatPeer(t *testing.T) {
	cases := []struct {
		name string
		// handshake: admit the raw peer first.
		handshake bool
		do        func(t *testing.T, r *rawPeer)
		logged    string
	}{
		{"garbage before hello", false, func(t *testing.T, r *rawPeer) { r.sendBytes([]byte("GET / HTTP/1.1\r\n\r\n")) }, "oversized frame"},
		{"first message not hello", false, func(t *testing.T, r *rawPeer) { r.send(&wire.OpenMsg{ReqID: 1, Name: "a"}) }, "first message must be Hello"},
		{"truncated hello", false, func(t *testing.T, r *rawPeer) {
			r.sendBytes(wire.AppendFrame(nil, leasingHello())[:20])
			r.nc.CloseWrite()
		}, "truncated"},
		{"unknown type", true, func(t *testing.T, r *rawPeer) { r.sendBytes(frame(0, 0x42, nil)) }, "unknown message type 66"},
		{"wrong length", true, func(t *testing.T, r *rawPeer) { r.sendBytes(frame(3, wire.MsgRelease, []byte{1, 2, 3})) }, "Release payload is 3 bytes, want 24"},
		{"oversized", true, func(t *testing.T, r *rawPeer) { r.sendBytes(frame(1<<30, wire.MsgOpen, nil)) }, "oversized frame"},
		{"truncated frame", true, func(t *testing.T, r *rawPeer) {
			r.sendBytes(wire.AppendFrame(nil, &wire.OpenMsg{ReqID: 1, Name: "abc"})[:9])
			r.nc.CloseWrite()
		}, "truncated Open frame"},
		{"garbage after hello", true, func(t *testing.T, r *rawPeer) { r.sendBytes([]byte{0xff, 0xff, 0xff, 0x7f, 0xee, 1, 2}) }, "oversized frame"},
		{"bad name", true, func(t *testing.T, r *rawPeer) {
			r.sendBytes(frame(10, wire.MsgOpen, append(make([]byte, 8), 'x', 0x07)))
		}, "control character"},
		{"unknown flags", true, func(t *testing.T, r *rawPeer) {
			r.send(&wire.ReleaseMsg{ReqID: 1, LeaseID: 2, Count: 1, Flags: 1 << 9})
		}, "Release has unknown flags"},
		{"exporter's message", true, func(t *testing.T, r *rawPeer) { r.send(&wire.WelcomeMsg{Version: wire.ProtocolVersion}) }, "unexpected Welcome from an importer"},
		{"descriptor attached", true, func(t *testing.T, r *rawPeer) {
			pr, pw, err := os.Pipe()
			require.NoError(t, err)
			defer pr.Close()
			defer pw.Close()
			require.NoError(t, unixfd.Send(r.nc, wire.AppendFrame(nil, &wire.OpenMsg{ReqID: 1, Name: "a"}), int(pw.Fd())))
		}, "unexpected file descriptors"},
	}
	pr := newProducer(t, nil, nil)
	pr.publish(t, "a", 1<<20, 9)
	good := newConsumer(t, pr.path, 0)
	ctx := testCtx(t)
	held, err := good.imp.Open(ctx, "a", good.stream)
	require.NoError(t, err)
	baseline := openFDs(t)
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			r := dialRaw(t, pr.path)
			if c.handshake {
				r.send(leasingHello())
				m := r.recv()
				require.EqualValues(t, wire.MsgWelcome, m.Kind(), "handshake answered %s", m.Kind())
			}
			c.do(t, r)
			require.True(t, r.closedByExporter(), "the exporter kept the connection")
			r.nc.Close()
			waitFor(t, "the peer to be forgotten", func() bool { return len(pr.ex.Peers()) == 1 })
			log := pr.log.String()
			require.Contains(t, log, c.logged, "log does not say %q:\n%s", c.logged, log)
			// The well-behaved consumer is still served.
			m, err := good.imp.Open(ctx, "a", good.stream)
			require.NoError(t, err, "other peer's open failed: %v", err)
			require.NoError(t, m.Release(ctx, good.stream))
		})
	}
	got := openFDs(t)
	require.EqualValues(t, baseline, got, "%d descriptors open after the malformed peers, %d before", got, baseline)
	require.True(t, allAre(good.read(t, held), 9), "the held mapping changed")
	require.NoError(t, held.Release(ctx, good.stream))
	pr.checkClean(t)
}

func TestVersionMismatchNamesBothVersions(t *testing.T) {
	pr := newProducer(t, nil, nil)
	// A newer peer, and an old one (version 1: whole buffers, no metadata).
	for _, v := range []uint32{7, 1} {
		r := dialRaw(t, pr.path)
		h := wire.AppendFrame(nil, leasingHello())
		wire.Le.PutUint32(h[wire.HeaderLen:], v)
		r.sendBytes(h)
		ref, ok := r.recv().(*wire.RefusedMsg)
		require.True(t, ok, "a version-%d Hello was not refused", v)
		want := fmt.Sprintf("version %d, this side speaks %d", v, wire.ProtocolVersion)
		require.EqualValues(t, wire.ProtocolVersion, ref.Version, "Refused(%d, %q), want it to say %q", ref.Version, ref.Reason, want)
		require.Contains(t, ref.Reason, want)
	}

	// And the importer's side: an exporter that speaks version 9.
	fake := fakeExporter(t, func(c *wire.Conn) {
		c.Recv()
		c.Send(context.Background(), &wire.RefusedMsg{Version: 9, Reason: fmt.Sprintf("peer speaks protocol version %d, this side speaks 9", wire.ProtocolVersion)}, -1)
	})
	s := newSide(t, 0)
	_, err := consumer.Dial(testCtx(t), fake, s.dev, 0)
	require.ErrorIs(t, err, ErrVersionMismatch, "Dial = %v, want ErrVersionMismatch naming 9 and %d", err, wire.ProtocolVersion)
	require.Contains(t, err.Error(), "version 9", "Dial = %v, want ErrVersionMismatch naming 9 and %d", err, wire.ProtocolVersion)
	require.Contains(t, err.Error(), fmt.Sprintf("speaks %d", wire.ProtocolVersion), "Dial = %v, want ErrVersionMismatch naming 9 and %d", err, wire.ProtocolVersion)
}

// fakeExporter listens on a fresh socket and runs serve on the first connection.
func fakeExporter(t testing.TB, serve func(c *wire.Conn)) string {
	path, _ := fakeExporterDone(t, serve)
	return path
}

// fakeExporterDone is fakeExporter, and a channel closed once it has hung up.
func fakeExporterDone(t testing.TB, serve func(c *wire.Conn)) (string, <-chan struct{}) {
	t.Helper()
	path := filepath.Join(shortDir(t), "f.sock")
	l, err := net.Listen("unix", path)
	require.NoError(t, err)
	done := make(chan struct{})
	go func() {
		defer close(done)
		nc, err := l.Accept()
		if err != nil {
			return
		}
		defer nc.Close()
		serve(wire.NewConn(nc, false))
	}()
	t.Cleanup(func() { l.Close(); <-done })
	return path, done
}

// welcomeThen is a fake exporter that admits the importer and then runs next.
func welcomeThen(next func(c *wire.Conn)) func(c *wire.Conn) {
	return func(c *wire.Conn) {
		if _, _, err := c.Recv(); err != nil {
			return
		}
		c.Send(context.Background(), &wire.WelcomeMsg{Version: wire.ProtocolVersion, PID: 1}, -1)
		next(c)
	}
}

// An exporter that breaks the protocol loses its importer: the reason is logged,
// opens fail with ErrExporterGone, and Close completes.
func TestMalformedExporterInput(t *testing.T) {
	cases := []struct {
		name   string
		send   func(c *wire.Conn)
		logged string
	}{
		{"pool handle without descriptor", func(c *wire.Conn) {
			c.Send(context.Background(), &wire.PoolHandleMsg{PoolID: 1, HandleType: cudart.HandleTypePosixFD}, -1)
		}, "arrived with 0 descriptors, want 1"},
		{"descriptor on another frame", func(c *wire.Conn) {
			pr, pw, _ := os.Pipe()
			defer pr.Close()
			defer pw.Close()
			unixfd.Send(c.Uc, wire.AppendFrame(nil, &wire.ByeMsg{}), int(pw.Fd()))
		}, "Bye arrived with 1 unexpected descriptors"},
		{"two descriptors", func(c *wire.Conn) {
			pr, pw, _ := os.Pipe()
			defer pr.Close()
			defer pw.Close()
			unixfd.Send(c.Uc, wire.AppendFrame(nil, &wire.PoolHandleMsg{PoolID: 1, HandleType: cudart.HandleTypePosixFD}), int(pr.Fd()), int(pw.Fd()))
		}, "unexpected file descriptors"},
		{"unknown type", func(c *wire.Conn) { c.Nc.Write(frame(0, 99, nil)) }, "unknown message type 99"},
		{"garbage", func(c *wire.Conn) { c.Nc.Write([]byte("\x05\x00\x00\x00\x06garbage")) }, "Lease payload is 5 bytes"},
		{"importer's message", func(c *wire.Conn) { c.Send(context.Background(), &wire.OpenMsg{ReqID: 1, Name: "x"}, -1) }, "unexpected Open from an exporter"},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			sent := make(chan struct{})
			path, hungUp := fakeExporterDone(t, welcomeThen(func(c *wire.Conn) {
				tc.send(c)
				close(sent)
				c.Recv() // until the importer hangs up
			}))
			s := newSide(t, 0)
			warmEventArena(t, s)
			lb := &logBuffer{}
			before := openFDs(t)
			imp, err := consumer.Dial(testCtx(t), path, s.dev, 0, consumer.WithLogger(lb.logger()))
			require.NoError(t, err)
			testwait.Recv(t, sent, "the malformed frame to go out")
			testwait.Recv(t, inspect.Client(imp).ReaderDone, "the importer to drop the connection")
			_, err = imp.Open(testCtx(t), "x", s.stream)
			require.ErrorIs(t, err, wire.ErrExporterGone, "Open = %v, want ErrExporterGone with the violation", err)
			require.ErrorIs(t, err, ErrProtocol, "Open = %v, want ErrExporterGone with the violation", err)
			require.Contains(t, lb.String(), tc.logged, "log does not say %q:\n%s", tc.logged, lb.String())
			require.NoError(t, imp.Close(testCtx(t)), "Close =")
			testwait.Recv(t, hungUp, "the fake exporter to see the hang-up")
			after := openFDs(t)
			require.LessOrEqual(t, after, before, "%d descriptors open, %d before", after, before)
			s.checkClean(t)
		})
	}
}

// warmEventArena makes the software device create the memfd behind its IPC events,
// which it keeps until it closes, so that counting descriptors sees only what export
// holds.
func warmEventArena(t testing.TB, s *side) {
	t.Helper()
	ev, err := s.dev.EventCreate(s.ord, cudart.EventIPC)
	require.NoError(t, err)
	require.NoError(t, s.dev.EventDestroy(s.ord, ev))
}

// An exporter that answers Hello with a pool handle (descriptor and all) instead of
// Welcome is refused, and the descriptor does not stay open here.
func TestHandleBeforeWelcomeIsRefused(t *testing.T) {
	s := newSide(t, 0)
	warmEventArena(t, s)
	path, hungUp := fakeExporterDone(t, func(c *wire.Conn) {
		c.Recv()
		pr, pw, _ := os.Pipe()
		defer pr.Close()
		defer pw.Close()
		unixfd.Send(c.Uc, wire.AppendFrame(nil, &wire.PoolHandleMsg{PoolID: 1, HandleType: cudart.HandleTypePosixFD}), int(pw.Fd()))
		c.Recv()
	})
	before := openFDs(t)
	_, err := consumer.Dial(testCtx(t), path, s.dev, 0, consumer.WithLogger(discardLogger))
	require.ErrorIs(t, err, ErrProtocol, "Dial = %v, want ErrProtocol", err)
	require.ErrorContains(t, err, "answered Hello with PoolHandle", "Dial = %v, want ErrProtocol", err)
	testwait.Recv(t, hungUp, "the fake exporter to see the hang-up")
	after := openFDs(t)
	require.LessOrEqual(t, after, before, "%d descriptors open, %d before", after, before)
	s.checkClean(t)
}
