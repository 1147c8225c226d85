package cudarttest_test

import (
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/cudapool/cudapool/cudart"
	"github.com/cudapool/cudapool/cudart/cudarttest"
	"github.com/cudapool/cudapool/internal/eventfdtest"
)

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
		l.fd = eventfdtest.New(t)
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
		require.Zero(t, eventfdtest.Take(t, lanes[i].fd, false), "stream %d is stalled: nothing has reached its notify", i)
	}
	reader, err := d.StreamCreate(0, cudart.StreamNonBlocking)
	require.NoError(t, err)
	buf := make([]byte, size)
	for i := len(lanes) - 1; i >= 0; i-- {
		l := &lanes[i]
		l.resume()
		var total uint64
		for total < 2 {
			total += eventfdtest.Take(t, l.fd, true)
		}
		require.Equal(t, uint64(2), total, "stream %d's eventfd counts its two points", i)
		require.NoError(t, d.MemcpyDtoHAsync(0, buf, l.ptr, reader), "a read ordered after the count, on another stream")
		for _, b := range buf {
			require.Equal(t, byte(i+11), b, "stream %d's bytes once its last point was counted", i)
		}
		for j := range i {
			require.Zero(t, eventfdtest.Take(t, lanes[j].fd, false), "stream %d, still stalled, counts nothing", j)
		}
	}
	require.ErrorIs(t, d.StreamNotify(0, cudart.Stream(12345), lanes[0].fd), cudart.ErrInvalidResourceHandle)
	require.ErrorIs(t, d.StreamNotify(0, lanes[0].s, -1), cudart.ErrInvalidValue)
}
