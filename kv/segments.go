package kv

import (
	"fmt"

	"github.com/dustin/go-humanize"

	"github.com/cudapool/cudapool/cudart"
)

// MaxSegmentBytes is the largest allocation a slab is made of: a replica imports each
// segment as one allocation (cudaMemPoolImportPointer), and on driver 580 that import
// kills the importing process for allocations between 4.5 and 6 GiB and above, while
// 4 GiB ones import and read right (docs/FACTS.md, item 17).
const MaxSegmentBytes uint64 = 4 << 30

// Part is one of the two tensors of a layer: its keys (K) or its values (V).
type Part uint8

// The parts of a layer.
const (
	K Part = 0
	V Part = 1
)

func (p Part) String() string {
	switch p {
	case K:
		return "K"
	case V:
		return "V"
	}
	return fmt.Sprintf("part(%d)", uint8(p))
}

// Place is where bytes of a slab lie: an offset in one of its segments.
type Place struct {
	Segment int
	Offset  uint64
}

// Segments is how the slab of one [Geometry] lies in its allocations (segments): the
// tensors K0, V0, K1, V1, ... in that order, each [Pages, TokensPerPage, KVHeads,
// HeadDim] and contiguous, packed whole into segments of at most the bound, as many
// to a segment as fit. Every segment but the last holds the same number of tensors.
// A Segments is a value computed from its geometry and bound alone, so that the owner
// and every replica agree on it; the zero Segments has no segments.
type Segments struct {
	geo   Geometry
	bound uint64
	per   int // tensors per segment
	count int
}

// Segments lays g's slab out in segments of at most bound bytes. A geometry whose one
// tensor (a layer's K or V) is over bound is refused with an error wrapping
// [ErrGeometry] that names both sizes and the most pages that fit, as is an invalid
// geometry.
func (g Geometry) Segments(bound uint64) (Segments, error) {
	if err := g.Validate(); err != nil {
		return Segments{}, err
	}
	t := g.TensorBytes()
	if t > bound {
		return Segments{}, fmt.Errorf("%w: one layer's K (or V) tensor of %s (%d pages of %s) is over the %s one segment may hold (an allocation a replica can import): at most %d pages",
			ErrGeometry, humanize.IBytes(t), g.Pages, humanize.IBytes(g.PageBytes()), humanize.IBytes(bound), bound/g.PageBytes())
	}
	tensors := 2 * g.Layers
	per := int(min(bound/t, uint64(tensors)))
	return Segments{geo: g, bound: bound, per: per, count: (tensors + per - 1) / per}, nil
}

// TensorBytes is one layer's K (or V) tensor: Pages*PageBytes().
func (g Geometry) TensorBytes() uint64 { return uint64(g.Pages) * g.PageBytes() }

// Geometry is the geometry s lays out.
func (s Segments) Geometry() Geometry { return s.geo }

// Bound is the most bytes one segment may hold.
func (s Segments) Bound() uint64 { return s.bound }

// Count is the number of segments.
func (s Segments) Count() int { return s.count }

// Bytes is the size of segment seg: the tensors it holds; 0 for a segment s lacks.
func (s Segments) Bytes(seg int) uint64 {
	if seg < 0 || seg >= s.count {
		return 0
	}
	n := min(s.per, 2*s.geo.Layers-seg*s.per)
	return uint64(n) * s.geo.TensorBytes()
}

// Sizes is every segment's size, in order; they add up to the slab's SlabBytes.
func (s Segments) Sizes() []uint64 {
	sizes := make([]uint64, s.count)
	for i := range sizes {
		sizes[i] = s.Bytes(i)
	}
	return sizes
}

// Tensor is where layer's part begins; the tensor lies wholly in that segment.
// layer must be in [0, Layers).
func (s Segments) Tensor(layer int, p Part) Place {
	t := 2*layer + int(p&1)
	return Place{Segment: t / s.per, Offset: uint64(t%s.per) * s.geo.TensorBytes()}
}

// Page is where page's block of layer's part begins: PageBytes() bytes, in the
// segment of the tensor. page must be in [0, Pages); consecutive pages are
// consecutive blocks.
func (s Segments) Page(layer int, p Part, page int) Place {
	pl := s.Tensor(layer, p)
	pl.Offset += uint64(page) * s.geo.PageBytes()
	return pl
}

// Addr is the device address of page's block of layer's part, given the address of
// each segment (bases[i] for segment i) in the calling process.
func (s Segments) Addr(bases []cudart.DevicePtr, layer int, p Part, page int) cudart.DevicePtr {
	pl := s.Page(layer, p, page)
	return bases[pl.Segment] + cudart.DevicePtr(pl.Offset)
}

func (s Segments) String() string { return SegmentsString(s.Sizes()) }

// SegmentsString says how a slab lies in segments of sizes, as [Segments.String] does:
// "32 segments of 3.1 GiB", "5 segments of 3.8 GiB and 1 of 1.3 GiB".
func SegmentsString(sizes []uint64) string {
	switch len(sizes) {
	case 0:
		return "no segments"
	case 1:
		return "1 segment of " + humanize.IBytes(sizes[0])
	}
	first, last := sizes[0], sizes[len(sizes)-1]
	if first == last {
		return fmt.Sprintf("%d segments of %s", len(sizes), humanize.IBytes(first))
	}
	many := "segments"
	if len(sizes) == 2 {
		many = "segment"
	}
	return fmt.Sprintf("%d %s of %s and 1 of %s", len(sizes)-1, many, humanize.IBytes(first), humanize.IBytes(last))
}
