package slabmap_test

import (
	"bytes"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"golang.org/x/sys/unix"

	"github.com/cudapool/cudapool/cudart"
	"github.com/cudapool/cudapool/cudart/cudarttest"
	"github.com/cudapool/cudapool/kv"
	"github.com/cudapool/cudapool/kv/internal/slabmap"
	"github.com/cudapool/cudapool/vmm"
)

const (
	dev  = 0
	gran = 4096
)

// pages of 1536 bytes in chunks of 4 KiB: pages straddle chunk boundaries.
var geo = kv.Geometry{Layers: 2, KVHeads: 3, HeadDim: 128, TokensPerPage: 2, DType: kv.DTypeBF16, Pages: 20}

func newMap(t *testing.T, rt cudart.Runtime) *slabmap.Map {
	t.Helper()
	l, err := geo.SlabLayout(gran)
	require.NoError(t, err)
	m, err := slabmap.New(rt, dev, l)
	require.NoError(t, err)
	t.Cleanup(func() { require.NoError(t, m.Close()) })
	return m
}

func pattern(n int, seed byte) []byte {
	b := make([]byte, n)
	for i := range b {
		b[i] = seed + byte(i*7)
	}
	return b
}

// The maker's chunks, imported from their descriptors into another map, hold the same
// bytes at the same page addresses, across chunk boundaries, and a growth maps in
// place: what was written before reads the same after.
func TestImportedMapReadsTheMakersBytes(t *testing.T) {
	own := cudarttest.ForTest(t, cudarttest.WithGranularity(gran))
	rep := cudarttest.ForTest(t, cudarttest.WithGranularity(gran))
	om, rm := newMap(t, own), newMap(t, rep)
	l := om.Layout()
	var fds []int
	t.Cleanup(func() {
		for _, fd := range fds {
			_ = unix.Close(fd)
		}
	})
	grow := func(n int) {
		from := om.Chunks()
		var batch []int
		for range n {
			c, err := vmm.NewChunk(own, dev, l.ChunkBytes())
			require.NoError(t, err)
			require.NoError(t, om.Grow(c))
			fd, err := c.Export()
			require.NoError(t, err)
			require.NoError(t, c.Close(), "the mapping and the descriptor keep the memory")
			batch = append(batch, fd)
		}
		fds = append(fds, batch...)
		require.NoError(t, rm.Import(from, batch))
	}
	grow(l.Regions())
	pages := l.MappedPages(rm.Chunks())
	require.Equal(t, 2, pages, "one step of 4 KiB holds two pages of 1.5 KiB")
	want := pattern(pages*int(geo.PageBytes()), 3)
	k1 := l.Addr(om.Bases(), 1, kv.V, 0)
	require.NoError(t, own.MemcpyHtoDAsync(dev, k1, want, 0))
	require.NoError(t, own.StreamSynchronize(dev, 0))

	grow(2 * l.Regions())
	assert.Equal(t, 3*l.Regions(), rm.Chunks())
	pages = l.MappedPages(rm.Chunks())
	require.Equal(t, 8, pages)
	more := pattern(pages*int(geo.PageBytes()), 9)
	copy(more, want) // the first pages, as written before the growth
	require.NoError(t, own.MemcpyHtoDAsync(dev, k1+cudart.DevicePtr(len(want)), more[len(want):], 0))
	require.NoError(t, own.StreamSynchronize(dev, 0))
	got := make([]byte, len(more))
	require.NoError(t, rep.MemcpyDtoHAsync(dev, got, l.Addr(rm.Bases(), 1, kv.V, 0), 0))
	require.True(t, bytes.Equal(more, got), "the replica reads layer 1's V as written, across 2 chunk boundaries")

	require.NoError(t, rm.Shrink(l.Regions()))
	assert.Equal(t, 2*l.Regions(), rm.Chunks())
	assert.Equal(t, l.MappedBytes(2*l.Regions()), rm.Mapped())
}

func TestOrder(t *testing.T) {
	own := cudarttest.ForTest(t, cudarttest.WithGranularity(gran))
	m := newMap(t, own)
	require.ErrorIs(t, m.Import(1, nil), slabmap.ErrOrder, "chunk 1 before chunk 0")
	c, err := vmm.NewChunk(own, dev, 2*gran)
	require.NoError(t, err)
	defer func() { require.NoError(t, c.Close()) }()
	require.ErrorIs(t, m.Grow(c), kv.ErrGeometry, "a chunk of another size")
	assert.Zero(t, m.Chunks())
	var all []*vmm.Chunk
	for range m.Layout().Chunks() + 1 {
		c, err := vmm.NewChunk(own, dev, gran)
		require.NoError(t, err)
		defer func() { require.NoError(t, c.Close()) }()
		all = append(all, c)
	}
	require.ErrorIs(t, m.Grow(all...), slabmap.ErrOrder, "one chunk past the layout's")
	assert.Zero(t, m.Chunks(), "a failed Grow maps nothing")
	require.NoError(t, m.Grow(all[:m.Layout().Chunks()]...))
	require.ErrorIs(t, m.Shrink(m.Layout().Chunks()+1), vmm.ErrNotMapped)
	require.NoError(t, m.Close())
	require.ErrorIs(t, m.Grow(all[0]), vmm.ErrClosed)
}
