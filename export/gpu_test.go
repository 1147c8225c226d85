package export

import (
	"fmt"
	"path/filepath"
	"testing"

	"github.com/cudapool/cudapool/cudart"
	"github.com/cudapool/cudapool/internal/gputest"
	"github.com/cudapool/cudapool/internal/proctest"
	"github.com/cudapool/cudapool/pool"
	"github.com/stretchr/testify/require"
)

// On a GPU host: a producer process on device 0, this process consuming on device 1.
// The consumer reads the producer's bytes over NVLink, and a release is ordered: the
// producer frees, reallocates and overwrites the buffer as soon as the release is
// acknowledged, while copies the consumer queued before releasing are still running;
// those copies must see the old bytes.
func TestGPUOtherDeviceReadsAndOrderedRelease(t *testing.T) {
	rt := gputest.Devices(t, 2)
	const size = 256 << 20
	path := filepath.Join(shortDir(t), "g.sock")
	k := proctest.Start(t, "producer", "gpu", path, "default", fmt.Sprintf("big=%d:161", size))
	k.Expect("ready")
	ctx := testCtx(t)
	s, err := rt.StreamCreate(1, cudart.StreamNonBlocking)
	require.NoError(t, err)
	defer rt.StreamDestroy(1, s)
	imp, err := Dial(ctx, path, rt, 1)
	require.NoError(t, err)
	defer imp.Close(ctx)
	// A stream of device 0 is refused at Open, not at Release (cudaStreamGetDevice,
	// CUDA 12.8 and later; the GPU host has 13).
	s0, err := rt.StreamCreate(0, cudart.StreamNonBlocking)
	require.NoError(t, err)
	defer rt.StreamDestroy(0, s0)
	_, err = imp.Open(ctx, "big", s0)
	require.ErrorIs(t, err, ErrStreamDevice, "a stream of device 0 given to an Importer on device 1")
	m, err := imp.Open(ctx, "big", s)
	require.NoError(t, err)
	got := make([]byte, size)
	require.NoError(t, rt.MemcpyDtoHAsync(1, got, m.Ptr(), s))
	require.True(t, allAre(got, 161), "device 1 read wrong bytes from the producer's buffer")

	local, err := pool.New(rt, 1, pool.WithHandleType(cudart.HandleTypeNone))
	require.NoError(t, err)
	defer local.Close(ctx, pool.Force())
	dst, err := local.Alloc(ctx, size, s)
	require.NoError(t, err)
	for range 8 { // a few milliseconds of copies still queued at Release
		require.NoError(t, rt.MemcpyDtoDAsync(1, dst.Ptr(), m.Ptr(), size, s))
	}
	require.NoError(t, m.Release(ctx, s))
	k.Send("free big")
	k.Expect("freed")
	k.Send(fmt.Sprintf("refill %d 178", size))
	k.Expect("refilled")
	require.NoError(t, rt.MemcpyDtoHAsync(1, got, dst.Ptr(), s))
	require.True(t, allAre(got, 161), "a copy queued before Release saw the producer's later writes: release was not ordered")
	dst.Free(s)
	k.Send("stats")
	require.Equal(t, "stats 1 0 0", k.Next(), "producer: want the refilled buffer only, no lease, no deferred free")
	require.NoError(t, imp.Close(ctx))
	k.Send("quit")
	k.Finish()
}
