package replica_test

import (
	"context"
	"fmt"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/cudapool/cudapool/cudart"
	"github.com/cudapool/cudapool/internal/gputest"
	"github.com/cudapool/cudapool/internal/proctest"
	"github.com/cudapool/cudapool/internal/testwait"
	"github.com/cudapool/cudapool/kv"
	"github.com/cudapool/cudapool/kv/owner"
	"github.com/cudapool/cudapool/kv/replica"
)

func init() { roles["gpureplica"] = gpuReplicaRole }

// gpuSlab is a slab of the example's geometry of 12 GiB at its bound: 32 tensors of
// 384 MiB, each a region of 8 chunks of 48 MiB (3072 pages a chunk).
func gpuSlab() kv.Geometry {
	g, _ := kv.Layout("llama-0.85b")
	g.Pages = 24576
	return g
}

// TestGPUSlabGrowsInPlace serves a slab on GPU 0 that starts with one step of chunks
// (a chunk a tensor, 3072 pages); a reader process dials it, then a writer process
// allocs 64 pages more than the step holds, so that the slab grows by a step as the
// reader stays connected, writes its pages through its mapping (across the boundary of
// the first and second chunk of every tensor) and seals them; the reader, which maps
// the growth it is sent, matches them and reads every layer's K and V back
// byte-exact. Each child says how long its dial took.
//
// On the GPU host:
//
//	cd kv/replica && CUDAPOOL_REQUIRE_GPU=1 ../../bin/gpu/kv_replica.test -test.v -test.run TestGPUSlabGrowsInPlace
func TestGPUSlabGrowsInPlace(t *testing.T) {
	rt := gputest.Runtime(t)
	g := gpuSlab()
	free, _, err := rt.MemGetInfo(0)
	require.NoError(t, err)
	if free < g.SlabBytes()+(4<<30) {
		t.Skipf("not run (needs %d GiB free on GPU 0, %d GiB are)", (g.SlabBytes()>>30)+4, free>>30)
	}
	dir := shortDir(t)
	o, err := owner.Listen(dir, rt, g)
	require.NoError(t, err)
	t.Cleanup(func() { assert.NoError(t, o.Close(bound(t))) })
	step := o.Layout().Regions()
	st := o.Stats()
	require.Equal(t, step, st.Devices[0].Chunks, "%v: one step at the start", o.Layout())
	pages := st.Devices[0].Pages + 64

	r := proctest.Start(t, "gpureplica", dir, "wait-read", strconv.Itoa(pages))
	dialed := r.Next()
	w := proctest.Start(t, "gpureplica", dir, "write", strconv.Itoa(pages))
	dialed2 := w.Next()
	w.Expect(fmt.Sprintf("sealed %d", pages))
	st = o.Stats()
	require.Equal(t, 2*step, st.Devices[0].Chunks, "the slab grew by a step")
	r.Send("go")
	r.Expect(fmt.Sprintf("mapped %d", 2*step))
	r.Expect(fmt.Sprintf("read %d", pages))
	t.Logf("%v: reader %s, writer %s", o.Layout(), dialed, dialed2)
	r.Finish()
	w.Finish()
}

// gpuReplicaRole is a replica on GPU 0 of dir (args[0]): "write N" allocs N pages,
// writes their pattern through every layer's tensors and seals them ("sealed N");
// "read N" matches them and checks every byte ("read N"); "wait-read N" waits for a
// command, says how many chunks it maps after a round trip ("mapped C"), then reads as
// "read N" does; "evict N" allocs N pages and gives them back ("evicted N"). First it
// says "dialed in MS".
func gpuReplicaRole(args []string) int {
	fail := func(err error) int { fmt.Println("error:", err); return 1 }
	rt, err := cudart.Load()
	if err != nil {
		return fail(err)
	}
	n, _ := strconv.Atoi(args[2])
	ctx, cancel := context.WithTimeout(context.Background(), testwait.Bound)
	defer cancel()
	t0 := time.Now()
	r, err := replica.Dial(ctx, args[0], rt, 0)
	if err != nil {
		return fail(err)
	}
	defer func() { _ = r.Close(ctx) }() // the answer given is what the test checks
	chunks, mapped := r.Mapped()
	fmt.Printf("dialed in %.1f ms (%v, %d chunks, %d pages mapped)\n", float64(time.Since(t0).Microseconds())/1e3, r.Layout(), chunks, mapped)
	s, err := rt.StreamCreate(0, cudart.StreamNonBlocking)
	if err != nil {
		return fail(err)
	}
	g := r.Geometry()
	hashes := r.Hashes(tokens(g, n, 42))
	switch args[1] {
	case "write":
		l, err := r.Alloc(ctx, n)
		if err != nil {
			return fail(err)
		}
		if err := writeErr(rt, r, s, l.Pages(), hashes); err != nil {
			return fail(err)
		}
		res, err := r.Seal(ctx, l, hashes, s, replica.WaitVisible())
		if err != nil {
			return fail(err)
		}
		fmt.Println("sealed", res.Visible)
	case "read", "wait-read":
		if args[1] == "wait-read" {
			for range proctest.Commands() {
				break
			}
			if _, err := r.Stats(ctx); err != nil { // a round trip: the growths sent before its reply are mapped
				return fail(err)
			}
			chunks, _ := r.Mapped()
			fmt.Println("mapped", chunks)
		}
		m, err := r.Match(ctx, hashes)
		if err != nil {
			return fail(err)
		}
		if err := check(rt, r, s, m.Pages(), hashes); err != nil {
			return fail(err)
		}
		if err := rt.StreamSynchronize(0, s); err != nil {
			return fail(err)
		}
		if err := r.Release(ctx, m, s); err != nil {
			return fail(err)
		}
		fmt.Println("read", len(m.Pages()))
	case "evict": // the host tier's test (hosttier_test.go)
		l, err := r.Alloc(ctx, n)
		if err != nil {
			return fail(err)
		}
		if err := r.Release(ctx, l, s); err != nil {
			return fail(err)
		}
		fmt.Println("evicted", n)
	default:
		return fail(fmt.Errorf("unknown mode %q", strings.Join(args[1:], " ")))
	}
	for range proctest.Commands() {
	}
	return 0
}
