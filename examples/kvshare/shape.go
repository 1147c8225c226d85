package main

import (
	"errors"
	"fmt"
	"math/bits"

	"github.com/dustin/go-humanize"
)

// Shape is a KV cache: for each of Layers layers, a key and a value tensor of Tokens x
// Heads x HeadDim half-precision elements.
type Shape struct {
	Layers, Tokens, Heads, HeadDim int
}

const (
	bytesPerElement = 2 // fp16
	tensorsPerLayer = 2 // K and V
)

// GPUShape is the default on a GPU: Llama-3-8B-like (32 layers, 8 KV heads of 128) with
// a 32k-token system prompt, 4 GiB.
var GPUShape = Shape{Layers: 32, Tokens: 32768, Heads: 8, HeadDim: 128}

// TestShape is the default on the software test device: the same model with a 512-token
// prompt, 64 MiB, so that CI moves tens of MiB and not GiB.
var TestShape = Shape{Layers: 32, Tokens: 512, Heads: 8, HeadDim: 128}

// Bytes is the size of the cache. It is only meaningful for a shape that Validate accepts.
func (s Shape) Bytes() uint64 {
	return uint64(s.Layers) * uint64(s.Tokens) * uint64(s.Heads) * uint64(s.HeadDim) * bytesPerElement * tensorsPerLayer
}

// Validate says what is wrong with s, if anything: every dimension must be positive, the
// size must fit in 64 bits, and it must be a whole number of 8-byte words (the pattern's
// unit).
func (s Shape) Validate() error {
	dims := []struct {
		name string
		v    int
	}{{"layers", s.Layers}, {"tokens", s.Tokens}, {"heads", s.Heads}, {"head-dim", s.HeadDim}}
	size := uint64(bytesPerElement * tensorsPerLayer)
	for _, d := range dims {
		if d.v <= 0 {
			return fmt.Errorf("kv: %s must be positive, got %d", d.name, d.v)
		}
		hi, lo := bits.Mul64(size, uint64(d.v))
		if hi != 0 {
			return fmt.Errorf("kv: shape %s overflows 64 bits", s)
		}
		size = lo
	}
	if size%wordBytes != 0 {
		return errors.New("kv: the cache must be a whole number of 8-byte words: make one dimension even")
	}
	return nil
}

func (s Shape) String() string {
	return fmt.Sprintf("%d layers x %d tokens x %d heads x %d dims x K,V fp16 = %s",
		s.Layers, s.Tokens, s.Heads, s.HeadDim, humanize.IBytes(s.Bytes()))
}
