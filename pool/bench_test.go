package pool

import (
	"context"
	"sync/atomic"
	"testing"
	"unsafe"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/cudapool/cudapool/cudart"
	"github.com/cudapool/cudapool/internal/gputest"
)

var benchSizes = []struct {
	name  string
	bytes uint64
}{{"1KiB", 1 << 10}, {"1MiB", 1 << 20}, {"64MiB", 64 << 20}}

// BenchmarkMallocFreePair is Pool.Alloc and Pool.Free of the same size on the same
// stream, from a pool shared as a POSIX fd, on the real runtime. It is named after
// bench/cref's loop of cudaMallocFromPoolAsync and cudaFreeAsync, which
// scripts/gpu-check.sh prints beside it, and has its shape: a synchronize every
// syncEvery pairs, and cref's statistic reported as ns/op (gputest.Batches).
func BenchmarkMallocFreePair(b *testing.B) {
	for _, size := range benchSizes {
		b.Run(size.name, func(b *testing.B) {
			rt := gputest.Runtime(b)
			e := newTestEnv(b, rt, nil)
			p := mustNew(b, rt)
			// The pool reserves its memory once, outside the timing.
			mustFree(b, mustAlloc(b, p, size.bytes, e.stream), e.stream)
			benchPairs(b, p, size.bytes, e.stream)
		})
	}
}

// BenchmarkAllocFree is BenchmarkMallocFreePair's loop through the cache ("hit": each
// Alloc takes the buffer the Free before it cached, calling nothing) and past it
// ("miss": a pool without a cache, each pair a cudaMallocFromPoolAsync and a
// cudaFreeAsync), on the software device ("soft") and on the GPU ("gpu", skipped
// without one). Compare hit/gpu and miss/gpu with cref's MallocFreePair run
// interleaved on the same vCPU (FACTS: timing noise).
func BenchmarkAllocFree(b *testing.B) {
	paths := []struct {
		name string
		opts []Option
	}{{"hit", []Option{WithCache(128 << 20)}}, {"miss", nil}}
	for _, path := range paths {
		for _, dev := range []string{"soft", "gpu"} {
			for _, size := range benchSizes {
				b.Run(path.name+"/"+dev+"/"+size.name, func(b *testing.B) {
					var rt cudart.Runtime
					if dev == "gpu" {
						rt = gputest.Runtime(b)
					} else {
						rt = softDevice(b)
					}
					e := newTestEnv(b, rt, nil)
					p := mustNew(b, rt, path.opts...)
					// The pool reserves its memory (and the cache its buffer) outside the timing.
					mustFree(b, mustAlloc(b, p, size.bytes, e.stream), e.stream)
					benchPairs(b, p, size.bytes, e.stream)
					require.NoError(b, p.Trim())
				})
			}
		}
	}
}

// syncEvery is the number of pairs between synchronizes, as in bench/cref.
const syncEvery = 10000

// benchPairs times Alloc+Free pairs; see BenchmarkMallocFreePair.
func benchPairs(b *testing.B, p *Pool, size uint64, s cudart.Stream) {
	ctx := context.Background()
	bt := gputest.NewBatches(syncEvery)
	b.ReportAllocs()
	for b.Loop() {
		buf, err := p.Alloc(ctx, size, s)
		if err != nil {
			b.Fatal(err)
		}
		if err := p.Free(buf, s); err != nil {
			b.Fatal(err)
		}
		if bt.Full() {
			if err := p.rt.StreamSynchronize(p.dev, s); err != nil {
				b.Fatal(err)
			}
			bt.Lap()
		}
	}
	b.StopTimer()
	bt.Report(b)
}

// nullRuntime answers the calls of an Alloc+Free pair at once, so that a benchmark on
// it times the pool's own bookkeeping. Other calls panic.
type nullRuntime struct {
	cudart.Runtime
	next atomic.Uint64
}

