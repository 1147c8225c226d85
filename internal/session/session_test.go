package session

import (
	"context"
	"errors"
	"log/slog"
	"net"
	"os"
	"path/filepath"
	"syscall"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/cudapool/cudapool/internal/testwait"
)

// failing is a listener whose Accept fails with errs in turn, then accepts.
type failing struct {
	net.Listener
	errs []error
}

func (l *failing) Accept() (net.Conn, error) {
	if len(l.errs) > 0 {
		err := l.errs[0]
		l.errs = l.errs[1:]
		return nil, err
	}
	return l.Listener.Accept()
}

func listen(t *testing.T) (*net.UnixListener, string) {
	path := filepath.Join(t.TempDir(), "s.sock")
	l, err := net.ListenUnix("unix", &net.UnixAddr{Name: path, Net: "unix"})
	require.NoError(t, err)
	t.Cleanup(func() { l.Close() })
	return l, path
}

// An accept that fails for want of a resource is retried; one that fails for good
// ends the loop.
func TestAcceptLoopRetriesTemporaryFailures(t *testing.T) {
	l, path := listen(t)
	emfile := &net.OpError{Op: "accept", Err: os.NewSyscallError("accept", syscall.EMFILE)}
	enfile := &net.OpError{Op: "accept", Err: os.NewSyscallError("accept", syscall.ENFILE)}
	fl := &failing{Listener: l, errs: []error{emfile, enfile, errors.New("broken for good")}}
	served := make(chan net.Conn, 1)
	var slept []time.Duration
	done := make(chan struct{})
	go func() {
		defer close(done)
		AcceptLoop(fl, slog.New(slog.DiscardHandler), "test", func() bool { return false }, func(nc net.Conn) { served <- nc }, func(d time.Duration) { slept = append(slept, d) })
	}()
	testwait.Recv(t, done, "the loop to end at the error for good")
	assert.Equal(t, []time.Duration{AcceptBackoffMin, 2 * AcceptBackoffMin}, slept, "two backoffs")

	fl.errs = []error{emfile}
	go AcceptLoop(fl, slog.New(slog.DiscardHandler), "test", func() bool { return false }, func(nc net.Conn) { served <- nc }, func(time.Duration) {})
	nc, err := net.Dial("unix", path)
	require.NoError(t, err)
	defer nc.Close()
	got := testwait.Recv(t, served, "the connection after an EMFILE")
	require.NotNil(t, got)
	got.Close()
}

// A write whose context ends before a byte went returns the context's error and the
// connection carries on; one cut inside a frame breaks the Writer for good.
func TestWriterIsBoundedByItsContext(t *testing.T) {
	a, b := net.Pipe() // unbuffered: a write blocks until b reads
	defer a.Close()
	defer b.Close()
	w := NewWriter(a, 0)
	frame := func(n int) func([]byte) ([]byte, error) {
		return func(buf []byte) ([]byte, error) { return append(buf, make([]byte, n)...), nil }
	}
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Millisecond)
	defer cancel()
	err := w.Write(ctx, frame(8))
	require.ErrorIs(t, err, context.DeadlineExceeded)
	assert.NotErrorIs(t, err, ErrBroken, "nothing was written")

	go func() {
		buf := make([]byte, 3)
		_, _ = b.Read(buf) // three bytes of eight, then nothing
	}()
	ctx2, cancel2 := context.WithTimeout(context.Background(), 50*time.Millisecond)
	defer cancel2()
	err = w.Write(ctx2, frame(8))
	require.ErrorIs(t, err, ErrBroken)
	assert.ErrorIs(t, w.Write(context.Background(), frame(1)), ErrBroken, "a broken Writer stays broken")
}

// A writer waiting for another's write gives up when its context ends.
func TestWriterTurnIsBoundedByItsContext(t *testing.T) {
	a, b := net.Pipe()
	defer a.Close()
	defer b.Close()
	w := NewWriter(a, 0)
	blocked := make(chan error, 1)
	go func() {
		blocked <- w.Write(context.Background(), func(buf []byte) ([]byte, error) { return append(buf, 1), nil })
	}()
	require.Eventually(t, func() bool { return len(w.turn) == 1 }, testwait.Bound, time.Millisecond, "the first write to start")
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	assert.ErrorIs(t, w.Write(ctx, func(buf []byte) ([]byte, error) { return append(buf, 2), nil }), context.Canceled)
	a.Close()
	testwait.Recv(t, blocked, "the first write to fail once its connection closed")
}

func TestCounterCaps(t *testing.T) {
	c := NewCounter(3, 2)
	ok, _ := c.Enter(1)
	require.True(t, ok)
	ok, _ = c.Enter(1)
	require.True(t, ok)
	ok, full := c.Enter(1)
	assert.False(t, ok)
	assert.Equal(t, "per-key", full)
	ok, _ = c.Enter(2)
	require.True(t, ok)
	ok, full = c.Enter(3)
	assert.False(t, ok)
	assert.Equal(t, "total", full)
	c.Leave(1)
	ok, _ = c.Enter(3)
	assert.True(t, ok)
	total, one := c.Count(1)
	assert.Equal(t, 3, total)
	assert.Equal(t, 1, one)
}

// Dial says what is at the path: nothing (waited for only with wait), or a file that
// is no socket (never waited for).
func TestDialSaysWhatIsThere(t *testing.T) {
	dir := t.TempDir()
	missing := filepath.Join(dir, "missing.sock")
	_, err := Dial(context.Background(), missing, false)
	require.ErrorIs(t, err, ErrNoListener)
	file := filepath.Join(dir, "file")
	require.NoError(t, os.WriteFile(file, nil, 0o600))
	_, err = Dial(context.Background(), file, true)
	require.ErrorIs(t, err, ErrNotSocket, "a file that is no socket is not waited for")
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	_, err = Dial(ctx, missing, true)
	require.ErrorIs(t, err, context.Canceled)
	require.ErrorIs(t, err, ErrNoListener)
}
