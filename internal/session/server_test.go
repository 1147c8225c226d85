package session

import (
	"errors"
	"io"
	"net"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/cudapool/cudapool/internal/testlog"
	"github.com/cudapool/cudapool/internal/testwait"
)

// serveEcho serves l: each connection sends one byte, 'a' to be admitted (answered
// 'y', or the Admit error's text), 'p' to panic; then it echoes until EOF.
func serveEcho(t *testing.T, lim Limits) (*Server, string, *testlog.Buffer) {
	l, path := listen(t)
	var logs testlog.Buffer
	s := Serve(l, logs.Logger(), "test", lim, func(c *Conn) {
		var b [1]byte
		if _, err := io.ReadFull(c, b[:]); err != nil {
			return
		}
		switch b[0] {
		case 'p':
			panic("a handler made to panic")
		case 'a':
			if err := c.Admit(); err != nil {
				_, _ = c.Write([]byte(err.Error()))
				return
			}
			_, _ = c.Write([]byte{'y'})
		}
		_, _ = io.Copy(c, c)
	})
	t.Cleanup(s.Close)
	return s, path, &logs
}

func dialT(t *testing.T, path string) net.Conn {
	nc, err := net.Dial("unix", path)
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

	_, path, _ = serveEcho(t, Limits{HandshakeTimeout: 10 * time.Millisecond})
	_, err := dialT(t, path).Read(make([]byte, 1))
	assert.Error(t, err, "a silent connection past the handshake timeout")
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
