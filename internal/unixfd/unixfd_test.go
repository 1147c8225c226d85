package unixfd

import (
	"net"
	"os"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"golang.org/x/sys/unix"
)

func pair(t *testing.T) (*net.UnixConn, *net.UnixConn) {
	t.Helper()
	fds, err := unix.Socketpair(unix.AF_UNIX, unix.SOCK_STREAM|unix.SOCK_CLOEXEC, 0)
	require.NoError(t, err)
	conn := func(fd int) *net.UnixConn {
		f := os.NewFile(uintptr(fd), "sock")
		defer func() { _ = f.Close() }() // test cleanup
		c, err := net.FileConn(f)
		require.NoError(t, err)
		t.Cleanup(func() { _ = c.Close() }) // test cleanup
		return c.(*net.UnixConn)
	}
	return conn(fds[0]), conn(fds[1])
}

func pipeFD(t *testing.T) (r *os.File, w *os.File) {
	t.Helper()
	r, w, err := os.Pipe()
	require.NoError(t, err)
	t.Cleanup(func() { _ = r.Close(); _ = w.Close() }) // test cleanup
	return r, w
}

// requireCloseOnExec fails the test unless fd is close-on-exec.
func requireCloseOnExec(t *testing.T, fd int, msgAndArgs ...any) {
	t.Helper()
	flags, err := unix.FcntlInt(uintptr(fd), unix.F_GETFD, 0)
	require.NoError(t, err, msgAndArgs...)
	require.NotZero(t, flags&unix.FD_CLOEXEC, msgAndArgs...)
}

func TestSendRecvPassesWorkingDescriptor(t *testing.T) {
	a, b := pair(t)
	r, w := pipeFD(t)
	require.NoError(t, Send(a, []byte("hello"), int(w.Fd())))
	buf := make([]byte, 16)
	n, fds, err := Recv(b, buf, 1)
	require.NoError(t, err)
	require.Equal(t, "hello", string(buf[:n]))
	require.Len(t, fds, 1)
	requireCloseOnExec(t, fds[0], "received fd not close-on-exec")
	got := os.NewFile(uintptr(fds[0]), "w")
	defer func() { _ = got.Close() }() // test cleanup
	_, err = got.Write([]byte("x"))
	require.NoError(t, err)
	one := make([]byte, 1)
	_, err = r.Read(one)
	require.NoError(t, err, "read through passed fd")
	require.Equal(t, byte('x'), one[0], "read through passed fd")
}

func TestRecvClosesUnexpectedDescriptors(t *testing.T) {
	a, b := pair(t)
	_, w1 := pipeFD(t)
	_, w2 := pipeFD(t)
	require.NoError(t, Send(a, []byte("x"), int(w1.Fd()), int(w2.Fd())))
	before := openFDs(t)
	n, fds, err := Recv(b, make([]byte, 4), 1)
	require.ErrorIs(t, err, ErrUnexpectedFDs)
	require.Nil(t, fds)
	require.Equal(t, 1, n)
	require.Equal(t, before, openFDs(t), "open descriptors before and after Recv: unexpected ones leaked")
}

func TestRecvWithoutDescriptors(t *testing.T) {
	a, b := pair(t)
	require.NoError(t, Send(a, []byte("plain")))
	n, fds, err := Recv(b, make([]byte, 8), 1)
	require.NoError(t, err)
	require.Equal(t, 5, n)
	require.Empty(t, fds)
	require.Error(t, Send(a, nil), "Send of no bytes")
}

func openFDs(t *testing.T) int {
	t.Helper()
	ents, err := os.ReadDir("/proc/self/fd")
	if err != nil {
		t.Skip("no /proc/self/fd")
	}
	return len(ents)
}

// One Receiver, reused across messages with and without descriptors, too many of them
// among them, keeps Recv's guarantees for each message.
func TestReceiverReusedKeepsGuarantees(t *testing.T) {
	a, b := pair(t)
	_, w1 := pipeFD(t)
	_, w2 := pipeFD(t)
	var r Receiver
	buf := make([]byte, 8)
	before := openFDs(t)
	steps := []struct {
		fds     []int
		maxFDs  int
		wantFDs int
		wantErr bool
	}{
		{[]int{int(w1.Fd()), int(w2.Fd())}, 2, 2, false}, // grows the buffer
		{[]int{int(w1.Fd()), int(w2.Fd())}, 1, 0, true},  // the larger buffer must not let both in
		{nil, 1, 0, false},
		{[]int{int(w1.Fd())}, 0, 0, true},
		{[]int{int(w1.Fd())}, 1, 1, false},
	}
	for i, s := range steps {
		require.NoError(t, Send(a, []byte("m"), s.fds...))
		n, fds, err := r.Recv(b, buf, s.maxFDs)
		require.Equal(t, 1, n, "step %d", i)
		require.Len(t, fds, s.wantFDs, "step %d", i)
		if s.wantErr {
			require.ErrorIs(t, err, ErrUnexpectedFDs, "step %d", i)
		} else {
			require.NoError(t, err, "step %d", i)
		}
		for _, fd := range fds {
			requireCloseOnExec(t, fd, "step %d: received fd not close-on-exec", i)
			_ = unix.Close(fd) // test cleanup
		}
	}
	assert.Equal(t, before, openFDs(t), "open descriptors before and after: some leaked")
}

func TestReceiverAllocatesNothingForPlainMessages(t *testing.T) {
	if raceEnabled {
		t.Skip("the race detector allocates on its own")
	}
	a, b := pair(t)
	var r Receiver
	buf := make([]byte, 8)
	msg := []byte("m")
	n := testing.AllocsPerRun(100, func() {
		_, err := a.Write(msg)
		require.NoError(t, err)
		_, _, err = r.Recv(b, buf, 1)
		require.NoError(t, err)
	})
	require.Zero(t, n, "allocations per plain message")
}

// A peer that closed with bytes of ours unread resets the connection: the read fails
// with ECONNRESET and reports no bytes (the system call's -1 must not come through:
// export's conn added it to its buffer's end and panicked when a producer was killed).
func TestRecvOfAResetConnectionReadsNothing(t *testing.T) {
	a, b := pair(t)
	require.NoError(t, Send(a, []byte("never read")))
	require.NoError(t, b.Close())
	var rx Receiver
	n, fds, err := rx.Recv(a, make([]byte, 8), 1)
	require.ErrorIs(t, err, unix.ECONNRESET)
	require.Zero(t, n)
	require.Empty(t, fds)
}
