package session

import (
	"context"
	"net"
	"os"
	"syscall"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/cudapool/cudapool/internal/unixfd"
)

// WriteFD sends its frame with the descriptor on its first byte, between the
// Writer's other frames and in their order; on a connection that cannot carry
// descriptors it fails, and the Writer is broken.
func TestWriteFDSendsTheDescriptorWithItsFrame(t *testing.T) {
	pair, err := syscall.Socketpair(syscall.AF_UNIX, syscall.SOCK_STREAM|syscall.SOCK_CLOEXEC, 0)
	require.NoError(t, err)
	conn := func(fd int) *net.UnixConn {
		f := os.NewFile(uintptr(fd), "pair")
		defer f.Close()
		c, err := net.FileConn(f)
		require.NoError(t, err)
		t.Cleanup(func() { c.Close() })
		return c.(*net.UnixConn)
	}
	a, b := conn(pair[0]), conn(pair[1])
	r, w, err := os.Pipe()
	require.NoError(t, err)
	defer r.Close()
	defer w.Close()
	wr := NewWriter(a, 0)
	frame := func(s string) func([]byte) ([]byte, error) {
		return func(buf []byte) ([]byte, error) { return append(buf, s...), nil }
	}
	ctx := context.Background()
	require.NoError(t, wr.Write(ctx, frame("one")))
	require.NoError(t, wr.WriteFD(ctx, int(w.Fd()), frame("two")))
	require.NoError(t, wr.Write(ctx, frame("three")))

	var rc unixfd.Receiver
	buf := make([]byte, 64)
	var got []byte
	var fds []int
	for len(got) < len("onetwothree") {
		n, f, err := rc.Recv(b, buf, 1)
		require.NoError(t, err)
		got = append(got, buf[:n]...)
		fds = append(fds, f...)
		if len(f) > 0 {
			assert.Equal(t, "onetwo", string(got), "the descriptor comes with the read that ends in its frame")
		}
	}
	assert.Equal(t, "onetwothree", string(got))
	require.Len(t, fds, 1)
	sent := os.NewFile(uintptr(fds[0]), "sent")
	defer sent.Close()
	_, err = sent.Write([]byte("x"))
	require.NoError(t, err)
	one := make([]byte, 1)
	_, err = r.Read(one)
	require.NoError(t, err)
	assert.Equal(t, "x", string(one), "the descriptor received is the pipe's")

	p1, p2 := net.Pipe()
	defer p1.Close()
	defer p2.Close()
	err = NewWriter(p1, 0).WriteFD(ctx, int(w.Fd()), frame("x"))
	assert.ErrorIs(t, err, ErrBroken, "a net.Pipe carries no descriptor")
}
