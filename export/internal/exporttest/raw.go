package exporttest

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
	"github.com/cudapool/cudapool/export"
	"github.com/cudapool/cudapool/export/internal/wire"
)

// RawPeer speaks the protocol frame by frame, to send what a well-behaved Importer
// never would.
type RawPeer struct {
	T  testing.TB
	Nc *net.UnixConn
	C  *wire.Conn
}

func DialRaw(t testing.TB, path string) *RawPeer {
	t.Helper()
	nc, err := net.DialUnix("unix", nil, &net.UnixAddr{Name: path, Net: "unix"})
	require.NoError(t, err)
	t.Cleanup(func() { _ = nc.Close() })          // cleanup: what is tested is above
	_ = nc.SetDeadline(time.Now().Add(HangGuard)) // a frame that never comes fails the test
	return &RawPeer{T: t, Nc: nc, C: wire.NewConn(nc, true)}
}

// LeasingHello is the Hello of a peer that takes leases of POSIX fd pools and offers
// no release event (so the exporter ends its leases without waiting).
func LeasingHello() *wire.HelloMsg {
	return &wire.HelloMsg{Version: export.ProtocolVersion, PID: uint32(os.Getpid()), Flags: wire.HelloLeases, HandleTypes: uint32(cudart.HandleTypePosixFD)}
}

func (r *RawPeer) Send(m wire.Message) {
	r.T.Helper()
	require.NoError(r.T, r.C.Send(context.Background(), m, -1))
}

func (r *RawPeer) SendBytes(b []byte) {
	r.T.Helper()
	_, err := r.Nc.Write(b)
	require.NoError(r.T, err)
}

// Recv returns the next frame, closing any descriptor that came with it.
func (r *RawPeer) Recv() wire.Message {
	r.T.Helper()
	m, fd, err := r.C.Recv()
	require.NoError(r.T, err, "recv")
	if fd >= 0 {
		wire.CloseFDs([]int{fd})
	}
	return m
}

// Open asks for name and returns the Lease (skipping the PoolHandle before it) or
// the Error.
func (r *RawPeer) Open(reqID uint64, name string) wire.Message {
	r.T.Helper()
	r.Send(&wire.OpenMsg{ReqID: reqID, Name: name})
	for {
		if m := r.Recv(); m.Kind() != wire.MsgPoolHandle {
			return m
		}
	}
}

// Release asks to release lease id and returns the reply.
func (r *RawPeer) Release(reqID, id uint64, count uint32) wire.Message {
	r.T.Helper()
	r.Send(&wire.ReleaseMsg{ReqID: reqID, LeaseID: id, Count: count})
	return r.Recv()
}

// ClosedByExporter reports whether the exporter closed the connection: the next read
// ends without a frame.
func (r *RawPeer) ClosedByExporter() bool {
	r.T.Helper()
	for {
		m, fd, err := r.C.Recv()
		if fd >= 0 {
			wire.CloseFDs([]int{fd})
		}
		if err != nil {
			return errors.Is(err, io.EOF) || errors.Is(err, export.ErrProtocol) || strings.Contains(err.Error(), "reset")
		}
		if m.Kind() == wire.MsgRefused || m.Kind() == wire.MsgError {
			continue
		}
	}
}