func (r *nullRuntime) DeviceAttribute(dev int, attr cudart.DeviceAttr) (int, error) { return 0x9, nil }
func (r *nullRuntime) AllocationGranularity(dev int, ht cudart.HandleType, recommended bool) (uint64, error) {
	return 2 << 20, nil
}
func (r *nullRuntime) MemPoolCreate(props cudart.PoolProps) (cudart.MemPool, error) { return 1, nil }
func (r *nullRuntime) MemPoolDestroy(dev int, p cudart.MemPool) error               { return nil }
func (r *nullRuntime) MallocFromPoolAsync(dev int, size uint64, p cudart.MemPool, s cudart.Stream) (cudart.DevicePtr, error) {
	return cudart.DevicePtr(r.next.Add(size)), nil
}
func (r *nullRuntime) FreeAsync(dev int, ptr cudart.DevicePtr, s cudart.Stream) error { return nil }
func (r *nullRuntime) StreamSynchronize(dev int, s cudart.Stream) error               { return nil }

// BenchmarkBookkeeping times an Alloc+Free pair on a runtime that does nothing: the
// pool's own cost per pair, serial and from all Ps at once. The hit variants go
// through the cache, which calls nothing; miss is the suite's miss path, a cache too
// small for the buffer.
func BenchmarkBookkeeping(b *testing.B) {
	p, err := New(&nullRuntime{}, 0)
	require.NoError(b, err)
	cached, err := New(&nullRuntime{}, 0, WithCache(64<<20))
	require.NoError(b, err)
	tooSmall, err := New(&nullRuntime{}, 0, WithCache(1))
	require.NoError(b, err)
	b.Run("serial", func(b *testing.B) { benchPairs(b, p, 1<<20, 0) })
	b.Run("parallel", func(b *testing.B) { benchParallel(b, p) })
	b.Run("miss/serial", func(b *testing.B) { benchPairs(b, tooSmall, 1<<20, 0) })
	b.Run("hit/serial", func(b *testing.B) { benchPairs(b, cached, 1<<20, 0) })
	b.Run("hit/parallel", func(b *testing.B) { benchParallel(b, cached) })
}

// benchParallel times Alloc+Free pairs from all Ps at once, each on a stream of its
// own (the null runtime takes any handle).
func benchParallel(b *testing.B, p *Pool) {
	var streams atomic.Uintptr
	b.ReportAllocs()
	b.RunParallel(func(pb *testing.PB) {
		s := cudart.Stream(streams.Add(1) + 2) // past the default streams' handles
		for pb.Next() {
			buf, err := p.Alloc(context.Background(), 1<<20, s)
			if err != nil {
				b.Error(err)
				return
			}
			if err := p.Free(buf, s); err != nil {
				b.Error(err)
				return
			}
		}
	})
}

// A Buffer is all that an Alloc allocates: it stays in Go's 96-byte size class on
// 64-bit platforms (the next is 112), so that a pair allocates and collects less.
func TestBufferStaysSmall(t *testing.T) {
	if unsafe.Sizeof(uintptr(0)) != 8 {
		t.Skip("the bound is for 64-bit platforms")
	}
	assert.LessOrEqual(t, unsafe.Sizeof(Buffer{}), uintptr(96), "Buffer's size")
}

// The pool's bookkeeping allocates nothing per pair beyond the *Buffer itself, through
// the driver and through the cache.
func TestAllocFreeAllocatesOnlyTheBuffer(t *testing.T) {
	for _, opts := range [][]Option{nil, {WithCache(64 << 20)}} {
		p, err := New(&nullRuntime{}, 0, opts...)
		require.NoError(t, err)
		ctx := context.Background()
		allocs := testing.AllocsPerRun(1000, func() {
			b, err := p.Alloc(ctx, 1<<20, 0)
			require.NoError(t, err)
			require.NoError(t, p.Free(b, 0))
		})
		assert.Equal(t, 1.0, allocs, "allocations per Alloc+Free pair, cache limit %d", p.cache.limit)
	}
}
