package replica_test

import (
	"errors"
	"fmt"
	"strconv"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/cudapool/cudapool/cudart"
	"github.com/cudapool/cudapool/cudart/cudarttest"
	"github.com/cudapool/cudapool/internal/gputest"
	"github.com/cudapool/cudapool/internal/proctest"
	"github.com/cudapool/cudapool/kv"
	"github.com/cudapool/cudapool/kv/owner"
	"github.com/cudapool/cudapool/kv/replica"
)

// tierRuntime is the owner's software device, with the host tier's calls made to
// fail or stall where a test asks.
type tierRuntime struct {
	*cudarttest.Device
	registerErr error

	mu      sync.Mutex
	stallAt int // stall the stream of this batch copy (1 the first), 0 never
	batches int
	resumes chan func()
}

func (r *tierRuntime) HostRegister(dev int, mem []byte, flags cudart.HostRegisterFlags) error {
	if r.registerErr != nil {
		return r.registerErr
	}
	return r.Device.HostRegister(dev, mem, flags)
}

func (r *tierRuntime) MemcpyBatchAsync(dev int, pieces []cudart.CopyPiece, s cudart.Stream) error {
	r.mu.Lock()
	r.batches++
	stall := r.batches == r.stallAt
	r.mu.Unlock()
	if stall {
		resume, err := r.Device.Stall(dev, s)
		if err != nil {
			return err
		}
		r.resumes <- resume
	}
	return r.Device.MemcpyBatchAsync(dev, pieces, s)
}

// startTierOwner serves dir on rt's devices (nil: device 0) with a host tier of
// hostPages pages on each.
func startTierOwner(t *testing.T, rt *tierRuntime, g kv.Geometry, hostPages int, devices ...int) (*owner.Owner, string) {
	t.Helper()
	dir := shortDir(t)
	o, err := owner.Listen(dir, rt, g, owner.WithDevices(devices...), owner.WithHostBytes(uint64(hostPages)*owner.HostPageBytes(g)))
	require.NoError(t, err)
	t.Cleanup(func() {
		assert.NoError(t, o.Close(bound(t)))
		require.NoError(t, rt.Err(), "the owner's device saw broken rules")
	})
	return o, dir
}

func newTierRuntime(t *testing.T) *tierRuntime {
	return &tierRuntime{Device: cudarttest.ForTest(t), resumes: make(chan func(), 1)}
}

// host0 is the host tier of the owner's first device.
func host0(t *testing.T, o *owner.Owner) kv.HostStats {
	t.Helper()
	h := device0(o).Host
	require.NotNil(t, h, "device 0 shows no host tier")
	return *h
}

// sealedSpilled seals chains of pages pages for each seed, through r, each followed
// by the spiller's copies ahead: no replica writes the slab while the owner copies
// out of it (the software device orders whole allocations, and the slab is one).
func sealedSpilled(t *testing.T, o *owner.Owner, rt cudart.Runtime, r *replica.Replica, s cudart.Stream, pages int, seeds ...int32) map[int32][]kv.Hash {
	t.Helper()
	chains := map[int32][]kv.Hash{}
	for _, seed := range seeds {
		chains[seed] = sealed(t, rt, r, s, seed, pages)
		require.NoError(t, o.WaitSpills(bound(t)))
	}
	return chains
}

