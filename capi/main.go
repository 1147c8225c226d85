//go:build cgo

// Command capi is libcudapool: cudapool's pools, sharing protocol and PyTorch
// allocator as a C shared library, for C, C++ and Python (python/cudapool) programs.
// Build it from the repository root with
//
//	go build -buildmode=c-shared -o bin/libcudapool.so ./capi
//
// and compile against capi/cudapool.h, the interface, which says what each call does.
//
// So built, the library offers the GPU only. Its test mode, where cudapool_init("test")
// and "auto" on a machine without a GPU run on cudapool's software device, is a build
// tag:
//
//	go build -buildmode=c-shared -tags cudapool_softdevice -o bin/libcudapool.so ./capi
//
// The library owns the C side of cudapool: turning C arguments into Go calls, the
// tables that give out opaque handles, the per-thread last-error message, and the
// allocator behind PyTorch's CUDAPluggableAllocator. No Go value crosses to C: objects
// are 64-bit handles looked up in a table, so a closed, foreign or made-up handle is an
// error and never a crash, and device addresses are integers.
//
// The public entry points are C functions (entry.c) that check, before entering Go,
// that the process was not forked since the library was loaded, because the Go
// runtime does not survive fork; they then call the cpgo_* functions of this package.
package main

func main() {}
