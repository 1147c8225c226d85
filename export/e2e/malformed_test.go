package e2e_test

import (
	"context"
	"fmt"
	"os"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/cudapool/cudapool/cudart"
	"github.com/cudapool/cudapool/export"
	"github.com/cudapool/cudapool/export/consumer"
	"github.com/cudapool/cudapool/export/internal/exporttest"
	"github.com/cudapool/cudapool/export/internal/wire"
	"github.com/cudapool/cudapool/internal/testwait"
	"github.com/cudapool/cudapool/internal/unixfd"
)

// Every malformed input closes the connection it came on, with the reason logged,
// and leaves the other peers served.
func TestMalformedInputClosesOnlyThatPeer(t *testing.T) {
	cases := []struct {
		name string
		// handshake: admit the raw peer first.
		handshake bool
		do        func(t *testing.T, r *exporttest.RawPeer)
		logged    string
	}{
		{"garbage before hello", false, func(t *testing.T, r *exporttest.RawPeer) { r.SendBytes([]byte("GET / HTTP/1.1\r\n\r\n")) }, "oversized frame"},
		{"first message not hello", false, func(t *testing.T, r *exporttest.RawPeer) { r.Send(&wire.OpenMsg{ReqID: 1, Name: "a"}) }, "first message must be Hello"},
		{"truncated hello", false, func(t *testing.T, r *exporttest.RawPeer) {
			r.SendBytes(wire.AppendFrame(nil, exporttest.LeasingHello())[:20])
			r.Nc.CloseWrite()
		}, "truncated"},
		{"unknown type", true, func(t *testing.T, r *exporttest.RawPeer) { r.SendBytes(exporttest.Frame(0, 0x42, nil)) }, "unknown message type 66"},
		{"wrong length", true, func(t *testing.T, r *exporttest.RawPeer) {
			r.SendBytes(exporttest.Frame(3, wire.MsgRelease, []byte{1, 2, 3}))
		}, "Release payload is 3 bytes, want 24"},
		{"oversized", true, func(t *testing.T, r *exporttest.RawPeer) { r.SendBytes(exporttest.Frame(1<<30, wire.MsgOpen, nil)) }, "oversized frame"},
		{"truncated frame", true, func(t *testing.T, r *exporttest.RawPeer) {
			r.SendBytes(wire.AppendFrame(nil, &wire.OpenMsg{ReqID: 1, Name: "abc"})[:9])
			r.Nc.CloseWrite()
		}, "truncated Open frame"},
		{"garbage after hello", true, func(t *testing.T, r *exporttest.RawPeer) { r.SendBytes([]byte{0xff, 0xff, 0xff, 0x7f, 0xee, 1, 2}) }, "oversized frame"},
		{"bad name", true, func(t *testing.T, r *exporttest.RawPeer) {
			r.SendBytes(exporttest.Frame(10, wire.MsgOpen, append(make([]byte, 8), 'x', 0x07)))
		}, "control character"},
		{"unknown flags", true, func(t *testing.T, r *exporttest.RawPeer) {
			r.Send(&wire.ReleaseMsg{ReqID: 1, LeaseID: 2, Count: 1, Flags: 1 << 9})
		}, "Release has unknown flags"},
		{"exporter's message", true, func(t *testing.T, r *exporttest.RawPeer) { r.Send(&wire.WelcomeMsg{Version: export.ProtocolVersion}) }, "unexpected Welcome from an importer"},
		{"descriptor attached", true, func(t *testing.T, r *exporttest.RawPeer) {
			pr, pw, err := os.Pipe()
			require.NoError(t, err)
			defer pr.Close()
			defer pw.Close()
			require.NoError(t, unixfd.Send(r.Nc, wire.AppendFrame(nil, &wire.OpenMsg{ReqID: 1, Name: "a"}), int(pw.Fd())))
		}, "unexpected file descriptors"},
	}
	pr := exporttest.NewProducer(t, nil, nil)
	pr.Publish(t, "a", 1<<20, 9)
	good := exporttest.NewConsumer(t, pr.Path, 0)
	ctx := exporttest.Ctx(t)
	held, err := good.Imp.Open(ctx, "a", good.Stream)
	require.NoError(t, err)
	baseline := exporttest.OpenFDs(t)
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			r := exporttest.DialRaw(t, pr.Path)
			if c.handshake {
				r.Send(exporttest.LeasingHello())
				m := r.Recv()
				require.EqualValues(t, wire.MsgWelcome, m.Kind(), "handshake answered %s", m.Kind())
			}
			c.do(t, r)
			require.True(t, r.ClosedByExporter(), "the exporter kept the connection")
			r.Nc.Close()
			exporttest.WaitFor(t, "the peer to be forgotten", func() bool { return len(pr.Ex.Peers()) == 1 })
			log := pr.Log.String()
			require.Contains(t, log, c.logged, "log does not say %q:\n%s", c.logged, log)
			// The well-behaved consumer is still served.
			m, err := good.Imp.Open(ctx, "a", good.Stream)
			require.NoError(t, err, "other peer's open failed: %v", err)
			require.NoError(t, m.Release(ctx, good.Stream))
		})
	}
	got := exporttest.OpenFDs(t)
	require.EqualValues(t, baseline, got, "%d descriptors open after the malformed peers, %d before", got, baseline)
	require.True(t, exporttest.AllAre(good.Read(t, held), 9), "the held mapping changed")
	require.NoError(t, held.Release(ctx, good.Stream))
	pr.CheckClean(t)
}

