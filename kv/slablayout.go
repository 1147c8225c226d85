package kv

import (
	"fmt"

	"github.com/dustin/go-humanize"

	"github.com/cudapool/cudapool/cudart"
)

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

// MaxChunks bounds the chunks of one slab at its bound: each is a descriptor the owner
// passes to every replica.
const MaxChunks = 1 << 16

// SlabLayout is how the slab of one [Geometry] lies in device memory on the VMM route:
// one region of addresses per tensor (K0, V0, K1, V1, ..., region 2*layer+part), each
// RegionBytes long, and chunks of ChunkBytes mapped into them. Chunk i maps into region
// i mod Regions() at offset (i div Regions())*ChunkBytes, so that the chunks, mapped in
// index order, fill the regions a step (Regions() chunks, one a region) at a time, each
// region from its start: with n chunks mapped, the first MappedPages(n) pages of every
// tensor are mapped, and a tensor is [Pages, TokensPerPage, KVHeads, HeadDim],
// contiguous, its address that of its region. Geometry.Pages is the bound: the pages of
// every chunk mapped (Chunks()). A SlabLayout is a value computed from its geometry
// and chunk size alone, so that the owner and every replica agree on it; the zero
// SlabLayout has no regions.
type SlabLayout struct {
	geo   Geometry
	chunk uint64
	steps int // chunks per region at the bound
}

// SlabLayout lays g's slab out in chunks of chunk bytes. An invalid geometry, a chunk
// size of 0 or one that makes more than [MaxChunks] chunks are refused with an error
// wrapping [ErrGeometry]. That chunk is a multiple of the device's granularity
// (vmm.Granularity) is the caller's to check.
func (g Geometry) SlabLayout(chunk uint64) (SlabLayout, error) {
	if err := g.Validate(); err != nil {
		return SlabLayout{}, err
	}
	if chunk == 0 {
		return SlabLayout{}, fmt.Errorf("%w: chunks of 0 bytes", ErrGeometry)
	}
	steps := (g.TensorBytes() + chunk - 1) / chunk
	if n := steps * 2 * uint64(g.Layers); n > MaxChunks {
		return SlabLayout{}, fmt.Errorf("%w: chunks of %s make %d for a slab of %s, over the %d one slab may have: take larger chunks",
			ErrGeometry, humanize.IBytes(chunk), n, humanize.IBytes(g.SlabBytes()), MaxChunks)
	}
	return SlabLayout{geo: g, chunk: chunk, steps: int(steps)}, nil
}

// TensorBytes is one layer's K (or V) tensor: Pages*PageBytes().
func (g Geometry) TensorBytes() uint64 { return uint64(g.Pages) * g.PageBytes() }

// Geometry is the geometry l lays out.
func (l SlabLayout) Geometry() Geometry { return l.geo }

// ChunkBytes is the size of every chunk.
func (l SlabLayout) ChunkBytes() uint64 { return l.chunk }

// Regions is the number of regions: two (K and V) a layer.
func (l SlabLayout) Regions() int { return 2 * l.geo.Layers }

// Steps is the chunks each region holds at the bound.
func (l SlabLayout) Steps() int { return l.steps }

// Chunks is the number of chunks at the bound: Regions()*Steps().
func (l SlabLayout) Chunks() int { return l.Regions() * l.steps }

// RegionBytes is the addresses one region reserves: Steps()*ChunkBytes(), at least a
// tensor's.
func (l SlabLayout) RegionBytes() uint64 { return uint64(l.steps) * l.chunk }

// ReservedBytes is the addresses of all the regions.
func (l SlabLayout) ReservedBytes() uint64 { return uint64(l.Regions()) * l.RegionBytes() }

// MappedBytes is the memory of n chunks.
func (l SlabLayout) MappedBytes(n int) uint64 { return uint64(n) * l.chunk }

// Region is the region of layer's part; layer must be in [0, Layers).
func (l SlabLayout) Region(layer int, p Part) int { return 2*layer + int(p&1) }

// ChunkPlace is where chunk i maps: its region and the offset in it. i must be in
// [0, Chunks()).
func (l SlabLayout) ChunkPlace(i int) (region int, offset uint64) {
	return i % l.Regions(), uint64(i/l.Regions()) * l.chunk
}

// MappedPages is how many pages (from page 0) lie whole in every tensor once chunks
// [0, n) are mapped, at most Geometry.Pages.
func (l SlabLayout) MappedPages(n int) int {
	if l.geo.Layers == 0 || n <= 0 {
		return 0
	}
	steps := uint64(min(n, l.Chunks()) / l.Regions())
	return int(min(uint64(l.geo.Pages), steps*l.chunk/l.geo.PageBytes()))
}

// ChunksFor is the fewest chunks, in whole steps, whose mapping holds pages pages
// (MappedPages(ChunksFor(pages)) >= pages), at most Chunks().
func (l SlabLayout) ChunksFor(pages int) int {
	if pages <= 0 {
		return 0
	}
	pages = min(pages, l.geo.Pages)
	steps := (uint64(pages)*l.geo.PageBytes() + l.chunk - 1) / l.chunk
	return int(steps) * l.Regions()
}

// Offset is where page's block of layer's part begins in its region (Region(layer,
// p)): page*PageBytes(). page must be in [0, Pages); consecutive pages are consecutive
// blocks.
func (l SlabLayout) Offset(page int) uint64 { return uint64(page) * l.geo.PageBytes() }

// Addr is the device address of page's block of layer's part, given the address of
// each region (bases[r] for region r) in the calling process.
func (l SlabLayout) Addr(bases []cudart.DevicePtr, layer int, p Part, page int) cudart.DevicePtr {
	return bases[l.Region(layer, p)] + cudart.DevicePtr(l.Offset(page))
}

func (l SlabLayout) String() string {
	return fmt.Sprintf("%d regions of %s, in chunks of %s", l.Regions(), humanize.IBytes(l.RegionBytes()), humanize.IBytes(l.chunk))
}

// DefaultSteps is the steps a region grows in at most, with chunks of
// [DefaultChunkBytes]: the slab maps its bound in at most this many growths, and a
// replica imports at most 2*Layers*DefaultSteps chunks.
const DefaultSteps = 8

// DefaultChunkBytes is the chunk size of g's slab where none is asked: the smallest
// multiple of granularity (the device's, vmm.Granularity) that lays each tensor out in
// at most [DefaultSteps] chunks. granularity must not be 0.
func DefaultChunkBytes(g Geometry, granularity uint64) uint64 {
	per := (g.TensorBytes() + DefaultSteps - 1) / DefaultSteps
	return max(granularity, (per+granularity-1)/granularity*granularity)
}
