package e2e_test

import (
	"context"
	"fmt"
	"path/filepath"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/cudapool/cudapool/cudart"
	"github.com/cudapool/cudapool/cudart/cudarttest"
	"github.com/cudapool/cudapool/export/consumer"
	"github.com/cudapool/cudapool/export/internal/exporttest"
	"github.com/cudapool/cudapool/internal/gputest"
	"github.com/cudapool/cudapool/internal/proctest"
	"github.com/cudapool/cudapool/pool"
)

// On a GPU host: a producer process on device 0, this process consuming on device 1.
// The consumer reads the producer's bytes over NVLink, and a release is ordered: the
// producer frees, reallocates and overwrites the buffer as soon as the release is
// acknowledged, while copies the consumer queued before releasing are still running;
// those copies must see the old bytes.
func TestGPUOtherDeviceReadsAndOrderedRelease(t *testing.T) {
	rt := gputest.Devices(t, 2)
	const size = 256 << 20
	path := filepath.Join(exporttest.ShortDir(t), "g.sock")
	k := proctest.Start(t, "producer", "gpu", path, "default", fmt.Sprintf("big=%d:161", size))
	k.Expect("ready")
	ctx := exporttest.Ctx(t)
	s, err := rt.StreamCreate(1, cudart.StreamNonBlocking)
	require.NoError(t, err)
	defer rt.StreamDestroy(1, s)
	imp, err := consumer.Dial(ctx, path, rt, 1)
	require.NoError(t, err)
	defer imp.Close(ctx)
	// A stream of device 0 is refused at Open, not at Release (cudaStreamGetDevice,
	// CUDA 12.8 and later; the GPU host has 13).
	s0, err := rt.StreamCreate(0, cudart.StreamNonBlocking)
	require.NoError(t, err)
	defer rt.StreamDestroy(0, s0)
	_, err = imp.Open(ctx, "big", s0)
	require.ErrorIs(t, err, consumer.ErrStreamDevice, "a stream of device 0 given to an Importer on device 1")
	m, err := imp.Open(ctx, "big", s)
	require.NoError(t, err)
	got := make([]byte, size)
	require.NoError(t, rt.MemcpyDtoHAsync(1, got, m.Ptr(), s))
	require.True(t, exporttest.AllAre(got, 161), "device 1 read wrong bytes from the producer's buffer")

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
	require.True(t, exporttest.AllAre(got, 161), "a copy queued before Release saw the producer's later writes: release was not ordered")
	dst.Free(s)
	k.Send("stats")
	require.Equal(t, "stats 1 0 0", k.Next(), "producer: want the refilled buffer only, no lease, no deferred free")
	require.NoError(t, imp.Close(ctx))
	k.Send("quit")
	k.Finish()
}

// On a GPU host: a producer process whose consumers retain their imports, this process
// consuming on the same device. The producer recycles the buffer (same memory, from
// its pool's cache) with new contents while copies this process queued before its
// release still run: those copies see the old bytes, and the new lease sees the new
// ones through the same mapping, never the old. Trimming the producer's cache revokes
// the import: this process frees it and the producer's memory goes back to the driver.
func TestGPURetainedImportOfRecycledBuffer(t *testing.T) {
	retainedRecycle(t, gputest.Runtime(t), "gpu", 64<<20)
}

// TestProcessRetainedImportOfRecycledBuffer is the GPU test's protocol between two
// processes on software devices.
func TestProcessRetainedImportOfRecycledBuffer(t *testing.T) {
	d := cudarttest.New()
	defer d.Close()
	retainedRecycle(t, d, "soft", 1<<20)
	require.NoError(t, d.Err())
}

func retainedRecycle(t *testing.T, rt cudart.Runtime, kind string, size uint64) {
	path := filepath.Join(exporttest.ShortDir(t), "r.sock")
	k := proctest.Start(t, "producer", kind, path, "retain", fmt.Sprintf("kv=%d:17", size))
	k.Expect("ready")
	ctx, s, imp, dst := copyingConsumer(t, rt, path, size)
	got := make([]byte, size)

	fill := byte(17)
	var first cudart.DevicePtr
	for round, next := range []byte{29, 41, 53} {
		m, err := imp.Open(ctx, "kv", s)
		require.NoError(t, err)
		if round == 0 {
			first = m.Ptr()
		}
		require.Equal(t, first, m.Ptr(), "round %d: the retained import was not reused", round)
		for range 8 { // copies still queued at Release
			require.NoError(t, rt.MemcpyDtoDAsync(0, dst.Ptr(), m.Ptr(), size, s))
		}
		require.NoError(t, m.Release(ctx, s))
		k.Send(fmt.Sprintf("recycle kv %d", next))
		require.Equal(t, "recycled same", k.Next(), "round %d: the producer did not recycle the buffer", round)
		require.NoError(t, rt.MemcpyDtoHAsync(0, got, dst.Ptr(), s))
		require.NoError(t, rt.StreamSynchronize(0, s))
		require.True(t, exporttest.AllAre(got, fill), "round %d: a copy queued before Release saw the producer's later writes", round)
		fill = next
	}
	m, err := imp.Open(ctx, "kv", s)
	require.NoError(t, err)
	require.NoError(t, rt.MemcpyDtoHAsync(0, got, m.Ptr(), s))
	require.NoError(t, rt.StreamSynchronize(0, s))
	require.True(t, exporttest.AllAre(got, fill), "the last lease did not read the recycled buffer's new contents")
	require.NoError(t, m.Release(ctx, s))
	k.Send("retained")
	require.Equal(t, "retained 1 0", k.Next())

	k.Send("free kv")
	k.Expect("freed")
	k.Send("trim")
	k.Expect("trimmed")
	exporttest.WaitFor(t, "the revoked import to be freed and the memory returned", func() bool {
		k.Send("retained")
		return k.Next() == "retained 0 0"
	})
	require.NoError(t, imp.Close(ctx))
	k.Send("quit")
	k.Finish()
}

