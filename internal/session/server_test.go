package session

import (
	"errors"
	"io"
	"net"
	"os"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/cudapool/cudapool/internal/testlog"
	"github.com/cudapool/cudapool/internal/testwait"
)

// serveEcho serves l: each connection sends one byte, 'a' to be admitted (answered
// 'y', or the Admit error's text), 'd' to be admitted and detached, 'p' to panic;
// then it echoes until EOF.
func serveEcho(t *testing.T, lim Limits) (*Server, string, *testlog.Buffer) {
	return serveEchoOn(t, "unix", lim)
}

// serveEchoOn is serveEcho on a listener of network, "unix" or "tcp" (on the
// loopback); it returns the listener's address.
func serveEchoOn(t *testing.T, network string, lim Limits) (*Server, string, *testlog.Buffer) {
	var l net.Listener
	var addr string
	if network == "unix" {
		l, addr = listen(t)
	} else {
		tl, err := net.Listen("tcp", "127.0.0.1:0")
		require.NoError(t, err)
		t.Cleanup(func() { tl.Close() })
		l, addr = tl, tl.Addr().String()
	}
	var logs testlog.Buffer
	s := Serve(l, logs.Logger(), "test", lim, func(c *Conn) {
		var b [1]byte
		if _, err := io.ReadFull(c, b[:]); err != nil {
			return
		}
		switch b[0] {
		case 'p':
			panic("a handler made to panic")
		case 'a', 'd':
			if err := c.Admit(); err != nil {
				_, _ = c.Write([]byte(err.Error()))
				return
			}
			if b[0] == 'd' {
				c.Detach()
			}
			_, _ = c.Write([]byte{'y'})
		}
		_, _ = io.Copy(c, c)
	})
	t.Cleanup(s.Close)
	return s, addr, &logs
}

func dialT(t *testing.T, path string) net.Conn { return dialOn(t, "unix", path) }

func dialOn(t *testing.T, network, addr string) net.Conn {
	nc, err := net.Dial(network, addr)
	require.NoError(t, err)
	t.Cleanup(func() { nc.Close() })
	require.NoError(t, nc.SetDeadline(time.Now().Add(testwait.Bound)))
	return nc
}

func say(t *testing.T, nc net.Conn, b byte) string {
	_, err := nc.Write([]byte{b})
	require.NoError(t, err)
	buf := make([]byte, 256)
	n, err := nc.Read(buf)
	if err != nil {
		return err.Error()
	}
	return string(buf[:n])
}

// Admitted connections are capped per process: past the cap Admit names it.
func TestServerCapsConnectionsPerProcess(t *testing.T) {
	_, path, _ := serveEcho(t, Limits{ConnsPerProcess: 2})
	a, b := dialT(t, path), dialT(t, path)
	require.Equal(t, "y", say(t, a, 'a'))
	require.Equal(t, "y", say(t, b, 'a'))
	got := say(t, dialT(t, path), 'a')
	assert.Contains(t, got, "connection limit per process")
	assert.Contains(t, got, ErrLimit.Error())
	require.NoError(t, b.Close())
	require.Eventually(t, func() bool { return say(t, dialT(t, path), 'a') == "y" }, testwait.Bound, 5*time.Millisecond, "b's slot to be free")
}

// Connections in their handshake are capped per uid: one past the cap is closed at
// once; the handshake timeout closes a silent one.
func TestServerCapsHandshakes(t *testing.T) {
	_, path, logs := serveEcho(t, Limits{HandshakesPerUID: 1, HandshakeTimeout: time.Hour})
	first := dialT(t, path)
	require.Eventually(t, func() bool {
		over := dialT(t, path)
		_, err := over.Read(make([]byte, 1))
		return errors.Is(err, io.EOF)
	}, testwait.Bound, 5*time.Millisecond, "a second handshake to be closed")
	assert.Contains(t, logs.String(), "too many handshakes")
	require.Equal(t, "y", say(t, first, 'a'), "the first, within the cap")

}

