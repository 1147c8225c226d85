package cudarttest_test

import (
	"encoding/binary"
	"testing"

	"github.com/stretchr/testify/require"
	"golang.org/x/sys/unix"

	"github.com/cudapool/cudapool/cudart"
	"github.com/cudapool/cudapool/cudart/cudarttest"
)

// eventfdTotal reads what fd has counted since the last read, 0 if nothing; with wait
// it waits (at most 10 s, then fails) until there is something.
func eventfdTotal(t *testing.T, fd int, wait bool) uint64 {
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

// StreamNotify writes the eventfd when its stream reaches it, after every earlier op of
// the stream and not before: on several streams stalled behind their memsets, no
// eventfd counts anything; once a stream runs, its eventfd counts its points, and work
// queued after the host saw the count sees the memset's bytes (no race reported).
func TestStreamNotifyRunsInStreamOrder(t *testing.T) {
	d := cudarttest.ForTest(t)
	p, err := d.DeviceGetDefaultMemPool(0)
	require.NoError(t, err)
	const streams, size = 3, 4096
	type lane struct {
		s      cudart.Stream
		fd     int
		ptr    cudart.DevicePtr
		resume func()
	}
	lanes := make([]lane, streams)
	for i := range lanes {
		l := &lanes[i]
		l.s, err = d.StreamCreate(0, cudart.StreamNonBlocking)
		require.NoError(t, err)
		l.fd, err = unix.Eventfd(0, unix.EFD_NONBLOCK|unix.EFD_CLOEXEC)
		require.NoError(t, err)
		t.Cleanup(func() { _ = unix.Close(l.fd) }) // test cleanup
		l.ptr, err = d.MallocFromPoolAsync(0, size, p, l.s)
		require.NoError(t, err)
		l.resume, err = d.Stall(0, l.s)
		require.NoError(t, err)
		require.NoError(t, d.MemsetAsync(0, l.ptr, byte(i+1), size, l.s))
		require.NoError(t, d.StreamNotify(0, l.s, l.fd))
		require.NoError(t, d.MemsetAsync(0, l.ptr, byte(i+11), size, l.s))
		require.NoError(t, d.StreamNotify(0, l.s, l.fd))
	}
	for i := range lanes {
		require.Zero(t, eventfdTotal(t, lanes[i].fd, false), "stream %d is stalled: nothing has reached its notify", i)
	}
	reader, err := d.StreamCreate(0, cudart.StreamNonBlocking)
	require.NoError(t, err)
	buf := make([]byte, size)
	for i := len(lanes) - 1; i >= 0; i-- {
		l := &lanes[i]
		l.resume()
		var total uint64
		for total < 2 {
			total += eventfdTotal(t, l.fd, true)
		}
		require.Equal(t, uint64(2), total, "stream %d's eventfd counts its two points", i)
		require.NoError(t, d.MemcpyDtoHAsync(0, buf, l.ptr, reader), "a read ordered after the count, on another stream")
		for _, b := range buf {
			require.Equal(t, byte(i+11), b, "stream %d's bytes once its last point was counted", i)
		}
		for j := range i {
			require.Zero(t, eventfdTotal(t, lanes[j].fd, false), "stream %d, still stalled, counts nothing", j)
		}
	}
	require.ErrorIs(t, d.StreamNotify(0, cudart.Stream(12345), lanes[0].fd), cudart.ErrInvalidResourceHandle)
	require.ErrorIs(t, d.StreamNotify(0, lanes[0].s, -1), cudart.ErrInvalidValue)
}