// On a GPU host: a producer process publishes 64 blocks of a slab in one PublishAll;
// this process, on the same device, leases them all in one OpenAll, reads the right
// bytes in each, queues copies of every block and releases them all in one ReleaseAll.
// The producer then frees the slab and overwrites its memory: the copies queued
// before the release see the old bytes, block by block.
func TestGPUBlockLeasesKeepOrdering(t *testing.T) {
	blockLeases(t, gputest.Runtime(t), "gpu", 64<<20)
}

// TestProcessBlockLeasesKeepOrdering is the GPU test between two processes on
// software devices.
func TestProcessBlockLeasesKeepOrdering(t *testing.T) {
	d := cudarttest.New()
	defer d.Close()
	blockLeases(t, d, "soft", 1<<20)
	require.NoError(t, d.Err())
}

func blockLeases(t *testing.T, rt cudart.Runtime, kind string, size uint64) {
	const n = 64
	block := size / n
	path := filepath.Join(exporttest.ShortDir(t), "b.sock")
	k := proctest.Start(t, "producer", kind, path, "default", fmt.Sprintf("slab=%d:91", size))
	k.Expect("ready")
	k.Send(fmt.Sprintf("ranges slab %d", n))
	k.Expect("ranged")
	ctx, s, imp, dst := copyingConsumer(t, rt, path, size)
	names := make([]string, n)
	for i := range names {
		names[i] = fmt.Sprintf("slab-%d", i)
	}
	ms, err := imp.OpenAll(ctx, names, s)
	require.NoError(t, err)
	for round := range 4 { // copies still queued at the release
		for i, m := range ms {
			require.Equal(t, block, m.Size())
			require.NoError(t, rt.MemcpyDtoDAsync(0, dst.Ptr()+cudart.DevicePtr(uint64(i)*block), m.Ptr(), block, s), "round %d block %d", round, i)
		}
	}
	require.NoError(t, imp.ReleaseAll(ctx, ms, s))
	k.Send("free slab")
	k.Expect("freed")
	k.Send(fmt.Sprintf("refill %d 92", size))
	k.Expect("refilled")
	got := make([]byte, size)
	require.NoError(t, rt.MemcpyDtoHAsync(0, got, dst.Ptr(), s))
	require.NoError(t, rt.StreamSynchronize(0, s))
	for i := range n {
		require.True(t, exporttest.AllAre(got[uint64(i)*block:uint64(i+1)*block], 91), "block %d: a copy queued before ReleaseAll saw the producer's later writes", i)
	}
	require.NoError(t, imp.Close(ctx))
	k.Send("quit")
	k.Finish()
}

// copyingConsumer is this process's side of the two-process GPU tests on device 0: a
// stream, an Importer of the producer at path and a buffer of size bytes in a local
// pool to copy mappings into, each undone when the test ends (the Importer first).
func copyingConsumer(t *testing.T, rt cudart.Runtime, path string, size uint64) (context.Context, cudart.Stream, *consumer.Importer, *pool.Buffer) {
	t.Helper()
	ctx := exporttest.Ctx(t)
	s, err := rt.StreamCreate(0, cudart.StreamNonBlocking)
	require.NoError(t, err)
	t.Cleanup(func() { rt.StreamDestroy(0, s) })
	local, err := pool.New(rt, 0, pool.WithHandleType(cudart.HandleTypeNone))
	require.NoError(t, err)
	t.Cleanup(func() { local.Close(ctx, pool.Force()) })
	dst, err := local.Alloc(ctx, size, s)
	require.NoError(t, err)
	t.Cleanup(func() { dst.Free(s) })
	imp, err := consumer.Dial(ctx, path, rt, 0)
	require.NoError(t, err)
	t.Cleanup(func() { imp.Close(ctx) })
	return ctx, s, imp, dst
}
