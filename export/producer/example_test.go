package producer_test

import (
	"context"
	"fmt"
	"os"
	"path/filepath"

	"github.com/cudapool/cudapool/cudart"
	"github.com/cudapool/cudapool/cudart/cudarttest"
	"github.com/cudapool/cudapool/export/consumer"
	"github.com/cudapool/cudapool/export/discover"
	"github.com/cudapool/cudapool/export/producer"
	"github.com/cudapool/cudapool/pool"
)

// check stops the example at the first error, as a real program would handle it.
func check(err error) {
	if err != nil {
		panic(err)
	}
}

// A producer publishes a buffer, a consumer opens it, reads it and releases it. Two
// software devices stand for the two processes; on a GPU host each side would be its
// own process, with rt from cudart.Load.
func Example() {
	ctx := context.Background()
	dir, err := os.MkdirTemp("", "export-example")
	check(err)
	defer os.RemoveAll(dir)
	socket := filepath.Join(dir, "kv.sock")

	// The producer: a pool on device 0, a buffer filled on a stream, published.
	prodDev := cudarttest.New()
	defer prodDev.Close()
	ps, err := prodDev.StreamCreate(0, cudart.StreamNonBlocking)
	check(err)
	p, err := pool.New(prodDev, 0)
	check(err)
	buf, err := p.Alloc(ctx, 1<<20, ps)
	check(err)
	check(prodDev.MemsetAsync(0, buf.Ptr(), 42, buf.Size(), ps))
	ex, err := producer.Listen(socket, prodDev, producer.WithoutAnnounce())
	check(err)
	check(ex.Publish(ctx, "weights", buf, ps))

	// The consumer, on device 1: its stream waits for the producer's memset.
	consDev := cudarttest.New()
	defer consDev.Close()
	cs, err := consDev.StreamCreate(1, cudart.StreamNonBlocking)
	check(err)
	imp, err := consumer.Dial(ctx, socket, consDev, 1)
	check(err)
	m, err := imp.Open(ctx, "weights", cs)
	check(err)
	head := make([]byte, 4)
	check(consDev.MemcpyDtoHAsync(1, head, m.Ptr(), cs))
	fmt.Println(m.Name(), m.Size(), head)

	// Release orders the free of the import after the work on cs; the producer's
	// Free then waits for it.
	check(m.Release(ctx, cs))
	check(imp.Close(ctx))
	check(buf.Free(ps))
	check(ex.Close(ctx))
	_, err = p.Close(ctx)
	check(err)
	fmt.Println("violations:", prodDev.Err(), consDev.Err())
	// Output:
	// weights 1048576 [42 42 42 42]
	// violations: <nil> <nil>
}

// QueryState asks a running exporter what it holds, through the same admission policy
// as a consumer; it needs no CUDA runtime.
func ExampleQueryState() {
	ctx := context.Background()
	dir, err := os.MkdirTemp("", "export-example")
	check(err)
	defer os.RemoveAll(dir)
	rt := cudarttest.New()
	defer rt.Close()
	p, err := pool.New(rt, 0, pool.WithName("kv"))
	check(err)
	buf, err := p.Alloc(ctx, 3<<20, 0)
	check(err)
	ex, err := producer.Listen(filepath.Join(dir, "kv.sock"), rt, producer.WithAnnounceDir(dir), producer.WithName("producer"))
	check(err)
	check(ex.Publish(ctx, "cache", buf, 0))

	found, err := discover.Discover(dir)
	check(err)
	for _, a := range found {
		st, err := discover.QueryState(ctx, a.Socket)
		check(err)
		for _, ps := range st.Pools {
			fmt.Printf("%s: pool %s on device %d, %d buffer(s), %d MiB reserved, %d MiB of rounding\n",
				st.Name, ps.Name, ps.Device, ps.LiveBuffers, ps.ReservedCurrent>>20, ps.RoundingOverhead()>>20)
		}
		for _, n := range st.Published {
			fmt.Printf("published %q: %d bytes\n", n.Name, n.Size)
		}
	}
	check(ex.Close(ctx))
	check(buf.Free(0))
	_, err = p.Close(ctx)
	check(err)
	// Output:
	// producer: pool kv on device 0, 1 buffer(s), 4 MiB reserved, 1 MiB of rounding
	// published "cache": 3145728 bytes
}
