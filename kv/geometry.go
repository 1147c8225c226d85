package kv

import (
	"fmt"
	"slices"
	"strings"
)

// DType is the element type of a KV cache.
type DType uint8

// The element types a slab may hold.
const (
	DTypeBF16 DType = iota + 1
	DTypeFP16
	DTypeFP32
	DTypeFP8E4M3
)

// Size is the bytes of one element; 0 for an unknown [DType].
func (d DType) Size() int {
	switch d {
	case DTypeBF16, DTypeFP16:
		return 2
	case DTypeFP32:
		return 4
	case DTypeFP8E4M3:
		return 1
	}
	return 0
}

func (d DType) String() string {
	switch d {
	case DTypeBF16:
		return "bf16"
	case DTypeFP16:
		return "fp16"
	case DTypeFP32:
		return "fp32"
	case DTypeFP8E4M3:
		return "fp8e4m3"
	}
	return fmt.Sprintf("dtype(%d)", uint8(d))
}

// ParseDType is the [DType] whose String is s (case-insensitive).
func ParseDType(s string) (DType, error) {
	for d := DTypeBF16; d <= DTypeFP8E4M3; d++ {
		if strings.EqualFold(s, d.String()) {
			return d, nil
		}
	}
	return 0, fmt.Errorf("%w: unknown dtype %q (want bf16, fp16, fp32 or fp8e4m3)", ErrGeometry, s)
}

// Geometry is the shape of a slab: its pages and what one page holds.
type Geometry struct {
	Layers, KVHeads, HeadDim, TokensPerPage int
	DType                                   DType
	// Pages is the number of pages per slab (per GPU).
	Pages int
}

// maxDim bounds each dimension so that every size fits a uint64 with room to spare.
const maxDim = 1 << 20

// Validate says why g cannot describe a slab, or nil.
func (g Geometry) Validate() error {
	for _, d := range []struct {
		name string
		v    int
	}{{"layers", g.Layers}, {"kv heads", g.KVHeads}, {"head dim", g.HeadDim}, {"tokens per page", g.TokensPerPage}, {"pages", g.Pages}} {
		if d.v < 1 || d.v > maxDim {
			return fmt.Errorf("%w: %s %d out of range [1, %d]", ErrGeometry, d.name, d.v, maxDim)
		}
	}
	if g.DType.Size() == 0 {
		return fmt.Errorf("%w: unknown dtype %d", ErrGeometry, uint8(g.DType))
	}
	if g.PageBytes() > 1<<32 {
		return fmt.Errorf("%w: a page of %d bytes per layer is over 4 GiB", ErrGeometry, g.PageBytes())
	}
	if g.SlabBytes() > 1<<50 {
		return fmt.Errorf("%w: a slab of %d bytes is over 1 PiB", ErrGeometry, g.SlabBytes())
	}
	return nil
}

// PageBytes is one layer's K (or V) of one page: TokensPerPage*KVHeads*HeadDim elements.
func (g Geometry) PageBytes() uint64 {
	return uint64(g.TokensPerPage) * uint64(g.KVHeads) * uint64(g.HeadDim) * uint64(g.DType.Size())
}

// PageSpanBytes is one page in every layer's K and V, Layers*2*PageBytes(): what a
// page holds of the slab (the page bytes of the API are one layer's K or V).
func (g Geometry) PageSpanBytes() uint64 {
	return uint64(g.Layers) * 2 * g.PageBytes()
}

// SlabBytes is the whole slab: Layers*2*Pages*PageBytes().
func (g Geometry) SlabBytes() uint64 {
	return uint64(g.Layers) * 2 * uint64(g.Pages) * g.PageBytes()
}

func (g Geometry) String() string {
	return fmt.Sprintf("%d layers x %d kv heads x %d head dim, %s, %d tokens/page, %d pages", g.Layers, g.KVHeads, g.HeadDim, g.DType, g.TokensPerPage, g.Pages)
}

// layouts are the named geometries, Pages left to the caller.
// llama-0.85b: 16 layers, 8 KV heads of 64 elements, bf16, 16 tokens a page: a page's
// bytes are 16 KiB (one layer's K), its span 512 KiB (every layer's K and V).
var layouts = map[string]Geometry{
	"llama-0.85b": {Layers: 16, KVHeads: 8, HeadDim: 64, TokensPerPage: 16, DType: DTypeBF16},
}

// Layout returns the named geometry, with Pages 0 for the caller to choose.
func Layout(name string) (Geometry, error) {
	g, ok := layouts[name]
	if !ok {
		return Geometry{}, fmt.Errorf("%w: unknown layout %q (known: %s)", ErrGeometry, name, strings.Join(LayoutNames(), ", "))
	}
	return g, nil
}

// LayoutNames lists the named layouts, sorted.
func LayoutNames() []string {
	names := make([]string, 0, len(layouts))
	for n := range layouts {
		names = append(names, n)
	}
	slices.Sort(names)
	return names
}
