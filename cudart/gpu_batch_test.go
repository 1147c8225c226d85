//go:build cgo && linux

package cudart_test

import (
	"math/rand/v2"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"golang.org/x/sys/unix"

	"github.com/cudapool/cudapool/cudart"
	"github.com/cudapool/cudapool/internal/gputest"
)

// TestGPUBatchCopy checks every way MemcpyBatchAsync copies (the kernel from PTX,
// cudaMemcpyBatchAsync, one copy per piece) on a memfd registered as pinned mapped
// host memory: scattered 16 KiB pieces (a KV page's) and pieces of any size and
// alignment, host to device and back, each compared with a byte-by-byte reference.
// The kernel must load on a GPU host: the fallbacks are for runtimes without it.
func TestGPUBatchCopy(t *testing.T) {
	gputest.Runtime(t)
	for _, path := range []cudart.CopyPath{cudart.CopyPathKernel, cudart.CopyPathBatch, cudart.CopyPathPieces} {
		t.Run(path.String(), func(t *testing.T) {
			rt, err := cudart.Load() // a runtime of its own: the path is chosen per runtime
			require.NoError(t, err)
			require.NoError(t, cudart.ForceBatchPath(rt, path))
			got, err := rt.BatchCopyPath(0)
			require.NoError(t, err)
			if v, err := rt.RuntimeVersion(); err == nil && v < 13000 && path == cudart.CopyPathBatch {
				t.Skipf("not run (runtime %d: cudapool calls cudaMemcpyBatchAsync from CUDA 13 on)", v)
			}
			if path != cudart.CopyPathPieces {
				require.Equal(t, path, got, "the %v path is not available", path)
			}
			checkBatchCopy(t, rt)
		})
	}
}

func checkBatchCopy(t *testing.T, rt cudart.Runtime) {
	const size = 64 << 20
	fd, err := unix.MemfdCreate("cudapool-batch-test", unix.MFD_CLOEXEC)
	require.NoError(t, err)
	defer func() { _ = unix.Close(fd) }() // cleanup: the mapping keeps the memory
	require.NoError(t, unix.Ftruncate(fd, size))
	host, err := unix.Mmap(fd, 0, size, unix.PROT_READ|unix.PROT_WRITE, unix.MAP_SHARED)
	require.NoError(t, err)
	defer func() { _ = unix.Munmap(host) }() // cleanup: the test is over
	require.NoError(t, rt.HostRegister(0, host, cudart.HostRegisterPortable|cudart.HostRegisterMapped))
	defer func() { assert.NoError(t, rt.HostUnregister(0, host)) }()
	hptr, err := rt.HostDevicePointer(0, host)
	require.NoError(t, err)
	f := newGPUFixture(t, rt, 0, cudart.PoolProps{})
	dev := f.malloc(t, size)
	defer f.free(t, dev)

	rng := rand.New(rand.NewPCG(1, 2))
	for i := 0; i < size; i += 8 {
		v := rng.Uint64()
		for k := range 8 {
			host[i+k] = byte(v >> (8 * k))
		}
	}
	ref := make([]byte, size)
	require.NoError(t, rt.MemsetAsync(0, dev, 0, size, f.stream))
	// Page-like pieces: 1,024 pieces of 16 KiB of host memory scattered over the first
	// half of the device buffer, then odd ones.
	var ps []cudart.CopyPiece
	slots := rng.Perm(size / 2 / (16 << 10))
	for i := range 1024 {
		from, to := i*(16<<10), slots[i]*(16<<10)
		ps = append(ps, cudart.CopyPiece{Dst: dev + cudart.DevicePtr(to), Src: hptr + cudart.DevicePtr(from), Size: 16 << 10})
		copy(ref[to:to+16<<10], host[from:from+16<<10])
	}
	at, from := size/2, size/2
	for range 300 {
		n := rng.IntN(5000)
		from += rng.IntN(29)
		ps = append(ps, cudart.CopyPiece{Dst: dev + cudart.DevicePtr(at), Src: hptr + cudart.DevicePtr(from), Size: uint64(n)})
		copy(ref[at:at+n], host[from:from+n])
		at += n + rng.IntN(17)
		from += n
	}
	require.NoError(t, rt.MemcpyBatchAsync(0, ps, f.stream))
	got := make([]byte, size)
	require.NoError(t, rt.MemcpyDtoHAsync(0, got, dev, f.stream))
	require.True(t, string(ref) == string(got), "host to device: %d bytes differ from the reference", differing(ref, got))

	// And back: every piece reversed into zeroed host memory.
	clear(host)
	clear(ref)
	for i := range ps {
		ps[i].Dst, ps[i].Src = ps[i].Src, ps[i].Dst
		off, from := int(ps[i].Dst-hptr), int(ps[i].Src-dev)
		copy(ref[off:off+int(ps[i].Size)], got[from:from+int(ps[i].Size)])
	}
	require.NoError(t, rt.MemcpyBatchAsync(0, ps, f.stream))
	require.NoError(t, rt.StreamSynchronize(0, f.stream))
	require.True(t, string(ref) == string(host), "device to host: %d bytes differ from the reference", differing(ref, host))
}

func differing(a, b []byte) int {
	n := 0
	for i := range a {
		if a[i] != b[i] {
			n++
		}
	}
	return n
}
