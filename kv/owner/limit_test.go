package owner_test

import (
	"os"
	"path/filepath"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/cudapool/cudapool/cudart"
	"github.com/cudapool/cudapool/cudart/cudarttest"
	"github.com/cudapool/cudapool/kv"
	"github.com/cudapool/cudapool/kv/owner"
)

// nothingLeft checks that a refused Listen left no socket in dir and no memory
// reserved on dev.
func nothingLeft(t *testing.T, dir string, dev *cudarttest.Device) {
	t.Helper()
	for _, name := range []string{owner.PageSocket, owner.LockFile} {
		_, err := os.Lstat(filepath.Join(dir, name))
		assert.ErrorIs(t, err, os.ErrNotExist, "%s left behind", name)
	}
	free, total, err := dev.MemGetInfo(0)
	require.NoError(t, err)
	assert.Equal(t, total, free, "memory left reserved by the refused Listen")
}

// A chunk size that is not a multiple of the device's granularity is refused at
// Listen, naming both, with nothing left behind.
func TestListenRefusesAChunkOffTheGranularity(t *testing.T) {
	dir := filepath.Join(t.TempDir(), "kv")
	dev := cudarttest.ForTest(t)
	_, err := owner.Listen(dir, dev, small, owner.WithChunkBytes(3<<20))
	require.ErrorIs(t, err, kv.ErrGeometry)
	assert.ErrorContains(t, err, "chunks of 3145728 bytes (3.0 MiB): not a multiple of device 0's granularity, 2.0 MiB")
	nothingLeft(t, dir, dev)
}

// A slab larger than the device's free memory is refused at Listen, naming both
// sizes, with nothing left behind.
func TestListenRefusesASlabOverFreeMemory(t *testing.T) {
	g, err := kv.Layout("llama-0.85b") // 512 KiB a page
	require.NoError(t, err)
	dir := filepath.Join(t.TempDir(), "kv")
	dev := cudarttest.ForTest(t, cudarttest.WithMemory(8<<30))
	g.Pages = 16385 // 8 GiB + 512 KiB
	_, err = owner.Listen(dir, dev, g, owner.WithInitialPages(g.Pages))
	require.ErrorIs(t, err, cudart.ErrOutOfMemory)
	assert.ErrorContains(t, err, "a slab's start of 8.5 GiB (9126805504 bytes: 256 chunks of 34 MiB, 16385 pages of the 16385 at most) is larger than device 0's free memory, 8.0 GiB (8589934592 bytes")
	nothingLeft(t, dir, dev)
}

// A slab whose tensors are over 4 GiB each is served as one region per tensor, in
// chunks of the default size, every chunk mapped; Stats shows the chunks, and the
// device's memory taken is theirs.
func TestListenServesTensorsOverFourGiB(t *testing.T) {
	g, err := kv.Layout("llama-0.85b")
	require.NoError(t, err)
	g.Pages = 270000 // tensors of 4.1 GiB, a slab of 132 GiB
	dir := filepath.Join(t.TempDir(), "kv")
	dev := cudarttest.ForTest(t, cudarttest.WithMemory(1<<40))
	o, err := owner.Listen(dir, dev, g, owner.WithInitialPages(g.Pages))
	require.NoError(t, err)
	l := o.Layout()
	assert.Equal(t, "32 regions of 4.1 GiB, in chunks of 528 MiB", l.String())
	st := o.Stats()
	assert.Equal(t, l.ChunkBytes(), st.Geometry.ChunkBytes)
	assert.Equal(t, 32*8, st.Geometry.Chunks)
	assert.Equal(t, l.ReservedBytes(), st.Geometry.ReservedBytes)
	require.Len(t, st.Devices, 1)
	assert.Equal(t, st.Geometry.Chunks, st.Devices[0].Chunks, "every chunk mapped")
	assert.Equal(t, g.Pages, st.Devices[0].Pages)
	free, total, err := dev.MemGetInfo(0)
	require.NoError(t, err)
	assert.Equal(t, st.Devices[0].MappedBytes, total-free, "the chunks take the slab's memory, rounded up to whole chunks")
	assert.NoError(t, o.Close(bound(t)))
	assert.NoError(t, dev.Err(), "the owner's device saw broken rules")
}