// A connection that says nothing is closed by the server once the handshake timeout
// has passed, on a Unix socket and on TCP alike, and its handshake slot comes back.
// The test's own read deadline (testwait.Bound) is far longer: closedByServer fails
// when that deadline, not the server's close, ends the read.
func TestServerClosesASilentConnection(t *testing.T) {
	for _, network := range []string{"unix", "tcp"} {
		t.Run(network, func(t *testing.T) {
			s, addr, _ := serveEchoOn(t, network, Limits{HandshakeTimeout: 10 * time.Millisecond})
			closedByServer(t, dialOn(t, network, addr), "a silent connection past the handshake timeout")
			require.Eventually(t, func() bool { n, _ := s.Count(); return n == 0 }, testwait.Bound, time.Millisecond, "its handshake slot to come back")
		})
	}
}

// closedByServer expects the server to close nc without a byte more: the read ends at
// the end of the stream, not at nc's own deadline.
func closedByServer(t *testing.T, nc net.Conn, what string) {
	t.Helper()
	n, err := nc.Read(make([]byte, 1))
	require.False(t, errors.Is(err, os.ErrDeadlineExceeded), "%s: the server never closed the connection: the test's own read deadline ended the read (%v)", what, err)
	require.ErrorIs(t, err, io.EOF, "%s: %d bytes came instead", what, n)
}

// A handler's panic closes its connection, is logged with its stack, and the server
// serves on; Close waits for the handlers.
func TestServerContainsAPanic(t *testing.T) {
	s, path, logs := serveEcho(t, Limits{})
	bad := dialT(t, path)
	_, err := bad.Write([]byte{'p'})
	require.NoError(t, err)
	_, err = bad.Read(make([]byte, 1))
	require.Error(t, err, "the panicked connection is closed")
	assert.Equal(t, "y", say(t, dialT(t, path), 'a'), "the server serves on")
	assert.Contains(t, logs.String(), "panic serving a connection")
	assert.Contains(t, logs.String(), "server_test.go", "with its stack")
	idle := dialT(t, path)
	require.Equal(t, "y", say(t, idle, 'a'))
	s.Close()
	_, err = idle.Read(make([]byte, 1))
	assert.Error(t, err, "Close closed the admitted connection")
}

// Peers on a byte stream are served, and those of one host count as one process in
// the connection caps: nothing names them but what they say.
func TestServerCapsRemotePeersPerHost(t *testing.T) {
	_, addr, _ := serveEchoOn(t, "tcp", Limits{ConnsPerProcess: 1})
	a := dialOn(t, "tcp", addr)
	require.Equal(t, "y", say(t, a, 'a'))
	got := say(t, dialOn(t, "tcp", addr), 'a')
	assert.Contains(t, got, "peers on byte streams from 127.0.0.1")
	assert.Contains(t, got, ErrLimit.Error())
}

// Shutdown closes the listeners and the connections in their handshake, and serves
// the admitted ones on; Close closes those too, but for a detached one, which is
// served on after it.
func TestServerShutdownLeavesAdmittedConnections(t *testing.T) {
	s, path, _ := serveEcho(t, Limits{HandshakeTimeout: time.Hour})
	admitted, detached, silent := dialT(t, path), dialT(t, path), dialT(t, path)
	require.Equal(t, "y", say(t, admitted, 'a'))
	require.Equal(t, "y", say(t, detached, 'd'))
	require.Eventually(t, func() bool { n, _ := s.Count(); return n == 1 }, testwait.Bound, time.Millisecond, "the silent connection to be served")
	s.Shutdown()
	closedByServer(t, silent, "a connection in its handshake at Shutdown")
	assert.Equal(t, "x", say(t, admitted, 'x'), "an admitted connection is served on")
	_, err := net.Dial("unix", path)
	assert.Error(t, err, "the listener is closed")
	l, _ := listen(t)
	assert.ErrorIs(t, s.Serve(l), ErrClosed)
	s.Close()
	closedByServer(t, admitted, "an admitted connection at Close")
	assert.Equal(t, "z", say(t, detached, 'z'), "a detached connection is served on after Close")
}