func TestVersionMismatchNamesBothVersions(t *testing.T) {
	pr := exporttest.NewProducer(t, nil, nil)
	// A newer peer, and old ones (version 1: whole buffers, no metadata; version 2: no
	// VMM allocations).
	for _, v := range []uint32{7, 1, 2} {
		r := exporttest.DialRaw(t, pr.Path)
		h := wire.AppendFrame(nil, exporttest.LeasingHello())
		wire.Le.PutUint32(h[wire.HeaderLen:], v)
		r.SendBytes(h)
		ref, ok := r.Recv().(*wire.RefusedMsg)
		require.True(t, ok, "a version-%d Hello was not refused", v)
		want := fmt.Sprintf("version %d, this side speaks %d", v, export.ProtocolVersion)
		require.EqualValues(t, export.ProtocolVersion, ref.Version, "Refused(%d, %q), want it to say %q", ref.Version, ref.Reason, want)
		require.Contains(t, ref.Reason, want)
	}

	// And the importer's side: an exporter that speaks version 9.
	fake := fakeExporter(t, func(c *wire.Conn) {
		c.Recv()
		c.Send(context.Background(), &wire.RefusedMsg{Version: 9, Reason: fmt.Sprintf("peer speaks protocol version %d, this side speaks 9", export.ProtocolVersion)}, -1)
	})
	s := exporttest.NewSide(t, 0)
	_, err := consumer.Dial(exporttest.Ctx(t), fake, s.Dev, 0)
	require.ErrorIs(t, err, export.ErrVersionMismatch, "Dial = %v, want export.ErrVersionMismatch naming 9 and %d", err, export.ProtocolVersion)
	require.Contains(t, err.Error(), "version 9", "Dial = %v, want export.ErrVersionMismatch naming 9 and %d", err, export.ProtocolVersion)
	require.Contains(t, err.Error(), fmt.Sprintf("speaks %d", export.ProtocolVersion), "Dial = %v, want export.ErrVersionMismatch naming 9 and %d", err, export.ProtocolVersion)
}

// fakeExporter listens on a fresh socket and runs serve on the first connection.
func fakeExporter(t testing.TB, serve func(c *wire.Conn)) string {
	path, _ := exporttest.FakeExporterDone(t, serve)
	return path
}

// An exporter that answers Hello with a pool handle (descriptor and all) instead of
// Welcome is refused, and the descriptor does not stay open here.
func TestHandleBeforeWelcomeIsRefused(t *testing.T) {
	s := exporttest.NewSide(t, 0)
	exporttest.WarmEventArena(t, s)
	path, hungUp := exporttest.FakeExporterDone(t, func(c *wire.Conn) {
		c.Recv()
		pr, pw, _ := os.Pipe()
		defer pr.Close()
		defer pw.Close()
		unixfd.Send(c.Uc, wire.AppendFrame(nil, &wire.PoolHandleMsg{PoolID: 1, HandleType: cudart.HandleTypePosixFD}), int(pw.Fd()))
		c.Recv()
	})
	before := exporttest.OpenFDs(t)
	_, err := consumer.Dial(exporttest.Ctx(t), path, s.Dev, 0, consumer.WithLogger(exporttest.DiscardLogger))
	require.ErrorIs(t, err, export.ErrProtocol, "Dial = %v, want export.ErrProtocol", err)
	require.ErrorContains(t, err, "answered Hello with PoolHandle", "Dial = %v, want export.ErrProtocol", err)
	testwait.Recv(t, hungUp, "the fake exporter to see the hang-up")
	after := exporttest.OpenFDs(t)
	require.LessOrEqual(t, after, before, "%d descriptors open, %d before", after, before)
	s.CheckClean(t)
}