// Pages the slab evicts go to the host tier, and a match from another replica gets
// them back, every byte as written.
func TestHostTierEvictsAndRestores(t *testing.T) {
	rt := newTierRuntime(t)
	o, dir := startTierOwner(t, rt, small, 128)
	w, wdev, ws := dial(t, dir, 0)
	tier, ok := w.HostTier()
	require.True(t, ok, "the replica did not get the host tier at dial")
	require.Equal(t, 128, tier.Pages)
	require.Len(t, tier.Mem, 128*int(owner.HostPageBytes(small)))

	chains := sealedSpilled(t, o, wdev, w, ws, 16, 1, 2, 3, 4) // the slab's 64 pages
	h := host0(t, o)
	require.Equal(t, uint64(16), h.Spills, "the 16 least recent pages are copied ahead: %+v", h)
	require.Equal(t, 16, h.Twins)
	sealedSpilled(t, o, wdev, w, ws, 16, 5) // evicts chain 1: its copies ahead stay
	d := device0(o)
	require.Equal(t, uint64(16), d.Evictions)
	require.Equal(t, uint64(16), d.Host.Spilled, "%+v", d.Host)
	require.Zero(t, d.Host.Lost)

	rd, rdev, rs := dial(t, dir, 0)
	l, err := rd.Match(bound(t), chains[1])
	require.NoError(t, err)
	require.Len(t, l.Pages(), 16, "the match did not restore chain 1 from the host tier")
	require.NoError(t, check(rdev, rd, rs, l.Pages(), chains[1]), "restored bytes differ from what was sealed")
	require.NoError(t, rd.Release(bound(t), l, rs))
	h = host0(t, o)
	require.Equal(t, uint64(16), h.Restores)
	require.Equal(t, 16*owner.HostPageBytes(small), h.RestoreBytes)
	require.Equal(t, "kernel", h.CopyPath)

	// The restored pages are visible in the slab again, and a match of them copies
	// nothing more.
	l, err = w.Match(bound(t), chains[1])
	require.NoError(t, err)
	require.Len(t, l.Pages(), 16)
	require.NoError(t, w.Release(bound(t), l, ws))
	require.Equal(t, uint64(16), host0(t, o).Restores)
}

// LRU runs across both tiers: the least recent pages leave the slab for the host
// tier, and the host tier's least recent are gone.
func TestHostTierLRUAcrossTiers(t *testing.T) {
	rt := newTierRuntime(t)
	o, dir := startTierOwner(t, rt, small, 64) // 8 pages copied ahead
	w, wdev, ws := dial(t, dir, 0)
	seeds := make([]int32, 17)
	for i := range seeds {
		seeds[i] = int32(i + 1)
	}
	chains := sealedSpilled(t, o, wdev, w, ws, 8, seeds...) // 17 chains of 8: the slab holds 8

	d := device0(o)
	require.Equal(t, uint64(9*8), d.Evictions)
	require.Equal(t, uint64(9*8), d.Host.Spilled, "every page the slab evicted had been copied ahead: %+v", d.Host)
	require.Zero(t, d.Host.Lost)
	require.NotZero(t, d.Host.Evictions, "the host tier evicted nothing: %+v", d.Host)

	r, rdev, rs := dial(t, dir, 0)
	l, err := r.Match(bound(t), chains[1]) // the least recent: gone from both
	require.NoError(t, err)
	require.Empty(t, l.Pages(), "the least recent chain is still held")
	l, err = r.Match(bound(t), chains[17]) // the most recent: in the slab
	require.NoError(t, err)
	require.Len(t, l.Pages(), 8)
	require.NoError(t, r.Release(bound(t), l, rs))
	require.Zero(t, host0(t, o).Restores)
	l, err = r.Match(bound(t), chains[9]) // the most recent the slab evicted: in the host tier
	require.NoError(t, err)
	require.Len(t, l.Pages(), 8)
	require.NoError(t, check(rdev, r, rs, l.Pages(), chains[9]))
	require.NoError(t, r.Release(bound(t), l, rs))
	require.Equal(t, uint64(8), host0(t, o).Restores)
}

// A leased page is evicted from neither tier, however much is sealed meanwhile.
func TestHostTierNeverEvictsLeasedPages(t *testing.T) {
	rt := newTierRuntime(t)
	o, dir := startTierOwner(t, rt, small, 64)
	w, wdev, ws := dial(t, dir, 0)
	first := sealedSpilled(t, o, wdev, w, ws, 8, 1)[1]
	r, rdev, rs := dial(t, dir, 0)
	held, err := r.Match(bound(t), first)
	require.NoError(t, err)
	require.Len(t, held.Pages(), 8)
	seeds := make([]int32, 20)
	for i := range seeds {
		seeds[i] = int32(i + 2)
	}
	sealedSpilled(t, o, wdev, w, ws, 8, seeds...)
	require.NotZero(t, host0(t, o).Evictions, "the host tier was under no pressure")
	require.NoError(t, check(rdev, r, rs, held.Pages(), first), "a leased page changed")
	l, err := w.Match(bound(t), first)
	require.NoError(t, err)
	require.Equal(t, held.Pages(), l.Pages(), "the leased pages left the slab")
	require.NoError(t, w.Release(bound(t), l, ws))
	require.NoError(t, r.Release(bound(t), held, rs))
	require.Zero(t, host0(t, o).Restores)
}

