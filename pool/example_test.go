package pool_test

import (
	"context"
	"fmt"
	"log"

	"github.com/cudapool/cudapool/cudart"
	"github.com/cudapool/cudapool/cudart/cudarttest"
	"github.com/cudapool/cudapool/pool"
)

// A pool on device 0, one buffer allocated and freed on the legacy default stream.
// On a GPU the runtime comes from cudart.Load(); here it is the software device.
func Example() {
	rt := cudarttest.New()
	defer rt.Close()
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
	// pool "activations" closed: released 0 buffers (0 bytes)
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
	defer rt.Close()
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

// A buffer shared with another process: Free while it is leased only marks it, and
// the memory goes back to the pool when the last lease ends.
func ExampleBuffer_Lease() {
	rt := cudarttest.New()
	defer rt.Close()
	ctx := context.Background()
	p, err := pool.New(rt, 0)
	if err != nil {
		log.Fatal(err)
	}
	b, err := p.Alloc(ctx, 1<<20, 0)
	if err != nil {
		log.Fatal(err)
	}
	lease, err := b.Lease() // before the record leaves the process
	if err != nil {
		log.Fatal(err)
	}
	if _, err := b.ExportRecord(); err != nil { // the 64 bytes an importer needs
		log.Fatal(err)
	}
	if err := b.Free(0); err != nil {
		log.Fatal(err)
	}
	st, _ := p.Stats()
	fmt.Println("after Free:", st.LiveBuffers, "live,", st.DeferredFrees, "deferred")
	// The importer freed its import and synchronized: no event to wait for.
	if err := lease.End(0); err != nil {
		log.Fatal(err)
	}
	st, _ = p.Stats()
	fmt.Println("after End:", st.LiveBuffers, "live,", st.DeferredFrees, "deferred")
	if _, err := p.Close(ctx); err != nil {
		log.Fatal(err)
	}
	// Output:
	// after Free: 1 live, 1 deferred
	// after End: 0 live, 0 deferred
}
