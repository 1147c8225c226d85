package replica_test

import (
	"bytes"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/cudapool/cudapool/cudart"
	"github.com/cudapool/cudapool/cudart/cudarttest"
	"github.com/cudapool/cudapool/kv"
	"github.com/cudapool/cudapool/kv/owner"
	"github.com/cudapool/cudapool/kv/replica"
)

// wide is a geometry of 3 layers, whose slab startOwner makes 2 segments of 3 tensors:
// layer 1's K ends segment 0 and its V begins segment 1.
var wide = kv.Geometry{Layers: 3, KVHeads: 2, HeadDim: 8, TokensPerPage: 4, DType: kv.DTypeFP16, Pages: 32}

// TestLayerPointersAcrossSegments writes pages through one replica's per-layer
// pointers (Layer, then page*PageBytes) and reads them back byte-exact through
// another's, on both sides of a segment boundary, the first and last page of every
// tensor included.
func TestLayerPointersAcrossSegments(t *testing.T) {
	o, _, dir := startOwner(t, wide)
	w, wdev, ws := dial(t, dir, 0)
	r, rdev, rs := dial(t, dir, 0)
	ctx := bound(t)
	g, pb := wide, wide.PageBytes()

	segs := r.Segments()
	require.Equal(t, 2, segs.Count())
	assert.Equal(t, o.Segments(), segs, "the replica's segment map is the owner's")
	require.Len(t, r.SegmentPtrs(), 2)
	assert.Equal(t, kv.Place{Segment: 0, Offset: 2 * g.TensorBytes()}, segs.Tensor(1, kv.K))
	assert.Equal(t, kv.Place{Segment: 1, Offset: 0}, segs.Tensor(1, kv.V))
	for l := range g.Layers {
		k, v := r.Layer(l)
		for part, ptr := range [2]cudart.DevicePtr{k, v} {
			pl := segs.Tensor(l, kv.Part(part))
			assert.Equal(t, r.SegmentPtrs()[pl.Segment]+cudart.DevicePtr(pl.Offset), ptr, "layer %d %v", l, kv.Part(part))
		}
	}

	l, err := w.Alloc(ctx, g.Pages) // every page: the first and the last of each tensor
	require.NoError(t, err)
	hashes := w.Hashes(tokens(g, g.Pages, 7))
	fill := func(page, layer, part int) []byte {
		b := make([]byte, pb)
		for i := range b {
			b[i] = byte(page*7 + layer*31 + part*101 + i)
		}
		return b
	}
	for i, p := range l.Pages() {
		for layer := range g.Layers {
			k, v := w.Layer(layer)
			for part, base := range [2]cudart.DevicePtr{k, v} {
				require.NoError(t, wdev.MemcpyHtoDAsync(0, base+cudart.DevicePtr(uint64(p)*pb), fill(i, layer, part), ws))
			}
		}
	}
	_, err = w.Seal(ctx, l, hashes, ws, replica.WaitVisible())
	require.NoError(t, err)

	m, err := r.Match(ctx, hashes)
	require.NoError(t, err)
	require.Len(t, m.Pages(), g.Pages)
	got := make([]byte, pb)
	for i, p := range m.Pages() {
		for layer := range g.Layers {
			k, v := r.Layer(layer)
			for part, base := range [2]cudart.DevicePtr{k, v} {
				require.NoError(t, rdev.MemcpyDtoHAsync(0, got, base+cudart.DevicePtr(uint64(p)*pb), rs))
				require.NoError(t, rdev.StreamSynchronize(0, rs))
				if !bytes.Equal(fill(i, layer, part), got) {
					t.Fatalf("page %d, layer %d %v: the bytes differ from what the writer wrote", p, layer, kv.Part(part))
				}
			}
		}
	}
	require.NoError(t, r.Release(ctx, m, rs))
}

// A slab whose segments' metadata names another geometry than the owner's Welcome is
// refused at Dial, saying both, and nothing of the refused Dial stays.
func TestDialRefusesSegmentsOfAnotherGeometry(t *testing.T) {
	o, _, realDir := startOwner(t, wide)
	other := wide
	other.Pages = 16
	dir, hangUp := welcomingOwner(t, realDir, other)
	dev := cudarttest.ForTest(t)
	_, err := replica.Dial(bound(t), dir, dev, 0)
	hangUp()
	require.ErrorIs(t, err, kv.ErrGeometry)
	assert.ErrorContains(t, err, "the slab's geometry (3 layers x 2 kv heads x 8 head dim, fp16, 4 tokens/page, 32 pages) is not the owner's (3 layers x 2 kv heads x 8 head dim, fp16, 4 tokens/page, 16 pages)")
	// Nothing of it is left: the same runtime dials the real owner (a second importer
	// of one exporter in a runtime is refused).
	r, err := replica.Dial(bound(t), realDir, dev, 0)
	require.NoError(t, err)
	assert.Equal(t, o.Segments(), r.Segments())
	require.NoError(t, r.Close(bound(t)))
	require.NoError(t, dev.Err())
}

// A 100 GiB slab of the example's geometry (32 segments of 3.1 GiB; the software
// device's memory is sparse) is mapped whole by each of 3 replicas at its dial, and
// pages written through one read back through another in the first and last segment.
func TestDialMapsA100GiBSlab(t *testing.T) {
	g, err := kv.Layout("llama-0.85b")
	require.NoError(t, err)
	g.Pages = 204800
	dir := shortDir(t)
	odev := cudarttest.ForTest(t, cudarttest.WithMemory(128<<30))
	o, err := owner.Listen(dir, odev, g, owner.WithoutAnnounce())
	require.NoError(t, err)
	t.Cleanup(func() {
		require.NoError(t, o.Close(bound(t)))
		require.NoError(t, odev.Err(), "the owner's device saw broken rules")
	})
	require.Equal(t, "32 segments of 3.1 GiB", o.Segments().String())
	w, wdev, ws := dial(t, dir, 0)
	r, rdev, rs := dial(t, dir, 0)
	third, _, _ := dial(t, dir, 0)
	for _, rp := range []*replica.Replica{w, r, third} {
		require.Len(t, rp.SegmentPtrs(), 32)
	}
	hashes := sealed(t, wdev, w, ws, 5, 2)
	m, err := r.Match(bound(t), hashes)
	require.NoError(t, err)
	require.NoError(t, check(rdev, r, rs, m.Pages(), hashes), "every layer's K and V: all 32 segments")
	require.NoError(t, r.Release(bound(t), m, rs))
}
