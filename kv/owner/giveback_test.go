package owner_test

import (
	"os"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/cudapool/cudapool/cudart"
	"github.com/cudapool/cudapool/cudart/cudarttest"
	"github.com/cudapool/cudapool/internal/testwait"
	"github.com/cudapool/cudapool/kv/owner"
	"github.com/cudapool/cudapool/kv/replica"
)

// elastic is a page server on a new directory, its slab of 4 KiB chunks (fineDev)
// starting at one step, with opts, and n replicas dialed to it, each on a device of
// its own (devs).
func elastic(t *testing.T, n int, opts ...owner.Option) (o *owner.Owner, rs []*replica.Replica, devs []*cudarttest.Device) {
	t.Helper()
	dir, err := os.MkdirTemp("", "kvc")
	require.NoError(t, err)
	t.Cleanup(func() { os.RemoveAll(dir) })
	o, err = owner.Listen(dir, fineDev(t), small, append([]owner.Option{owner.WithChunkBytes(4096), owner.WithInitialPages(1)}, opts...)...)
	require.NoError(t, err)
	t.Cleanup(func() { assert.NoError(t, o.Close(bound(t))) })
	for range n {
		d := fineDev(t)
		r, err := replica.Dial(bound(t), dir, d, 0)
		require.NoError(t, err)
		t.Cleanup(func() { r.Close(bound(t)) })
		rs, devs = append(rs, r), append(devs, d)
	}
	return o, rs, devs
}

// requireMapped requires each of rs, after a round trip (a Shrink frame is read
// before the reply), to map chunks chunks holding pages pages.
func requireMapped(t *testing.T, rs []*replica.Replica, chunks, pages int) {
	t.Helper()
	for _, r := range rs {
		_, err := r.Stats(bound(t))
		require.NoError(t, err)
		c, p := r.Mapped()
		assert.Equal(t, chunks, c, "the replica maps the chunks the slab has")
		assert.Equal(t, pages, p)
	}
}

// While the device's free memory (a fake source here) is below WithMinFree, the
// owner gives the slab's last chunks back, down to one step: never while a lease
// holds a page in them (the give-back waits for its release), every replica unmaps
// them, and the slab does not grow meanwhile; once memory is free again it grows.
func TestGiveBackUnderMemoryPressure(t *testing.T) {
	var free atomic.Uint64
	free.Store(1 << 40)
	t.Cleanup(owner.SetFreeMemory(func(int) (uint64, error) { return free.Load(), nil }))
	o, rs, _ := elastic(t, 2, owner.WithMinFree(1<<20))
	step := o.Layout().Regions()
	l, err := rs[0].Alloc(bound(t), 40) // the slab grows to 3 steps, 48 pages
	require.NoError(t, err)
	require.Equal(t, 3*step, o.Stats().Devices[0].Chunks)
	looked := func(n uint64) { // waits for n more looks of the give-back
		at := owner.GiveBackTicks(o, 0)
		require.Eventually(t, func() bool { return owner.GiveBackTicks(o, 0) >= at+n }, testwait.Bound, time.Millisecond)
	}
	looked(1)
	assert.Equal(t, 3*step, o.Stats().Devices[0].Chunks, "memory is not short")

	free.Store(0) // short: give back all but a step, but the write lease holds pages past it
	looked(3)
	st := o.Stats().Devices[0]
	assert.Equal(t, 3*step, st.Chunks, "a leased page is never given back")
	assert.Equal(t, 48, st.Pages)

	require.NoError(t, rs[0].Release(bound(t), l, 0))
	require.Eventually(t, func() bool { return o.Stats().Devices[0].Chunks == step }, testwait.Bound, time.Millisecond, "given back once released")
	st = o.Stats().Devices[0]
	assert.Equal(t, 16, st.Pages)
	assert.Equal(t, uint64(step*4096), st.MappedBytes)
	requireMapped(t, rs, step, 16)
	l, err = rs[1].Alloc(bound(t), 10) // fits in the step kept
	require.NoError(t, err)
	require.NoError(t, rs[1].Release(bound(t), l, 0))
	looked(2)
	assert.Equal(t, step, o.Stats().Devices[0].Chunks, "no growth while memory is short")

	free.Store(1 << 40) // memory again: the bound on growth is lifted
	looked(2)
	require.Eventually(t, func() bool { return o.Stats().Devices[0].Free == 16 }, testwait.Bound, time.Millisecond, "the released pages settle")
	l, err = rs[1].Alloc(bound(t), 20)
	require.NoError(t, err)
	assert.Equal(t, 2*step, o.Stats().Devices[0].Chunks, "grown again")
	require.NoError(t, rs[1].Release(bound(t), l, 0))
}

// A give-back copies the sealed pages it evicts to the host tier: a match of their
// hashes afterwards restores them into the step kept, every byte as written.
func TestGiveBackKeepsPagesInTheHostTier(t *testing.T) {
	var free atomic.Uint64
	free.Store(1 << 40)
	t.Cleanup(owner.SetFreeMemory(func(int) (uint64, error) { return free.Load(), nil }))
	o, rs, devs := elastic(t, 1, owner.WithMinFree(1<<20), owner.WithHostBytes(64*small.PageSpanBytes()))
	step := o.Layout().Regions()
	r, d := rs[0], devs[0]
	s, err := d.StreamCreate(0, cudart.StreamNonBlocking)
	require.NoError(t, err)
	l, err := r.Alloc(bound(t), 40) // grown to 3 steps: pages 16..47 first, then 0..7
	require.NoError(t, err)
	fillPages(t, d, r, s, l.Pages())
	hashes := r.Hashes(make([]int32, 40*small.TokensPerPage))
	_, err = r.Seal(bound(t), l, hashes, s, replica.WaitVisible())
	require.NoError(t, err)
	written := l.Pages()
	require.GreaterOrEqual(t, written[0], uint32(16), "the first pages are past the step kept")

	free.Store(0)
	require.Eventually(t, func() bool { return o.Stats().Devices[0].Chunks == step }, testwait.Bound, time.Millisecond, "given back")
	st := o.Stats().Devices[0]
	require.NotNil(t, st.Host)
	assert.GreaterOrEqual(t, st.Host.Sealed, 32, "every sealed page given back is in the host tier")

	m, err := r.Match(bound(t), hashes[:12])
	require.NoError(t, err)
	require.Len(t, m.Pages(), 12, "restored into the step kept")
	for _, p := range m.Pages() {
		require.Less(t, p, uint32(16))
	}
	requireFilled(t, d, r, s, m.Pages(), written)
	require.NoError(t, r.Release(bound(t), m, s))
}
