package vmm_test

import (
	"fmt"

	"github.com/cudapool/cudapool/cudart"
	"github.com/cudapool/cudapool/cudart/cudarttest"
	"github.com/cudapool/cudapool/vmm"
)

// A reservation grows by a chunk in place: its address and the bytes mapped before
// stay as they were.
func ExampleReservation_Grow() {
	rt := cudarttest.New() // the software device; cudart.Load() for the GPU
	defer func() { _ = rt.Close() }()
	const dev = 0
	g, _ := vmm.Granularity(rt, dev, cudart.HandleTypePosixFD)
	r, err := vmm.Reserve(rt, dev, 4*g) // room for four chunks
	if err != nil {
		panic(err)
	}
	defer func() { _ = r.Close() }()
	for range 2 {
		c, err := vmm.NewChunk(rt, dev, g)
		if err != nil {
			panic(err)
		}
		before := r.Ptr()
		if err := r.Grow(c); err != nil {
			panic(err)
		}
		_ = c.Close() // the mapping keeps the memory
		fmt.Println(r.Chunks(), "chunks,", r.Mapped()/g, "of", r.Reserved()/g, "granules mapped; moved:", r.Ptr() != before)
	}
	// Output:
	// 1 chunks, 1 of 4 granules mapped; moved: false
	// 2 chunks, 2 of 4 granules mapped; moved: false
}
