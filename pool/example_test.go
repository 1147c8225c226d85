package pool_test

import (
	"context"
	"fmt"
	"log"

	"github.com/dustin/go-humanize"

	"github.com/cudapool/cudapool/cudart"
	"github.com/cudapool/cudapool/cudart/cudarttest"
	"github.com/cudapool/cudapool/pool"
)

// A pool on device 0, one buffer allocated and freed on the legacy default stream.
// On a GPU the runtime comes from cudart.Load(); here it is the software device.
func Example() {
	rt := cudarttest.New()
	defer func() { _ = rt.Close() }() // test cleanup
	ctx := context.Background()

	p, err := pool.New(rt, 0, pool.WithName("activations"), pool.WithMaxSize(64<<20))
	if err != nil {
		log.Fatal(err)
	}
	b, err := p.Alloc(ctx, 1000, 0)
	if err != nil {
		log.Fatal(err)
	}
	fmt.Printf("asked %d bytes, own %d (the granularity is %d)\n", b.Size(), b.Reserved(), p.Granularity())
	if err := b.Free(0); err != nil {
		log.Fatal(err)
	}
	report, err := p.Close(ctx)
	if err != nil {
		log.Fatal(err)
	}
	fmt.Println(report)
	// Output:
	// asked 1000 bytes, own 2097152 (the granularity is 2097152)
	// pool "activations" closed: released 0 buffers (0 B)
}

// scratch needs device memory and does not care where it comes from.
func scratch(ctx context.Context, a pool.Allocator, s cudart.Stream) error {
	b, err := a.Alloc(ctx, 4096, s)
	if err != nil {
		return err
	}
	fmt.Printf("device %d: %d bytes\n", b.Device(), b.Size())
	return a.Free(b, s)
}

// The same code runs on an exportable pool, a local pool and the device's default
// pool.
func ExampleAllocator() {
	rt := cudarttest.New()
	defer func() { _ = rt.Close() }() // test cleanup
	ctx := context.Background()

	shared, err := pool.New(rt, 0)
	if err != nil {
		log.Fatal(err)
	}
	local, err := pool.New(rt, 1, pool.WithHandleType(cudart.HandleTypeNone))
	if err != nil {
		log.Fatal(err)
	}
	def, err := pool.FromDefault(rt, 0)
	if err != nil {
		log.Fatal(err)
	}
	for _, a := range []*pool.Pool{shared, local, def} {
		if err := scratch(ctx, a, 0); err != nil {
			log.Fatal(err)
		}
		if _, err := a.Close(ctx); err != nil {
			log.Fatal(err)
		}
	}
	// Output:
	// device 0: 4096 bytes
	// device 1: 4096 bytes
	// device 0: 4096 bytes
}

// countingAllocator is an Allocator of host-side fake addresses, as a test double for
// code that takes an Allocator: it hands out buffers made with pool.NewBuffer.
type countingAllocator struct {
	next, live uint64
}

func (a *countingAllocator) Alloc(ctx context.Context, size uint64, s cudart.Stream) (*pool.Buffer, error) {
	a.next += 1 << 20
	a.live++
	return pool.NewBuffer(a, cudart.DevicePtr(a.next), size), nil
}

func (a *countingAllocator) Free(b *pool.Buffer, s cudart.Stream) error {
	a.live--
	return nil
}

func (a *countingAllocator) Device() int { return 0 }

func (a *countingAllocator) Stats() (pool.Stats, error) {
	return pool.Stats{Name: "double", LiveBuffers: int(a.live)}, nil
}

// A test double stands in for a pool where code takes an Allocator.
func ExampleNewBuffer() {
	a := &countingAllocator{}
	if err := scratch(context.Background(), a, 0); err != nil {
		log.Fatal(err)
	}
	st, _ := a.Stats()
	fmt.Println(st.LiveBuffers, "live buffers left")
	// Output:
	// device 0: 4096 bytes
	// 0 live buffers left
}

// With a cache, a buffer freed on a stream serves the next Alloc of its size on that
// stream without calling the driver, export record included.
func ExampleWithCache() {
	rt := cudarttest.New()
	defer func() { _ = rt.Close() }() // test cleanup
	ctx := context.Background()
	p, err := pool.New(rt, 0, pool.WithName("kv"), pool.WithCache(256<<20))
	if err != nil {
		log.Fatal(err)
	}
	for range 3 {
		b, err := p.Alloc(ctx, 1<<20, 0)
		if err != nil {
			log.Fatal(err)
		}
		if err := b.Free(0); err != nil {
			log.Fatal(err)
		}
	}
	st, _ := p.Stats()
	fmt.Printf("%d hits, %d misses, %s cached\n", st.CacheHits, st.CacheMisses, humanize.IBytes(st.CachedBytes))
	report, err := p.Close(ctx)
	if err != nil {
		log.Fatal(err)
	}
	fmt.Println(report)
	// Output:
	// 2 hits, 1 misses, 2.0 MiB cached
	// pool "kv" closed: released 0 buffers (0 B), returned 1 cached buffers (2.0 MiB)
}