// A spill whose copy is stalled on the GPU delays no match of pages in the slab: the
// spill runs on a stream of its own and holds no lock while it waits.
func TestSpillDoesNotBlockAMatch(t *testing.T) {
	rt := newTierRuntime(t)
	rt.stallAt = 2 // the first spill runs; the second stalls
	o, dir := startTierOwner(t, rt, small, 64)
	w, wdev, ws := dial(t, dir, 0)
	// Dialled first: the software device counts a replica's import of the slab as a
	// write of it, which the stalled spill's reads would not be ordered after.
	r, _, rs := dial(t, dir, 0)
	sealedSpilled(t, o, wdev, w, ws, 8, 1)
	require.Equal(t, uint64(8), host0(t, o).Spills)
	sealedSpilled(t, o, wdev, w, ws, 56, 2) // the slab is full, its 8 least recent pages copied ahead
	chain := sealed(t, wdev, w, ws, 3, 8)   // evicts chain 1; the spiller copies chain 2's last 8
	var resume func()
	select {
	case resume = <-rt.resumes:
	case <-bound(t).Done():
		t.Fatal("the second spill never came")
	}
	defer resume()
	require.Equal(t, 8, host0(t, o).Filling, "the stalled spill is not in flight")

	matched := make(chan error, 1)
	go func() {
		l, err := r.Match(bound(t), chain)
		if err == nil && len(l.Pages()) != 8 {
			err = errors.New("a short match")
		}
		if err == nil {
			err = r.Release(bound(t), l, rs)
		}
		matched <- err
	}()
	select {
	case err := <-matched:
		require.NoError(t, err)
	case <-time.After(30 * time.Second):
		t.Fatal("a match of pages in the slab waited for a stalled spill")
	}
	require.Equal(t, 8, host0(t, o).Filling, "the spill completed while stalled")
	resume()
	require.NoError(t, o.WaitSpills(bound(t)))
	require.Equal(t, uint64(16), host0(t, o).Spills)
}

// A host tier larger than the host's memory, or one the runtime cannot register, is
// refused at Listen with the reason, and nothing is left behind.
func TestHostTierRefused(t *testing.T) {
	rt := newTierRuntime(t)
	dir := shortDir(t)
	for _, c := range []struct {
		bytes   uint64
		devices []int
	}{{1 << 60, nil}, {1 << 63, []int{0, 1}}} { // the second's total overflows a uint64
		_, err := owner.Listen(dir, rt, small, owner.WithHostBytes(c.bytes), owner.WithDevices(c.devices...))
		require.ErrorIs(t, err, kv.ErrHostMemory, "%d bytes on %v", c.bytes, c.devices)
		require.ErrorContains(t, err, "larger than the host's available memory")
		require.ErrorContains(t, err, "MemAvailable")
	}
	_, err := owner.Listen(dir, rt, small, owner.WithHostBytes(100))
	require.ErrorIs(t, err, kv.ErrGeometry)
	require.ErrorContains(t, err, "holds no page")

	rt.registerErr = cudart.NewError("cudaHostRegister", cudart.ErrNotPermitted)
	_, err = owner.Listen(dir, rt, small, owner.WithHostBytes(1<<20))
	require.ErrorIs(t, err, cudart.ErrNotPermitted)
	require.ErrorContains(t, err, "cannot register")
	require.NoFileExists(t, dir+"/"+kv.HostSocket)
	require.NoFileExists(t, dir+"/"+owner.PageSocket)

	// And the directory serves again afterwards.
	rt.registerErr = nil
	o, err := owner.Listen(dir, rt, small, owner.WithHostBytes(1<<20))
	require.NoError(t, err)
	require.NoError(t, o.Close(bound(t)))
	require.NoError(t, rt.Err())
}

