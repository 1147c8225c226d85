package replica_test

import (
	"bytes"
	"context"
	"encoding/binary"
	"fmt"
	"os"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/cudapool/cudapool/cudart"
	"github.com/cudapool/cudapool/cudart/cudarttest"
	"github.com/cudapool/cudapool/internal/proctest"
	"github.com/cudapool/cudapool/internal/testwait"
	"github.com/cudapool/cudapool/kv"
	"github.com/cudapool/cudapool/kv/owner"
	"github.com/cudapool/cudapool/kv/replica"
)

func TestMain(m *testing.M) {
	proctest.Main(m, roles)
}

// small is a geometry of 64 KiB slabs: two layers, pages of 256 bytes per layer's K.
var small = kv.Geometry{Layers: 2, KVHeads: 2, HeadDim: 8, TokensPerPage: 4, DType: kv.DTypeFP32, Pages: 64}

// bound is the context of waits that only a bug makes long.
func bound(t testing.TB) context.Context {
	ctx, cancel := context.WithTimeout(context.Background(), testwait.Bound)
	t.Cleanup(cancel)
	return ctx
}

// startOwner serves dir on a software device of its own (as a process of its own
// would), checked for broken rules at the end.
func startOwner(t testing.TB, g kv.Geometry, devices ...int) (*owner.Owner, *cudarttest.Device, string) {
	t.Helper()
	dir := shortDir(t)
	dev := cudarttest.ForTest(t)
	o, err := owner.Listen(dir, dev, g, owner.WithDevices(devices...))
	require.NoError(t, err)
	t.Cleanup(func() {
		o.Close(bound(t))
		require.NoError(t, dev.Err(), "the owner's device saw broken rules")
	})
	return o, dev, dir
}

// shortDir is a fresh directory with a path short enough for socket addresses.
func shortDir(t testing.TB) string {
	t.Helper()
	dir, err := os.MkdirTemp("", "kv")
	require.NoError(t, err)
	t.Cleanup(func() { os.RemoveAll(dir) })
	return dir
}

// dial connects a replica on a software device of its own (as another process).
func dial(t testing.TB, dir string, device int, opts ...replica.Option) (*replica.Replica, *cudarttest.Device, cudart.Stream) {
	t.Helper()
	dev := cudarttest.ForTest(t)
	r, err := replica.Dial(bound(t), dir, dev, device, opts...)
	require.NoError(t, err)
	s, err := dev.StreamCreate(device, cudart.StreamNonBlocking)
	require.NoError(t, err)
	t.Cleanup(func() {
		r.Close(bound(t))
		dev.StreamDestroy(device, s)
		require.NoError(t, dev.Err(), "a replica's device saw broken rules")
	})
	return r, dev, s
}

// tokens is a token list of n pages of g, different for each seed.
func tokens(g kv.Geometry, pages int, seed int32) []int32 {
	t := make([]int32, pages*g.TokensPerPage)
	for i := range t {
		t[i] = seed*100003 + int32(i)
	}
	return t
}

// pattern is what page p holds when written for hash h: every layer's K and V, each
// PageBytes long.
func pattern(g kv.Geometry, h kv.Hash, layer, kOrV int) []byte {
	b := make([]byte, g.PageBytes())
	for i := 0; i < len(b); i += 4 {
		binary.LittleEndian.PutUint32(b[i:], binary.LittleEndian.Uint32(h[:4])^uint32(i)^uint32(layer<<24)^uint32(kOrV<<30))
	}
	return b
}

// write queues the pattern of hashes[i] into page pages[i] on s, through r's mapping.
func write(t testing.TB, rt cudart.Runtime, r *replica.Replica, s cudart.Stream, pages []uint32, hashes []kv.Hash) {
	t.Helper()
	require.NoError(t, writeErr(rt, r, s, pages, hashes))
}

func writeErr(rt cudart.Runtime, r *replica.Replica, s cudart.Stream, pages []uint32, hashes []kv.Hash) error {
	g := r.Geometry()
	for i, p := range pages {
		for l := range g.Layers {
			for part := range 2 {
				if err := rt.MemcpyHtoDAsync(r.Device(), r.Addr(l, kv.Part(part), int(p)), pattern(g, hashes[i], l, part), s); err != nil {
					return err
				}
			}
		}
	}
	return nil
}

// check reads pages[i] through r's mapping on s and says how the first that does not
// hold hashes[i]'s pattern differs.
func check(rt cudart.Runtime, r *replica.Replica, s cudart.Stream, pages []uint32, hashes []kv.Hash) error {
	g := r.Geometry()
	got := make([]byte, g.PageBytes())
	for i, p := range pages {
		for l := range g.Layers {
			for part := range 2 {
				if err := rt.MemcpyDtoHAsync(r.Device(), got, r.Addr(l, kv.Part(part), int(p)), s); err != nil {
					return err
				}
				if want := pattern(g, hashes[i], l, part); !bytes.Equal(got, want) {
					return fmt.Errorf("page %d (hash %d), layer %d, %s: bytes differ from the pattern", p, i, l, kv.Part(part))
				}
			}
		}
	}
	return nil
}

// eventually waits until cond holds, failing t with what after testwait.Bound.
func eventually(t testing.TB, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(testwait.Bound)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("gave up after %v waiting for %s", testwait.Bound, what)
		}
		time.Sleep(time.Millisecond)
	}
}

// written allocs pages pages through r and writes the chain of seed into them, unsealed.
func written(t testing.TB, rt cudart.Runtime, r *replica.Replica, s cudart.Stream, seed int32, pages int) (*replica.Lease, []kv.Hash) {
	t.Helper()
	hashes := r.Hashes(tokens(r.Geometry(), pages, seed))
	l, err := r.Alloc(bound(t), pages)
	require.NoError(t, err)
	write(t, rt, r, s, l.Pages(), hashes)
	return l, hashes
}

// sealed writes and seals the chain of pages of seed through r, waiting until visible.
func sealed(t testing.TB, rt cudart.Runtime, r *replica.Replica, s cudart.Stream, seed int32, pages int) []kv.Hash {
	t.Helper()
	l, hashes := written(t, rt, r, s, seed, pages)
	res, err := r.Seal(bound(t), l, hashes, s, replica.WaitVisible())
	require.NoError(t, err)
	require.Equal(t, replica.SealResult{Visible: pages}, res)
	return hashes
}

// device0 is the owner's first slab's figures.
func device0(o *owner.Owner) kv.DeviceStats { return o.Stats().Devices[0] }
