// Package eventfdtest owns the eventfds of tests that stand for a stream's
// notifications (cudart.StreamNotify): making one, counting on it by hand, and reading
// what it counted.
package eventfdtest

import (
	"encoding/binary"
	"testing"

	"github.com/stretchr/testify/require"
	"golang.org/x/sys/unix"
)

// New makes a nonblocking eventfd, closed with the test.
func New(t testing.TB) int {
	t.Helper()
	fd, err := unix.Eventfd(0, unix.EFD_NONBLOCK|unix.EFD_CLOEXEC)
	require.NoError(t, err, "eventfd")
	t.Cleanup(func() { _ = unix.Close(fd) }) // test cleanup
	return fd
}

// Add adds n to fd, as n points of a stream completing.
func Add(t testing.TB, fd int, n uint64) {
	t.Helper()
	var b [8]byte
	binary.NativeEndian.PutUint64(b[:], n)
	_, err := unix.Write(fd, b[:])
	require.NoError(t, err, "writing the eventfd")
}

// Take reads what fd has counted since the last read, 0 if nothing; with wait it
// first waits until there is something, failing the test after 10 s.
func Take(t testing.TB, fd int, wait bool) uint64 {
	t.Helper()
	if wait {
		pfd := []unix.PollFd{{Fd: int32(fd), Events: unix.POLLIN}}
		for {
			n, err := unix.Poll(pfd, 10_000)
			if err == unix.EINTR {
				continue
			}
			require.NoError(t, err, "poll")
			require.Equal(t, 1, n, "the eventfd was not written within 10 s")
			break
		}
	}
	var b [8]byte
	n, err := unix.Read(fd, b[:])
	if err == unix.EAGAIN {
		return 0
	}
	require.NoError(t, err, "reading the eventfd")
	require.Equal(t, 8, n)
	return binary.NativeEndian.Uint64(b[:])
}