// Pages an alloc evicts before the spiller copied them ahead are copied to the host
// tier before the alloc's answer, so a whole slab evicted at once loses nothing.
func TestHostTierCopiesWhatAnAllocEvicts(t *testing.T) {
	rt := newTierRuntime(t)
	o, dir := startTierOwner(t, rt, small, 64) // 8 pages copied ahead
	w, wdev, ws := dial(t, dir, 0)
	chain := sealedSpilled(t, o, wdev, w, ws, 64, 1)[1]
	require.Equal(t, uint64(8), host0(t, o).Spills)
	l, err := w.Alloc(bound(t), 64) // evicts the whole chain
	require.NoError(t, err)
	h := host0(t, o)
	require.Equal(t, uint64(64), h.Spills, "%+v", h)
	require.Equal(t, uint64(64), h.Spilled)
	require.Zero(t, h.Lost)
	require.NoError(t, w.Release(bound(t), l, ws))

	r, rdev, rs := dial(t, dir, 0)
	eventually(t, "the aborted write's pages to settle", func() bool { return device0(o).Free == 64 })
	m, err := r.Match(bound(t), chain)
	require.NoError(t, err)
	require.Len(t, m.Pages(), 64)
	require.NoError(t, check(rdev, r, rs, m.Pages(), chain), "restored bytes differ from what was sealed")
	require.NoError(t, r.Release(bound(t), m, rs))
	require.Equal(t, uint64(64), host0(t, o).Restores)
}

// Each device has a host tier of its own: a replica of device 1 gets device 1's, and
// device 1's evicted pages are restored there and counted there.
func TestHostTierPerDevice(t *testing.T) {
	rt := newTierRuntime(t)
	o, dir := startTierOwner(t, rt, small, 64, 0, 1)
	w, wdev, ws := dial(t, dir, 1)
	tier, ok := w.HostTier()
	require.True(t, ok)
	require.Equal(t, 64, tier.Pages)
	chain := sealedSpilled(t, o, wdev, w, ws, 64, 1)[1]
	l, err := w.Alloc(bound(t), 64) // evicts the chain from device 1's slab
	require.NoError(t, err)
	require.NoError(t, w.Release(bound(t), l, ws))
	r, rdev, rs := dial(t, dir, 1)
	eventually(t, "the aborted write's pages to settle", func() bool { return o.Stats().Devices[1].Free == 64 })
	m, err := r.Match(bound(t), chain)
	require.NoError(t, err)
	require.Len(t, m.Pages(), 64)
	require.NoError(t, check(rdev, r, rs, m.Pages(), chain))
	require.NoError(t, r.Release(bound(t), m, rs))
	st := o.Stats()
	require.Equal(t, uint64(64), st.Devices[1].Host.Restores)
	require.Zero(t, st.Devices[0].Host.Restores)
	require.Zero(t, st.Devices[0].Host.Spills)
}

// TestGPUHostTier serves a slab of 64 llama-0.85b pages with a host tier on GPU 0: a
// writer process seals 64 pages, another evicts them all by an alloc of the whole slab,
// and a reader process's match restores them from the host tier, every byte of every
// piece read back exact, through the batch copy kernel.
//
// On the GPU host:
//
//	cd kv/replica && CUDAPOOL_REQUIRE_GPU=1 ../../bin/gpu/kv_replica.test -test.v -test.run TestGPUHostTier
func TestGPUHostTier(t *testing.T) {
	rt := gputest.Runtime(t)
	g, err := kv.Layout("llama-0.85b")
	require.NoError(t, err)
	g.Pages = 64
	dir := shortDir(t)
	o, err := owner.Listen(dir, rt, g, owner.WithHostBytes(96*owner.HostPageBytes(g)))
	require.NoError(t, err)
	t.Cleanup(func() { assert.NoError(t, o.Close(bound(t))) })
	require.Equal(t, "kernel", host0(t, o).CopyPath, "the batch copy kernel did not load")

	const pages = 64
	run := func(mode, want string) {
		p := proctest.Start(t, "gpureplica", dir, mode, strconv.Itoa(pages))
		p.Next() // dialed
		p.Expect(fmt.Sprintf("%s %d", want, pages))
		p.Finish()
		require.NoError(t, o.WaitSpills(bound(t)))
	}
	run("write", "sealed")
	run("evict", "evicted")
	h := host0(t, o)
	require.Equal(t, uint64(pages), h.Spilled, "%+v", h)
	require.Zero(t, h.Lost)
	eventually(t, "the evicting alloc's pages to settle", func() bool { return device0(o).Free == pages })
	run("read", "read")
	require.Equal(t, uint64(pages), host0(t, o).Restores)
}
