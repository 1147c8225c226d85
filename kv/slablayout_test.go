package kv_test

import (
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/cudapool/cudapool/cudart"
	"github.com/cudapool/cudapool/kv"
)

// Every byte of a mapped prefix of the chunks belongs to exactly one chunk, each
// region is filled from its start, and the pages said mapped lie whole in mapped
// chunks of every tensor.
func TestSlabLayoutChunksFillRegions(t *testing.T) {
	g := kv.Geometry{Layers: 3, KVHeads: 2, HeadDim: 4, TokensPerPage: 2, DType: kv.DTypeFP16, Pages: 7} // 32-byte pages, 224-byte tensors
	for _, chunk := range []uint64{32, 48, 64, 100, 224, 1000} {
		l, err := g.SlabLayout(chunk)
		require.NoError(t, err, "chunk %d", chunk)
		assert.GreaterOrEqual(t, l.RegionBytes(), g.TensorBytes(), "chunk %d: a region holds its tensor", chunk)
		assert.Less(t, l.RegionBytes()-g.TensorBytes(), chunk, "chunk %d: a region is no more chunks than its tensor needs", chunk)
		assert.Equal(t, g.Pages, l.MappedPages(l.Chunks()), "chunk %d: every chunk maps every page", chunk)
		for n := 0; n <= l.Chunks(); n++ {
			owner := make([][]int, l.Regions())
			for r := range owner {
				owner[r] = make([]int, l.RegionBytes())
			}
			for i := range n {
				r, off := l.ChunkPlace(i)
				for b := off; b < off+chunk; b++ {
					require.Zero(t, owner[r][b], "chunk %d: byte %d of region %d mapped twice", chunk, b, r)
					owner[r][b] = i + 1
				}
			}
			pages := l.MappedPages(n)
			for layer := range g.Layers {
				for _, p := range []kv.Part{kv.K, kv.V} {
					r := l.Region(layer, p)
					for pg := range pages {
						for b := l.Offset(pg); b < l.Offset(pg)+g.PageBytes(); b++ {
							require.NotZero(t, owner[r][b], "chunk %d, %d chunks: page %d of layer %d %v not mapped", chunk, n, pg, layer, p)
						}
					}
				}
			}
			if n%l.Regions() == 0 && pages < g.Pages {
				assert.Greater(t, l.ChunksFor(pages+1), n, "chunk %d: page %d needs a chunk past %d", chunk, pages, n)
			}
		}
		for pages := 0; pages <= g.Pages; pages++ {
			n := l.ChunksFor(pages)
			assert.GreaterOrEqual(t, l.MappedPages(n), pages, "chunk %d: ChunksFor(%d)", chunk, pages)
			assert.Zero(t, n%l.Regions(), "whole steps")
		}
	}
	bases := []cudart.DevicePtr{1000, 2000, 3000, 4000, 5000, 6000}
	l, err := g.SlabLayout(64)
	require.NoError(t, err)
	assert.Equal(t, cudart.DevicePtr(4000+3*32), l.Addr(bases, 1, kv.V, 3))
}

func TestSlabLayoutRefusals(t *testing.T) {
	g := kv.Geometry{Layers: 2, KVHeads: 1, HeadDim: 1, TokensPerPage: 1, DType: kv.DTypeFP32, Pages: 1 << 20}
	_, err := g.SlabLayout(0)
	require.ErrorIs(t, err, kv.ErrGeometry)
	_, err = g.SlabLayout(4)
	require.ErrorIs(t, err, kv.ErrGeometry, "a chunk a page makes 4 Mi chunks")
	assert.Contains(t, err.Error(), "take larger chunks")
	_, err = (kv.Geometry{}).SlabLayout(4)
	require.ErrorIs(t, err, kv.ErrGeometry)
}

func TestDefaultChunkBytes(t *testing.T) {
	g, err := kv.Layout("llama-0.85b")
	require.NoError(t, err)
	g.Pages = 100 // 1.6 MiB tensors
	assert.Equal(t, uint64(2<<20), kv.DefaultChunkBytes(g, 2<<20), "at least the granularity")
	g.Pages = 100_000 // 1.5 GiB tensors
	c := kv.DefaultChunkBytes(g, 2<<20)
	assert.Zero(t, c%(2<<20))
	l, err := g.SlabLayout(c)
	require.NoError(t, err)
	assert.Equal(t, kv.DefaultSteps, l.Steps())
}
