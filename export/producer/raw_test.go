package producer

import (
	"context"
	"errors"
	"io"
	"net"
	"os"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/cudapool/cudapool/cudart"
	"github.com/cudapool/cudapool/export/internal/wire"
)

// rawPeer speaks the protocol frame by frame, to send what a well-behaved Importer
// never would.
type rawPeer struct {
	t  testing.TB
	nc *net.UnixConn
	c  *wire.Conn
}

func dialRaw(t testing.TB, path string) *rawPeer {
	t.Helper()
	nc, err := net.DialUnix("unix", nil, &net.UnixAddr{Name: path, Net: "unix"})
	require.NoError(t, err)
	t.Cleanup(func() { nc.Close() })
	nc.SetDeadline(time.Now().Add(hangGuard)) // a frame that never comes fails the test
	return &rawPeer{t: t, nc: nc, c: wire.NewConn(nc, true)}
}

// leasingHello is the Hello of a peer that takes leases of POSIX fd pools and offers
// no release event (so the exporter ends its leases without waiting).
func leasingHello() *wire.HelloMsg {
	return &wire.HelloMsg{Version: wire.ProtocolVersion, PID: uint32(os.Getpid()), Flags: wire.HelloLeases, HandleTypes: uint32(cudart.HandleTypePosixFD)}
}

// admitted dials path and completes a handshake as a leasing peer.
func admitted(t testing.TB, path string) *rawPeer {
	t.Helper()
	r := dialRaw(t, path)
	r.send(leasingHello())
	m := r.recv()
	require.EqualValues(t, wire.MsgWelcome, m.Kind(), "handshake answered with %s", m.Kind())
	return r
}

func (r *rawPeer) send(m wire.Message) {
	r.t.Helper()
	require.NoError(r.t, r.c.Send(context.Background(), m, -1))
}

func (r *rawPeer) sendBytes(b []byte) {
	r.t.Helper()
	_, err := r.nc.Write(b)
	require.NoError(r.t, err)
}

// recv returns the next frame, closing any descriptor that came with it.
func (r *rawPeer) recv() wire.Message {
	r.t.Helper()
	m, fd, err := r.c.Recv()
	require.NoError(r.t, err, "recv")
	if fd >= 0 {
		wire.CloseFDs([]int{fd})
	}
	return m
}

// open asks for name and returns the Lease (skipping the PoolHandle before it) or
// the Error.
func (r *rawPeer) open(reqID uint64, name string) wire.Message {
	r.t.Helper()
	r.send(&wire.OpenMsg{ReqID: reqID, Name: name})
	for {
		if m := r.recv(); m.Kind() != wire.MsgPoolHandle {
			return m
		}
	}
}

// release asks to release lease id and returns the reply.
func (r *rawPeer) release(reqID, id uint64, count uint32) wire.Message {
	r.t.Helper()
	r.send(&wire.ReleaseMsg{ReqID: reqID, LeaseID: id, Count: count})
	return r.recv()
}

// closedByExporter reports whether the exporter closed the connection: the next read
// ends without a frame.
func (r *rawPeer) closedByExporter() bool {
	r.t.Helper()
	for {
		m, fd, err := r.c.Recv()
		if fd >= 0 {
			wire.CloseFDs([]int{fd})
		}
		if err != nil {
			return errors.Is(err, io.EOF) || errors.Is(err, ErrProtocol) || strings.Contains(err.Error(), "reset")
		}
		if m.Kind() == wire.MsgRefused || m.Kind() == wire.MsgError {
			continue
		}
	}
}

// wantError checks that m is an Error frame for reqID standing for target.
func wantError(t testing.TB, m wire.Message, reqID uint64, target error) {
	t.Helper()
	e, ok := m.(*wire.ErrorMsg)
	require.True(t, ok, "got %s, want an Error wrapping %v", m.Kind(), target)
	require.EqualValues(t, reqID, e.ReqID, "got Error(req %d, %v: %q), want req %d and %v", e.ReqID, wire.CodeErrs[e.Code], e.Text, reqID, target)
	require.ErrorIs(t, wire.ReplyErr(e), target, "got Error(req %d, %v: %q), want req %d and %v", e.ReqID, wire.CodeErrs[e.Code], e.Text, reqID, target)
}

// The cases of ErrStaleLease, as its message names them.
const (
	staleReleased = "was released already"
	staleForeign  = "is another connection's"
	staleForged   = "was never issued"
)

// wantStale checks that m is an Error frame for reqID standing for ErrStaleLease, its
// text naming the case (staleReleased, staleForeign or staleForged).
func wantStale(t testing.TB, m wire.Message, reqID uint64, why string) {
	t.Helper()
	wantError(t, m, reqID, ErrStaleLease)
	require.Contains(t, m.(*wire.ErrorMsg).Text, why, "the stale lease's message names the case")
}
