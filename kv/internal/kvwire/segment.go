package kvwire

import (
	"fmt"
	"strconv"

	"github.com/cudapool/cudapool/kv"
)

// SegmentMetaLen is the bytes of an encoded SegmentMeta.
const SegmentMetaLen = GeometryLen + 16

// SegmentName is the name segment seg of the slab published as slab (a SlabName) is
// published under.
func SegmentName(slab string, seg int) string { return slab + "/" + strconv.Itoa(seg) }

// SegmentMeta is the metadata every segment of a slab is published with: the slab's
// geometry and the bound its segments follow from (the segment map is
// Geometry.Segments(Bound)), their count and which one this is.
type SegmentMeta struct {
	Geometry     kv.Geometry
	Bound        uint64
	Count, Index int
}

// AppendSegmentMeta appends m's encoding: the geometry, u64 bound, u32 count, u32 index.
func AppendSegmentMeta(b []byte, m SegmentMeta) []byte {
	return appendU32(appendU32(appendU64(AppendGeometry(b, m.Geometry), m.Bound), uint32(m.Count)), uint32(m.Index))
}

// ParseSegmentMeta decodes a SegmentMeta encoded by AppendSegmentMeta and the segment
// map it names, checking that they agree.
func ParseSegmentMeta(b []byte) (SegmentMeta, kv.Segments, error) {
	r := NewParser(TypeWelcome, b)
	m := SegmentMeta{Geometry: r.Geometry(), Bound: r.U64()}
	m.Count, m.Index = int(r.U32()), int(r.U32())
	if err := r.Done(); err != nil {
		return SegmentMeta{}, kv.Segments{}, err
	}
	s, err := m.Geometry.Segments(m.Bound)
	if err != nil {
		return SegmentMeta{}, kv.Segments{}, err
	}
	if m.Count != s.Count() || m.Index >= m.Count {
		return SegmentMeta{}, kv.Segments{}, fmt.Errorf("%w: segment %d of %d, where the geometry makes %v", kv.ErrGeometry, m.Index, m.Count, s)
	}
	return m, s, nil
}
