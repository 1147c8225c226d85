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
	for _, name := range []string{owner.SlabSocket, owner.PageSocket} {
		_, err := os.Lstat(filepath.Join(dir, name))
		assert.ErrorIs(t, err, os.ErrNotExist, "%s left behind", name)
	}
	free, total, err := dev.MemGetInfo(0)
	require.NoError(t, err)
	assert.Equal(t, total, free, "memory left reserved by the refused Listen")
}

// A geometry one of whose tensors is over the segment bound is refused at Listen,
// naming both sizes and the most pages that fit, with nothing left behind.
func TestListenRefusesATensorOverTheSegmentBound(t *testing.T) {
	g, err := kv.Layout("llama-0.85b") // 16 KiB a page per tensor
	require.NoError(t, err)
	dir := filepath.Join(t.TempDir(), "kv")
	dev := cudarttest.ForTest(t, cudarttest.WithMemory(1<<40))
	g.Pages = 262145 // a tensor of 4 GiB + 16 KiB
	_, err = owner.Listen(dir, dev, g, owner.WithoutAnnounce())
	require.ErrorIs(t, err, kv.ErrGeometry)
	assert.ErrorContains(t, err, "tensor of 4.0 GiB (262145 pages of 16 KiB) is over the 4.0 GiB")
	assert.ErrorContains(t, err, "at most 262144 pages")
	nothingLeft(t, dir, dev)

	g.Pages = 64
	_, err = owner.Listen(dir, dev, g, owner.WithoutAnnounce(), owner.WithSegmentBytes(63<<14))
	require.ErrorIs(t, err, kv.ErrGeometry, "a smaller bound")
	assert.ErrorContains(t, err, "at most 63 pages")
	nothingLeft(t, dir, dev)

	_, err = owner.Listen(dir, dev, g, owner.WithoutAnnounce(), owner.WithSegmentBytes(kv.MaxSegmentBytes+1))
	require.ErrorIs(t, err, kv.ErrGeometry, "a bound over what a replica imports")
	assert.ErrorContains(t, err, "segments of 4294967297 bytes: a replica can import at most 4294967296 (4.0 GiB) as one allocation")
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
	_, err = owner.Listen(dir, dev, g, owner.WithoutAnnounce())
	require.ErrorIs(t, err, cudart.ErrOutOfMemory)
	assert.ErrorContains(t, err, "a slab of 8.0 GiB (8590458880 bytes, 16385 pages) is larger than device 0's free memory, 8.0 GiB (8589934592 bytes")
	nothingLeft(t, dir, dev)
}

// A slab over 4 GiB is served as several segments, each at most the bound, published
// under SlabName(device, segment); Stats shows them.
func TestListenServesASlabOfSeveralSegments(t *testing.T) {
	g, err := kv.Layout("llama-0.85b")
	require.NoError(t, err)
	g.Pages = 40960 // 20 GiB: 32 tensors of 640 MiB, 6 to a segment
	dir := filepath.Join(t.TempDir(), "kv")
	dev := cudarttest.ForTest(t, cudarttest.WithMemory(32<<30))
	o, err := owner.Listen(dir, dev, g, owner.WithoutAnnounce())
	require.NoError(t, err)
	segs := o.Segments()
	assert.Equal(t, "5 segments of 3.8 GiB and 1 of 1.3 GiB", segs.String())
	st := o.Stats()
	assert.Equal(t, segs.Sizes(), st.Geometry.Segments)
	assert.Equal(t, g.SlabBytes(), st.Geometry.SlabBytes)
	free, total, err := dev.MemGetInfo(0)
	require.NoError(t, err)
	assert.Equal(t, g.SlabBytes(), total-free, "the segments reserve the slab, no more")
	assert.Equal(t, "kv/slab/0/5", owner.SlabName(0, 5))
	assert.NoError(t, o.Close(bound(t)))
	assert.NoError(t, dev.Err(), "the owner's device saw broken rules")
}
