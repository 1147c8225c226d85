//go:build cgo

package main

import (
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/cudapool/cudapool/export"
)

// TestVMMCInterface runs testdata/vmm.c, built against the library as TestCInterface
// builds abi.c: a C producer makes two chunks, maps, writes and publishes them, and a
// consumer process of the same program opens the allocation and reads the bytes across
// the chunk boundary; every bad input to the VMM calls comes back as the status it
// names.
func TestVMMCInterface(t *testing.T) {
	require.Equal(t, export.MaxChunks, int(cudapoolMaxChunks), "CUDAPOOL_MAX_CHUNKS")
	out := runC(t, "testdata/vmm.c", buildC(t, "testdata/vmm.c"))
	require.Contains(t, out, "consumer: ", "the consumer process reported nothing")
	t.Logf("testdata/vmm.c:\n%s", out)
}
