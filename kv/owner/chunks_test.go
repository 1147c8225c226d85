package owner_test

import (
	"bytes"
	"os"
	"path/filepath"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/cudapool/cudapool/cudart"
	"github.com/cudapool/cudapool/cudart/cudarttest"
	"github.com/cudapool/cudapool/internal/testwait"
	"github.com/cudapool/cudapool/kv"
	"github.com/cudapool/cudapool/kv/owner"
	"github.com/cudapool/cudapool/kv/replica"
	"github.com/cudapool/cudapool/vmm"
)

// fineDev is a software device of 4 KiB granularity: small's tensors (16 KiB) are 4
// chunks of 4 KiB, 16 pages each.
func fineDev(t *testing.T) *cudarttest.Device {
	return cudarttest.ForTest(t, cudarttest.WithGranularity(4096))
}

// keeperDir is a new directory that a keeper serves, until the test's end.
func keeperDir(t *testing.T) string {
	t.Helper()
	dir := tempDir(t)
	kp, err := owner.Keep(dir, fineDev(t), small)
	require.NoError(t, err)
	t.Cleanup(func() { assert.NoError(t, kp.Close(bound(t))) })
	return dir
}

// fillPages writes pageFill into pages through r, on d's stream s.
func fillPages(t *testing.T, d *cudarttest.Device, r *replica.Replica, s cudart.Stream, pages []uint32) {
	t.Helper()
	for _, p := range pages {
		for layer := range small.Layers {
			for _, part := range []kv.Part{kv.K, kv.V} {
				require.NoError(t, d.MemcpyHtoDAsync(0, r.Addr(layer, part, int(p)), pageFill(p, layer, part), s))
			}
		}
	}
}

// requireFilled requires pages, read through r on d's stream s, to hold what
// fillPages wrote into written (page i into written[i]).
func requireFilled(t *testing.T, d *cudarttest.Device, r *replica.Replica, s cudart.Stream, pages, written []uint32) {
	t.Helper()
	got := make([]byte, small.PageBytes())
	for i, p := range pages {
		for layer := range small.Layers {
			for _, part := range []kv.Part{kv.K, kv.V} {
				require.NoError(t, d.MemcpyDtoHAsync(0, got, r.Addr(layer, part, int(p)), s))
				require.NoError(t, d.StreamSynchronize(0, s))
				require.True(t, bytes.Equal(pageFill(written[i], layer, part), got), "page %d (written as %d) layer %d %v", p, written[i], layer, part)
			}
		}
	}
}

// pageFill is what page p of layer's part holds in the chunk tests.
func pageFill(p uint32, layer int, part kv.Part) []byte {
	b := make([]byte, small.PageBytes())
	for i := range b {
		b[i] = byte(int(p)*13 + layer*7 + int(part)*3 + i)
	}
	return b
}

// A page server over a keeper gives it each chunk as it makes it, the growths too;
// restarted, it takes them back and maps them: a replica that reconnects finds the
// same slab, and one that dials the new page server reads the bytes written before,
// through the chunks the keeper kept.
func TestRestartTakesBackTheSlabsChunks(t *testing.T) {
	dir := keeperDir(t)
	index := filepath.Join(dir, owner.IndexFile)
	opts := []owner.Option{owner.WithKeeper(nil), owner.WithIndex(index), owner.WithChunkBytes(4096), owner.WithInitialPages(1)}
	o, err := owner.Listen(dir, fineDev(t), small, opts...)
	require.NoError(t, err)
	step := o.Layout().Regions()
	require.Equal(t, step, o.Stats().Devices[0].Chunks)

	rdev := fineDev(t)
	r, err := replica.Dial(bound(t), dir, rdev, 0, replica.WithReconnect())
	require.NoError(t, err)
	t.Cleanup(func() { r.Close(bound(t)) })
	s, err := rdev.StreamCreate(0, cudart.StreamNonBlocking)
	require.NoError(t, err)
	l, err := r.Alloc(bound(t), 40) // past a step: the slab grows to 3 steps, 48 pages
	require.NoError(t, err)
	fillPages(t, rdev, r, s, l.Pages())
	hashes := r.Hashes(make([]int32, 40*small.TokensPerPage))
	_, err = r.Seal(bound(t), l, hashes, s, replica.WaitVisible())
	require.NoError(t, err)
	chunks := o.Stats().Devices[0].Chunks
	require.Equal(t, 3*step, chunks)

	b, err := owner.IndexNow(bound(t), o)
	require.NoError(t, err)
	require.NoError(t, o.Close(bound(t)))
	require.NoError(t, os.WriteFile(index, b, 0o600))
	o, err = owner.Listen(dir, fineDev(t), small, opts...)
	require.NoError(t, err)
	t.Cleanup(func() { assert.NoError(t, o.Close(bound(t))) })
	rec := o.Recovery()
	assert.True(t, rec.Adopted, "%v", rec)
	assert.Equal(t, 40, rec.Pages)
	assert.Equal(t, chunks, o.Stats().Devices[0].Chunks, "every chunk taken back")
	assert.Equal(t, 48, o.Stats().Devices[0].Pages)

	require.NoError(t, r.WaitAttached(bound(t)), "the replica reattaches to the same slab")
	n, _ := r.Mapped()
	assert.Equal(t, chunks, n)

	fresh := fineDev(t)
	r2, err := replica.Dial(bound(t), dir, fresh, 0)
	require.NoError(t, err)
	t.Cleanup(func() { r2.Close(bound(t)) })
	s2, err := fresh.StreamCreate(0, cudart.StreamNonBlocking)
	require.NoError(t, err)
	m, err := r2.Match(bound(t), hashes)
	require.NoError(t, err)
	require.Equal(t, l.Pages(), m.Pages())
	requireFilled(t, fresh, r2, s2, m.Pages(), l.Pages())
	require.NoError(t, r2.Release(bound(t), m, s2))
}

