package kv_test

import (
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/cudapool/cudapool/cudart"
	"github.com/cudapool/cudapool/kv"
)

// Tensors are packed whole, in order, as many to a segment as the bound takes; every
// byte of the slab belongs to exactly one (layer, part, page) block.
func TestSegmentsPackTensorsWhole(t *testing.T) {
	g := kv.Geometry{Layers: 5, KVHeads: 2, HeadDim: 4, TokensPerPage: 2, DType: kv.DTypeFP16, Pages: 3} // 32-byte pages, 96-byte tensors
	for _, c := range []struct {
		bound uint64
		sizes []uint64
	}{
		{96, []uint64{96, 96, 96, 96, 96, 96, 96, 96, 96, 96}},
		{200, []uint64{192, 192, 192, 192, 192}},
		{300, []uint64{288, 288, 288, 96}},
		{960, []uint64{960}},
		{kv.MaxSegmentBytes, []uint64{960}},
	} {
		s, err := g.Segments(c.bound)
		require.NoError(t, err, "bound %d", c.bound)
		assert.Equal(t, c.sizes, s.Sizes(), "bound %d", c.bound)
		assert.Equal(t, len(c.sizes), s.Count())
		var total uint64
		for _, n := range s.Sizes() {
			assert.LessOrEqual(t, n, c.bound)
			total += n
		}
		assert.Equal(t, g.SlabBytes(), total, "the segments hold the slab")
		owner := make([][]int, s.Count())
		for i := range owner {
			owner[i] = make([]int, s.Bytes(i))
		}
		for l := range g.Layers {
			for _, p := range []kv.Part{kv.K, kv.V} {
				tp := s.Tensor(l, p)
				assert.LessOrEqual(t, tp.Offset+g.TensorBytes(), s.Bytes(tp.Segment), "layer %d %v lies in its segment", l, p)
				for pg := range g.Pages {
					pl := s.Page(l, p, pg)
					assert.Equal(t, tp.Segment, pl.Segment)
					assert.Equal(t, tp.Offset+uint64(pg)*g.PageBytes(), pl.Offset, "pages follow each other")
					for b := range g.PageBytes() {
						owner[pl.Segment][pl.Offset+b]++
					}
				}
			}
		}
		for i := range owner {
			for b, n := range owner[i] {
				require.Equal(t, 1, n, "bound %d: byte %d of segment %d", c.bound, b, i)
			}
		}
	}
	s, err := g.Segments(300)
	require.NoError(t, err)
	assert.Equal(t, kv.Place{1, 96}, s.Tensor(2, kv.K), "tensor 4 is the second of segment 1")
	assert.Equal(t, cudart.DevicePtr(2000+96+64), s.Addr([]cudart.DevicePtr{1000, 2000, 3000, 4000}, 2, kv.K, 2))
	assert.Equal(t, cudart.DevicePtr(4000+32), s.Addr([]cudart.DevicePtr{1000, 2000, 3000, 4000}, 4, kv.V, 1))
	assert.Equal(t, uint64(0), s.Bytes(4), "a segment s lacks")
	assert.Equal(t, "3 segments of 288 B and 1 of 96 B", s.String())
	assert.Equal(t, g, s.Geometry())
	assert.Equal(t, uint64(300), s.Bound())
}

// A tensor over the bound is refused, naming both sizes and the most pages that fit.
func TestSegmentsRefuseATensorOverTheBound(t *testing.T) {
	g, err := kv.Layout("llama-0.85b")
	require.NoError(t, err)
	g.Pages = 300_000 // 16 KiB pages: 4.6 GiB tensors
	_, err = g.Segments(kv.MaxSegmentBytes)
	require.ErrorIs(t, err, kv.ErrGeometry)
	assert.Contains(t, err.Error(), "tensor of 4.6 GiB")
	assert.Contains(t, err.Error(), "300000 pages of 16 KiB")
	assert.Contains(t, err.Error(), "over the 4.0 GiB")
	assert.Contains(t, err.Error(), "at most 262144 pages")
	g.Pages = 262144
	s, err := g.Segments(kv.MaxSegmentBytes)
	require.NoError(t, err, "a tensor of exactly the bound")
	assert.Equal(t, 32, s.Count())
	_, err = g.Segments(0)
	require.ErrorIs(t, err, kv.ErrGeometry, "a bound of 0")
	_, err = kv.Geometry{}.Segments(kv.MaxSegmentBytes)
	require.ErrorIs(t, err, kv.ErrGeometry, "an invalid geometry")
	assert.Equal(t, "no segments", kv.Segments{}.String())
}

// A 100 GiB slab of the example's geometry is 32 segments of 3.1 GiB.
func TestSegmentsOfALargeSlab(t *testing.T) {
	g, err := kv.Layout("llama-0.85b")
	require.NoError(t, err)
	g.Pages = int((100 << 30) / (2 * 16 * g.PageBytes()))
	s, err := g.Segments(kv.MaxSegmentBytes)
	require.NoError(t, err)
	assert.Equal(t, uint64(100<<30), g.SlabBytes())
	assert.Equal(t, "32 segments of 3.1 GiB", s.String())
}
