package kvwire

import (
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/cudapool/cudapool/kv"
)

func TestSegmentMeta(t *testing.T) {
	g := kv.Geometry{Layers: 3, KVHeads: 4, HeadDim: 5, TokensPerPage: 6, DType: kv.DTypeFP16, Pages: 7}
	m := SegmentMeta{Geometry: g, Bound: 2 * g.TensorBytes(), Count: 3, Index: 2}
	b := AppendSegmentMeta(nil, m)
	require.Len(t, b, SegmentMetaLen)
	got, s, err := ParseSegmentMeta(b)
	require.NoError(t, err)
	assert.Equal(t, m, got)
	assert.Equal(t, 3, s.Count())
	for _, bad := range []SegmentMeta{
		{Geometry: g, Bound: 2 * g.TensorBytes(), Count: 2, Index: 0}, // a count the bound does not make
		{Geometry: g, Bound: 2 * g.TensorBytes(), Count: 3, Index: 3}, // an index past the count
		{Geometry: g, Bound: g.TensorBytes() - 1, Count: 6, Index: 0}, // a tensor over the bound
		{Geometry: kv.Geometry{}, Bound: 1 << 30, Count: 1, Index: 0}, // no geometry
	} {
		_, _, err := ParseSegmentMeta(AppendSegmentMeta(nil, bad))
		assert.ErrorIs(t, err, kv.ErrGeometry, "%+v", bad)
	}
	_, _, err = ParseSegmentMeta(b[:len(b)-1])
	assert.Error(t, err, "a truncated one")
	_, _, err = ParseSegmentMeta(AppendGeometry(nil, g))
	assert.Error(t, err, "a bare geometry (an owner from before segments)")
	assert.Equal(t, "kv/slab/1/12", SegmentName(SlabName(1), 12))
}
