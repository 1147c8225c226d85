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

// gpuSlab is a 12 GiB slab of the example's geometry: 32 tensors of 384 MiB, 10 to a
// segment, so 4 segments. One allocation of that size kills an importer on driver 580
// (docs/FACTS.md 17).
func gpuSlab() kv.Geometry {
	g, _ := kv.Layout("llama-0.85b")
	g.Pages = 24576
	return g
}

// TestGPUSlabOfSegments serves a 12 GiB slab of 4 segments on GPU 0; a writer process
// writes pages through its mapping of every segment and seals them, and a reader
// process matches them and reads every layer's K and V back byte-exact through its
// own. Each child says how long its dial (every segment mapped) took.
//
// On the GPU host:
//
//	cd kv/replica && CUDAPOOL_REQUIRE_GPU=1 ../../bin/gpu/kv_replica.test -test.v -test.run TestGPUSlabOfSegments
func TestGPUSlabOfSegments(t *testing.T) {
	rt := gputest.Runtime(t)
	g := gpuSlab()
	free, _, err := rt.MemGetInfo(0)
	require.NoError(t, err)
	if free < g.SlabBytes()+(4<<30) {
		t.Skipf("not run (needs %d GiB free on GPU 0, %d GiB are)", (g.SlabBytes()>>30)+4, free>>30)
	}
	dir := shortDir(t)
	o, err := owner.Listen(dir, rt, g, owner.WithoutAnnounce())
	require.NoError(t, err)
	t.Cleanup(func() { assert.NoError(t, o.Close(bound(t))) })
	require.Equal(t, 4, o.Segments().Count(), "%v", o.Segments())

	const pages = 8
	w := proctest.Start(t, "gpureplica", dir, "write", strconv.Itoa(pages))
	dialed := w.Next()
	w.Expect(fmt.Sprintf("sealed %d", pages))
	r := proctest.Start(t, "gpureplica", dir, "read", strconv.Itoa(pages))
	dialed2 := r.Next()
	r.Expect(fmt.Sprintf("read %d", pages))
	t.Logf("%v: writer %s, reader %s", o.Segments(), dialed, dialed2)
	r.Finish()
	w.Finish()
}

// gpuReplicaRole is a replica on GPU 0 of dir (args[0]): "write N" allocs N pages,
// writes their pattern through every segment and seals them ("sealed N"); "read N"
// matches them and checks every byte ("read N"); "evict N" allocs N pages and gives
// them back ("evicted N"). First it says "dialed MS".
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
	fmt.Printf("dialed in %.1f ms (%v)\n", float64(time.Since(t0).Microseconds())/1e3, r.Segments())
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
	case "read":
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
