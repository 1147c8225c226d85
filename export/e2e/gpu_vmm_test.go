package e2e_test

import (
	"context"
	"fmt"
	"path/filepath"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/cudapool/cudapool/cudart"
	"github.com/cudapool/cudapool/export"
	"github.com/cudapool/cudapool/export/consumer"
	"github.com/cudapool/cudapool/export/internal/exporttest"
	"github.com/cudapool/cudapool/internal/gputest"
	"github.com/cudapool/cudapool/internal/proctest"
	"github.com/cudapool/cudapool/internal/testwait"
)

// startVMMProducerGPU runs a producer process on the GPU publishing "slab", a VMM
// allocation of n chunks of one granule (chunk i filled with fill+i), and returns it
// with its socket and the granule.
func startVMMProducerGPU(t *testing.T, n int, fill byte) (*proctest.Child, string, uint64) {
	t.Helper()
	path := filepath.Join(exporttest.ShortDir(t), "v.sock")
	k := proctest.Start(t, "vmm-producer", "gpu", path, "slab", fmt.Sprint(n), fmt.Sprint(fill))
	var g uint64
	_, err := fmt.Sscanf(k.Next(), "ready %d", &g)
	require.NoError(t, err, "the producer's first line")
	return k, path, g
}

// dialGPU makes a stream on device 0 and an Importer there, both closed at the test's
// end.
func dialGPU(t *testing.T, rt cudart.Runtime, path string) (cudart.Stream, *consumer.Importer) {
	t.Helper()
	s, err := rt.StreamCreate(0, cudart.StreamNonBlocking)
	require.NoError(t, err)
	t.Cleanup(func() { _ = rt.StreamDestroy(0, s) }) // cleanup: what is tested is above
	imp, err := consumer.Dial(exporttest.Ctx(t), path, rt, 0)
	require.NoError(t, err)
	t.Cleanup(func() { _ = imp.Close(context.Background()) }) // cleanup: a second Close after the test's own is export.ErrClosed
	return s, imp
}

// readVMM copies n bytes at off of m to the host on s and waits for them.
func readVMM(t *testing.T, rt cudart.Runtime, s cudart.Stream, m *consumer.Mapping, off, n uint64) []byte {
	t.Helper()
	got := make([]byte, n)
	require.NoError(t, rt.MemcpyDtoHAsync(0, got, m.Ptr()+cudart.DevicePtr(off), s))
	require.NoError(t, rt.StreamSynchronize(0, s))
	return got
}

// On a GPU host: a producer process publishes a VMM allocation of four chunks (whose
// own handles and range it closed: its publication holds the memory), and this process
// maps it as one range, reads every byte and one copy across each chunk boundary,
// releases it and opens it again.
func TestGPUVMMPublishOpenRelease(t *testing.T) {
	rt := gputest.Runtime(t)
	const chunks = 4
	k, path, g := startVMMProducerGPU(t, chunks, 0x30)
	ctx := exporttest.Ctx(t)
	s, imp := dialGPU(t, rt, path)
	for round := range 2 {
		m, err := imp.Open(ctx, "slab", s)
		require.NoError(t, err, "round %d", round)
		require.EqualValues(t, chunks*g, m.Size())
		exporttest.CheckVMMBytes(t, readVMM(t, rt, s, m, 0, m.Size()), 0, g, 0x30)
		for b := g; b < m.Size(); b += g {
			exporttest.CheckVMMBytes(t, readVMM(t, rt, s, m, b-4096, 8192), b-4096, g, 0x30)
		}
		require.NoError(t, m.Release(ctx, s))
	}
	require.NoError(t, imp.Close(ctx))
	k.Send("quit")
	k.Finish()
}

// On a GPU host: a producer process killed while this process maps its VMM allocation
// takes nothing with it: the import holds the memory (FACTS 26), which still reads as
// the producer wrote it; Release and Close complete, and this process keeps its
// context.
func TestGPUVMMOutlivesProducer(t *testing.T) {
	rt := gputest.Runtime(t)
	k, path, g := startVMMProducerGPU(t, 3, 0x50)
	ctx := exporttest.Ctx(t)
	s, imp := dialGPU(t, rt, path)
	m, err := imp.Open(ctx, "slab", s)
	require.NoError(t, err)
	exporttest.KillProducer(t, k)
	testwait.Recv(t, imp.Done(), "the importer to see its exporter die")
	require.NoError(t, m.Err())
	exporttest.CheckVMMBytes(t, readVMM(t, rt, s, m, 0, m.Size()), 0, g, 0x50)
	_, err = imp.Open(ctx, "slab", s)
	require.ErrorIs(t, err, export.ErrExporterGone)
	require.NoError(t, m.Release(ctx, s))
	require.NoError(t, imp.Close(ctx))
}