// A keeper's chunks of another chunk size are dropped, the slab made anew and the
// index with them, saying why.
func TestRestartDropsChunksOfAnotherLayout(t *testing.T) {
	dir := keeperDir(t)
	o, err := owner.Listen(dir, fineDev(t), small, owner.WithKeeper(nil), owner.WithChunkBytes(4096))
	require.NoError(t, err)
	require.NoError(t, o.Close(bound(t)))
	o, err = owner.Listen(dir, fineDev(t), small, owner.WithKeeper(nil), owner.WithChunkBytes(8192))
	require.NoError(t, err)
	t.Cleanup(func() { assert.NoError(t, o.Close(bound(t))) })
	rec := o.Recovery()
	assert.False(t, rec.Adopted)
	assert.Contains(t, rec.Dropped, "the keeper keeps chunks of 2x2x8x4xfp32x64-4096 (4096 bytes) for device 0, this owner serves 2x2x8x4xfp32x64-8192")
}

// A give-back of memory (the table's pages past a step given back, then GiveBack's
// unmapping) reaches every connected replica, which unmaps the chunks in place; the
// slab grows again afterwards, into new chunks, which every replica maps.
func TestGiveBackReachesEveryReplica(t *testing.T) {
	o, rs, _ := elastic(t, 2)
	step := o.Layout().Regions()
	l, err := rs[0].Alloc(bound(t), 40) // the slab grows to 3 steps, 48 pages
	require.NoError(t, err)
	require.NoError(t, rs[0].Release(bound(t), l, 0))
	require.Eventually(t, func() bool { return o.Stats().Devices[0].Free == 48 }, testwait.Bound, time.Millisecond, "the released pages settle")
	require.Equal(t, 3*step, o.Stats().Devices[0].Chunks)

	require.ErrorIs(t, owner.GiveBack(o, 0, step+1), kv.ErrGeometry, "not a whole step")
	require.NoError(t, owner.GiveBack(o, 0, step))
	st := o.Stats().Devices[0]
	assert.Equal(t, step, st.Chunks)
	assert.Equal(t, uint64(step*4096), st.MappedBytes)
	requireMapped(t, rs, step, 16)

	l, err = rs[1].Alloc(bound(t), 20) // grows again: chunks made anew where the old ones were
	require.NoError(t, err)
	chunks, _ := rs[1].Mapped()
	assert.Equal(t, 2*step, chunks)
	assert.Equal(t, 2*step, o.Stats().Devices[0].Chunks)
	require.NoError(t, rs[1].Release(bound(t), l, 0))
	_, err = rs[0].Stats(bound(t))
	require.NoError(t, err)
	chunks, _ = rs[0].Mapped()
	assert.Equal(t, 2*step, chunks, "the other replica maps the new growth")
}

// WithFabric makes FABRIC chunks: where the driver refuses them (no IMEX channel, as
// the software device by default) Listen fails saying so and leaves nothing; where it
// has one, replicas map the chunks through their descriptors as ever.
func TestFabricChunks(t *testing.T) {
	dir := filepath.Join(t.TempDir(), "kv")
	dev := cudarttest.ForTest(t)
	_, err := owner.Listen(dir, dev, small, owner.WithFabric())
	require.ErrorIs(t, err, vmm.ErrFabricNotPermitted)
	nothingLeft(t, dir, dev)

	dir = tempDir(t)
	o, err := owner.Listen(dir, cudarttest.ForTest(t, cudarttest.WithFabric()), small, owner.WithFabric())
	require.NoError(t, err)
	t.Cleanup(func() { assert.NoError(t, o.Close(bound(t))) })
	r, err := replica.Dial(bound(t), dir, cudarttest.ForTest(t), 0)
	require.NoError(t, err)
	chunks, pages := r.Mapped()
	assert.Equal(t, o.Layout().Regions(), chunks)
	assert.Equal(t, small.Pages, pages)
	require.NoError(t, r.Close(bound(t)))
}
