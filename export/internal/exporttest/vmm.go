package exporttest

import (
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/cudapool/cudapool/cudart"
	"github.com/cudapool/cudapool/export/producer"
	"github.com/cudapool/cudapool/vmm"
)

// VMMAlloc is a VMM allocation a producer made: its chunks, mapped one behind the
// other into Res, chunk i filled with Fill+i.
type VMMAlloc struct {
	Chunks []*vmm.Chunk
	Res    *vmm.Reservation
	Gran   uint64 // the chunk size: one granule
	Fill   byte
}

// NewVMMAlloc makes n chunks of one granule each on the producer's device, maps them
// into one range and fills chunk i with fill+i on the producer's stream.
func (pr *Producer) NewVMMAlloc(t testing.TB, n int, fill byte) *VMMAlloc {
	t.Helper()
	return NewVMMAllocOn(t, pr.Dev, pr.Ord, pr.Stream, n, fill)
}

// NewVMMAllocOn is NewVMMAlloc on any runtime and stream.
func NewVMMAllocOn(t testing.TB, rt cudart.Runtime, dev int, s cudart.Stream, n int, fill byte, opts ...vmm.ChunkOption) *VMMAlloc {
	t.Helper()
	g, err := vmm.Granularity(rt, dev, cudart.HandleTypePosixFD)
	require.NoError(t, err)
	res, err := vmm.Reserve(rt, dev, uint64(n)*g)
	require.NoError(t, err)
	a := &VMMAlloc{Res: res, Gran: g, Fill: fill}
	t.Cleanup(func() { a.Close() })
	for i := range n {
		c, err := vmm.NewChunk(rt, dev, g, opts...)
		require.NoError(t, err)
		a.Chunks = append(a.Chunks, c)
		require.NoError(t, res.Grow(c))
		require.NoError(t, rt.MemsetAsync(dev, res.Ptr()+cudart.DevicePtr(uint64(i)*g), fill+byte(i), g, s))
	}
	return a
}

// Close closes the producer's chunks and range; a publication and the consumers'
// imports keep the memory.
func (a *VMMAlloc) Close() {
	for _, c := range a.Chunks {
		_ = c.Close() // cleanup: what is tested is above
	}
	_ = a.Res.Close() // cleanup: what is tested is above
}

// PublishVMM makes a VMM allocation of n chunks (NewVMMAlloc) and publishes it under
// name.
func (pr *Producer) PublishVMM(t testing.TB, name string, n int, fill byte, opts ...producer.PublishOption) *VMMAlloc {
	t.Helper()
	a := pr.NewVMMAlloc(t, n, fill)
	require.NoError(t, pr.Ex.PublishChunks(Ctx(t), name, a.Chunks, pr.Stream, opts...))
	return a
}

// CheckVMMBytes fails the test unless got, read from offset off of an allocation
// made by NewVMMAlloc with fill and granule g, holds what was written there.
func CheckVMMBytes(t testing.TB, got []byte, off, g uint64, fill byte) {
	t.Helper()
	for i, b := range got {
		want := fill + byte((off+uint64(i))/g)
		if b != want {
			require.Failf(t, "wrong byte", "byte %d (offset %d of the allocation) is %#x, want %#x", i, off+uint64(i), b, want)
		}
	}
}
