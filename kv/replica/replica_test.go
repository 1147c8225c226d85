package replica_test

import (
	"context"
	"errors"
	"os"
	"sync"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/cudapool/cudapool/cudart/cudarttest"
	"github.com/cudapool/cudapool/internal/proctest"
	"github.com/cudapool/cudapool/internal/testwait"
	"github.com/cudapool/cudapool/kv"
	"github.com/cudapool/cudapool/kv/owner"
	"github.com/cudapool/cudapool/kv/replica"
)

// roles are the processes the tests start (proctest); roles_test.go fills it.
var roles = map[string]func(args []string) int{}

// TestRoundTrip writes pages through one replica's mapping, seals them, and reads them
// back through another replica's, matched by their hashes.
func TestRoundTrip(t *testing.T) {
	o, _, dir := startOwner(t, small)
	w, wdev, ws := dial(t, dir, 0)
	r, rdev, rs := dial(t, dir, 0)
	ctx := bound(t)

	l, hashes := written(t, wdev, w, ws, 1, 5)
	require.Len(t, hashes, 5)
	require.True(t, l.Writable())
	require.Len(t, l.Pages(), 5)
	res, err := w.Seal(ctx, l, hashes, ws, replica.WaitVisible())
	require.NoError(t, err)
	assert.Equal(t, replica.SealResult{Visible: 5}, res)

	m, err := r.Match(ctx, hashes)
	require.NoError(t, err)
	assert.False(t, m.Writable())
	assert.Equal(t, l.Pages(), m.Pages(), "the pages the writer sealed")
	require.NoError(t, check(rdev, r, rs, m.Pages(), hashes))

	st := o.Stats()
	require.Len(t, st.Devices, 1)
	assert.Equal(t, 5, st.Devices[0].Sealed)
	assert.Equal(t, 5, st.Devices[0].Leased)
	assert.Equal(t, uint64(5), st.Devices[0].Hits)
	require.NoError(t, r.Release(ctx, m, rs))
	remote, err := r.Stats(ctx)
	require.NoError(t, err)
	assert.Equal(t, small.Pages, remote.Geometry.Pages)
	assert.Equal(t, 5, remote.Devices[0].Sealed)
	eventually(t, "the release to settle", func() bool { st := device0(o); return st.Leased == 0 && st.Releasing == 0 })
}

// TestRoundTripAcrossProcesses has a writer process and a reader process: the bytes
// one wrote through its mapping are what the other reads through its own.
func TestRoundTripAcrossProcesses(t *testing.T) {
	o, _, dir := startOwner(t, small)
	w := proctest.Start(t, "replica", dir, "0")
	w.Send("write 7 6")
	w.Expect("sealed 6 0")
	rd := proctest.Start(t, "replica", dir, "0")
	rd.Send("read 7 6")
	rd.Expect("read 6")
	assert.Equal(t, 6, device0(o).Leased)

	// And the reader here reads what the writer there wrote.
	r, rdev, rs := dial(t, dir, 0)
	ctx := bound(t)
	hashes := r.Hashes(tokens(small, 6, 7))
	m, err := r.Match(ctx, hashes)
	require.NoError(t, err)
	require.Len(t, m.Pages(), 6)
	require.NoError(t, check(rdev, r, rs, m.Pages(), hashes))
	require.NoError(t, r.Release(ctx, m, rs))

	rd.Send("release")
	rd.Expect("released")
	rd.Finish()
	w.Finish()
	eventually(t, "the leases to end", func() bool { st := device0(o); return st.Leased == 0 && st.Releasing == 0 })
	assert.Empty(t, o.Stats().Replicas[1:], "only this process's replica is left")
}

// TestMatchLongestRun: a match leases the longest run of visible hashes from the first.
func TestMatchLongestRun(t *testing.T) {
	o, dev, dir := startOwner(t, small)
	_ = dev
	w, wdev, ws := dial(t, dir, 0)
	ctx := bound(t)
	all := w.Hashes(tokens(small, 5, 2))
	sealed(t, wdev, w, ws, 2, 3) // the first 3 pages of the same tokens
	m, err := w.Match(ctx, all)
	require.NoError(t, err)
	assert.Len(t, m.Pages(), 3, "3 of the 5 hashes are visible")
	require.NoError(t, w.Release(ctx, m, ws))

	gap := []kv.Hash{all[0], all[1], {9}, all[2]}
	m, err = w.Match(ctx, gap)
	require.NoError(t, err)
	assert.Len(t, m.Pages(), 2, "the run ends at the first hash not visible")
	require.NoError(t, w.Release(ctx, m, ws))

	none, err := w.Match(ctx, []kv.Hash{{1}, all[0]})
	require.NoError(t, err)
	assert.Empty(t, none.Pages())
	assert.Zero(t, none.ID(), "no lease for an empty match")
	require.NoError(t, w.Release(ctx, none, ws), "releasing an empty lease does nothing")

	st := device0(o)
	assert.Equal(t, uint64(3+2), st.Hits)
	assert.Equal(t, uint64(2+2+2), st.Misses)
}

// TestStaleLeaseRefused: a lease released twice, another replica's, a forged one, a
// read lease sealed: each is refused with kv.ErrStaleLease and changes nothing.
func TestStaleLeaseRefused(t *testing.T) {
	o, _, dir := startOwner(t, small)
	a, adev, as := dial(t, dir, 0)
	b, _, bs := dial(t, dir, 0)
	ctx := bound(t)
	hashes := sealed(t, adev, a, as, 3, 4)

	m, err := a.Match(ctx, hashes)
	require.NoError(t, err)
	held, err := a.Match(ctx, hashes)
	require.NoError(t, err)
	require.NoError(t, a.Release(ctx, m, as))
	eventually(t, "the release to settle", func() bool { return device0(o).Releasing == 0 })
	before := o.Stats()

	err = a.Release(ctx, m, as)
	require.ErrorIs(t, err, kv.ErrStaleLease, "released twice")
	assert.Contains(t, err.Error(), "has ended")
	err = b.Release(ctx, held, bs)
	require.ErrorIs(t, err, kv.ErrStaleLease, "another replica's")
	assert.Contains(t, err.Error(), "another replica")
	err = a.Release(ctx, replica.ForgeLease(1<<40, false, 0), as)
	require.ErrorIs(t, err, kv.ErrStaleLease, "never issued")
	assert.Contains(t, err.Error(), "never issued")
	require.ErrorIs(t, a.ReleaseAll(ctx, []*replica.Lease{held, m}, as), kv.ErrStaleLease, "a valid lease beside a stale one")
	_, err = a.Seal(ctx, replica.ForgeLease(held.ID(), true, held.Pages()...), hashes, as)
	require.ErrorIs(t, err, kv.ErrStaleLease, "a read lease sealed")
	_, err = b.Seal(ctx, replica.ForgeLease(held.ID(), true, held.Pages()...), hashes, bs)
	require.ErrorIs(t, err, kv.ErrStaleLease, "another replica's lease sealed")
	assert.Equal(t, before.Devices, o.Stats().Devices, "refusals change nothing")

	require.NoError(t, a.Release(ctx, held, as), "the valid lease is still held")
	w, err := a.Alloc(ctx, 2)
	require.NoError(t, err)
	_, err = a.Seal(ctx, w, nil, as)
	require.NoError(t, err, "a seal of no hashes frees the pages")
	_, err = a.Seal(ctx, w, nil, as)
	require.ErrorIs(t, err, kv.ErrStaleLease, "a write lease sealed twice")
	require.ErrorIs(t, a.Release(ctx, w, as), kv.ErrStaleLease, "a sealed write lease released")
}

// TestNoSpaceIsAllOrNothing: an alloc that cannot have every page it asks for leases
// none, evicts nothing and changes nothing.
func TestNoSpaceIsAllOrNothing(t *testing.T) {
	g := small
	g.Pages = 8
	o, _, dir := startOwner(t, g)
	r, rdev, rs := dial(t, dir, 0)
	ctx := bound(t)
	hashes := sealed(t, rdev, r, rs, 1, 3)
	m, err := r.Match(ctx, hashes) // 3 pages held
	require.NoError(t, err)
	w, err := r.Alloc(ctx, 4)
	require.NoError(t, err)
	before := device0(o)
	_, err = r.Alloc(ctx, 2)
	require.ErrorIs(t, err, kv.ErrNoSpace, "1 page free, none evictable")
	_, err = r.Alloc(ctx, 9)
	require.ErrorIs(t, err, kv.ErrGeometry, "more pages than the slab has")
	_, err = r.Alloc(ctx, kv.MaxBatch+1)
	require.ErrorIs(t, err, kv.ErrTooLarge)
	assert.Equal(t, before, device0(o), "a refused alloc changes nothing")
	one, err := r.Alloc(ctx, 1)
	require.NoError(t, err, "the free page")
	require.NoError(t, r.ReleaseAll(ctx, []*replica.Lease{m, w, one}, rs))
}

// TestEvictionLeavesFirst: alloc evicts the least recently used visible pages, a
// chain's deepest first, and never a page a reader holds or whose release has not
// settled.
func TestEvictionLeavesFirst(t *testing.T) {
	g := small
	g.Pages = 8
	o, _, dir := startOwner(t, g)
	r, rdev, rs := dial(t, dir, 0)
	ctx := bound(t)
	a := sealed(t, rdev, r, rs, 1, 4)
	b := sealed(t, rdev, r, rs, 2, 4)

	w1, err := r.Alloc(ctx, 1)
	require.NoError(t, err)
	assert.Equal(t, uint64(1), device0(o).Evictions)
	ma, err := r.Match(ctx, a)
	require.NoError(t, err)
	require.Len(t, ma.Pages(), 3, "a's leaf went first, the older chain's deepest page")

	// a is held: the next evictions must take b, deepest first.
	w2, err := r.Alloc(ctx, 2)
	require.NoError(t, err)
	mb, err := r.Match(ctx, b)
	require.NoError(t, err)
	require.Len(t, mb.Pages(), 2, "b lost its two deepest pages")
	_, err = r.Alloc(ctx, 3)
	require.ErrorIs(t, err, kv.ErrNoSpace, "every visible page is held")

	// A release whose stream has not run yet keeps the pages from eviction.
	resume, err := rdev.Stall(0, rs)
	require.NoError(t, err)
	t.Cleanup(resume)
	require.NoError(t, r.Release(ctx, mb, rs))
	assert.Equal(t, 2, device0(o).Releasing)
	// The Alloc waits for b's pages to settle (no eviction before), then takes one.
	got := make(chan error, 1)
	var w3 *replica.Lease
	go func() {
		var err error
		w3, err = r.Alloc(ctx, 1)
		got <- err
	}()
	eventually(t, "the Alloc to wait for b's release", func() bool { return o.Pace().AllocWaits == 1 })
	assert.Equal(t, uint64(3), device0(o).Evictions, "b's pages wait for their release event")
	resume()
	require.NoError(t, testwait.Recv(t, got, "the Alloc, once b's release settled"))
	mb, err = r.Match(ctx, b)
	require.NoError(t, err)
	assert.Len(t, mb.Pages(), 1, "b's deepest page left went")
	require.NoError(t, r.ReleaseAll(ctx, []*replica.Lease{ma, mb, w1, w2, w3}, rs))
}

// TestSealNotVisibleBeforeItsWork: pages sealed behind work that has not run are not
// matched; they become visible once it has.
func TestSealNotVisibleBeforeItsWork(t *testing.T) {
	o, _, dir := startOwner(t, small)
	w, wdev, ws := dial(t, dir, 0)
	r, rdev, rs := dial(t, dir, 0)
	ctx := bound(t)
	resume, err := wdev.Stall(0, ws)
	require.NoError(t, err)
	t.Cleanup(resume)
	l, hashes := written(t, wdev, w, ws, 5, 4)
	res, err := w.Seal(ctx, l, hashes, ws)
	require.NoError(t, err)
	assert.Equal(t, replica.SealResult{Pending: 4}, res)
	assert.Equal(t, 4, device0(o).Sealing)
	m, err := r.Match(ctx, hashes)
	require.NoError(t, err)
	assert.Empty(t, m.Pages(), "pages whose writes have not run")

	// A Seal that waits is answered once the writes have run.
	l2, hashes2 := written(t, wdev, w, ws, 6, 2)
	waited := make(chan replica.SealResult, 1)
	go func() {
		res, err := w.Seal(ctx, l2, hashes2, ws, replica.WaitVisible())
		assert.NoError(t, err)
		waited <- res
	}()
	eventually(t, "the second seal to reach the owner", func() bool { return device0(o).Sealing == 6 })
	select {
	case <-waited:
		t.Fatal("a Seal that waits was answered before its writes ran")
	default:
	}
	resume()
	assert.Equal(t, replica.SealResult{Visible: 2}, testwait.Recv(t, waited, "the waiting Seal's answer"))
	eventually(t, "the first seal to become visible", func() bool { return device0(o).Sealed == 6 })
	m, err = r.Match(ctx, hashes)
	require.NoError(t, err)
	require.Len(t, m.Pages(), 4)
	require.NoError(t, check(rdev, r, rs, m.Pages(), hashes))
	require.NoError(t, r.Release(ctx, m, rs))
}

// TestDuplicateSeal: a second seal of hashes already visible frees its pages and
// counts them as duplicates; fewer hashes than pages free the rest.
func TestDuplicateSeal(t *testing.T) {
	o, _, dir := startOwner(t, small)
	a, adev, as := dial(t, dir, 0)
	b, bdev, bs := dial(t, dir, 0)
	ctx := bound(t)
	hashes := sealed(t, adev, a, as, 4, 3)
	l, err := b.Alloc(ctx, 5)
	require.NoError(t, err)
	write(t, bdev, b, bs, l.Pages()[:3], hashes)
	res, err := b.Seal(ctx, l, hashes, bs, replica.WaitVisible())
	require.NoError(t, err)
	assert.Equal(t, replica.SealResult{Duplicates: 3}, res)
	st := device0(o)
	assert.Equal(t, 3, st.Sealed)
	assert.Equal(t, small.Pages-3, st.Free, "the duplicates and the pages without a hash are free")
	assert.Equal(t, uint64(3), st.Duplicates)
}

// TestWriterKilledPublishesNothing: a writer killed before its writes ran publishes
// nothing, and its pages go back to free: killed with its seal pending (after its
// connection hung up, as a dying process's does first), or with its write lease.
func TestWriterKilledPublishesNothing(t *testing.T) {
	o, _, dir := startOwner(t, small)
	w := proctest.Start(t, "replica", dir, "0")
	w.Send("stallwrite 8 4")
	w.Expect("pending 4")
	assert.Equal(t, 4, device0(o).Sealing)
	w.Send("hangup")
	w.Expect("hung up")
	eventually(t, "the owner to see the writer hang up", func() bool {
		for _, r := range o.Stats().Replicas {
			if r.PID == w.PID() {
				return r.AwaitingExit
			}
		}
		return false
	})
	assert.Equal(t, 4, device0(o).Sealing, "a seal pending for a process that lives on")
	w.Kill()
	eventually(t, "the dead writer's pages to be freed", func() bool { return device0(o).Free == small.Pages })
	assert.Zero(t, device0(o).Sealed)
	r, _, _ := dial(t, dir, 0)
	m, err := r.Match(bound(t), r.Hashes(tokens(small, 4, 8)))
	require.NoError(t, err)
	assert.Empty(t, m.Pages(), "nothing of the dead writer's is visible")
	w.Wait()

	w = proctest.Start(t, "replica", dir, "0")
	w.Send("allocwrite 8 5")
	w.Expect("allocated 5")
	assert.Equal(t, 5, device0(o).Writing)
	w.Kill()
	eventually(t, "the dead writer's write lease to end", func() bool { return device0(o).Free == small.Pages })
	w.Wait()
}

// TestReaderKilledEndsItsLeases: a reader killed while it holds pages loses them, and
// they can be evicted again.
func TestReaderKilledEndsItsLeases(t *testing.T) {
	g := small
	g.Pages = 8
	o, _, dir := startOwner(t, g)
	w, wdev, ws := dial(t, dir, 0)
	sealed(t, wdev, w, ws, 9, 8)
	rd := proctest.Start(t, "replica", dir, "0")
	rd.Send("read 9 8")
	rd.Expect("read 8")
	_, err := w.Alloc(bound(t), 1)
	require.ErrorIs(t, err, kv.ErrNoSpace, "every page is held by the reader")
	rd.Kill()
	eventually(t, "the dead reader's leases to end", func() bool { return device0(o).Leased == 0 })
	l, err := w.Alloc(bound(t), 8)
	require.NoError(t, err, "the pages are evictable again")
	require.NoError(t, w.Release(bound(t), l, ws))
	rd.Wait()
}

// TestOwnerKilled: a replica learns at once that its owner died.
func TestOwnerKilled(t *testing.T) {
	dir := shortDir(t)
	ow := proctest.Start(t, "owner", dir)
	ow.Expect("ready")
	r, _, rs := dial(t, dir, 0)
	ctx := bound(t)
	l, err := r.Alloc(ctx, 2)
	require.NoError(t, err)
	require.NoError(t, r.Err())
	ow.Kill()
	testwait.Recv(t, r.Done(), "the replica's Done after its owner's death")
	require.ErrorIs(t, r.Err(), kv.ErrOwnerGone)
	_, err = r.Alloc(ctx, 1)
	require.ErrorIs(t, err, kv.ErrOwnerGone)
	err = r.Release(ctx, l, rs)
	require.True(t, errors.Is(err, kv.ErrOwnerGone), "%v", err)
	ow.Wait()
}

// TestCrossDeviceMatchCopies: a match on device 1 of pages visible only in device 0's
// slab copies them into device 1's, where they read right and are then matched
// without a copy.
func TestCrossDeviceMatchCopies(t *testing.T) {
	o, _, dir := startOwner(t, small, 0, 1)
	w, wdev, ws := dial(t, dir, 0)
	r, rdev, rs := dial(t, dir, 1)
	ctx := bound(t)
	require.NotEqual(t, w.Regions(), r.Regions(), "each device has its slab")
	hashes := sealed(t, wdev, w, ws, 11, 6)
	local := sealed(t, rdev, r, rs, 11, 2) // the first two are on device 1 already
	require.Equal(t, hashes[:2], local)

	m, err := r.Match(ctx, hashes)
	require.NoError(t, err)
	require.Len(t, m.Pages(), 6)
	require.NoError(t, check(rdev, r, rs, m.Pages(), hashes), "the copies' bytes")
	st := o.Stats().Devices
	assert.Equal(t, uint64(4), st[1].Copied, "the four pages device 1 lacked")
	assert.Equal(t, 6, st[1].Sealed)
	assert.Equal(t, 6, st[0].Sealed)
	assert.Zero(t, st[0].Leased, "the copy's hold on the sources ended")
	require.NoError(t, r.Release(ctx, m, rs))

	again, err := r.Match(ctx, hashes)
	require.NoError(t, err)
	assert.Equal(t, m.Pages(), again.Pages(), "matched in device 1's slab")
	assert.Equal(t, uint64(4), o.Stats().Devices[1].Copied, "no second copy")
	require.NoError(t, r.Release(ctx, again, rs))
}

// TestOwnerClosesWhileIdle: an idle replica learns at once that its owner closes, and
// the owner's Close ends once the replica closed in turn.
func TestOwnerClosesWhileIdle(t *testing.T) {
	dir := shortDir(t)
	odev := cudarttest.ForTest(t)
	o, err := owner.Listen(dir, odev, small)
	require.NoError(t, err)
	r, _, _ := dial(t, dir, 0)
	closed := make(chan error, 1)
	go func() { closed <- o.Close(bound(t)) }()
	testwait.Recv(t, r.Done(), "the idle replica's Done after its owner's Close")
	require.ErrorIs(t, r.Err(), kv.ErrOwnerGone)
	_, err = r.Alloc(bound(t), 1)
	require.ErrorIs(t, err, kv.ErrOwnerGone)
	require.NoError(t, r.Close(bound(t)))
	require.NoError(t, testwait.Recv(t, closed, "the owner's Close"), "the owner's Close, once the replica unmapped its slab")
	require.NoError(t, odev.Err())
}

// TestQueryStats: an observer, with no runtime, reads the owner's Stats; it is no
// replica of the owner's.
func TestQueryStats(t *testing.T) {
	_, _, dir := startOwner(t, small)
	r, rdev, rs := dial(t, dir, 0)
	sealed(t, rdev, r, rs, 1, 3)
	m, err := r.Match(bound(t), r.Hashes(tokens(small, 3, 1)))
	require.NoError(t, err)
	st, err := replica.QueryStats(bound(t), dir)
	require.NoError(t, err)
	require.Len(t, st.Devices, 1)
	assert.Equal(t, 3, st.Devices[0].Leased)
	require.Len(t, st.Replicas, 1, "the observer is not listed")
	assert.Equal(t, kv.ReplicaStats{PID: os.Getpid(), Device: 0, Leases: 1, Pages: 3}, st.Replicas[0])
	require.NoError(t, r.Release(bound(t), m, rs))

	_, err = replica.QueryStats(bound(t), shortDir(t))
	require.ErrorIs(t, err, kv.ErrOwnerGone, "a directory no owner serves")
}

// TestCloseWaitsForReleases: Close ends the leases still held at once, and returns
// once the owner has settled the releases that wait for its streams, so that the
// replica destroys no event the owner still asks.
func TestCloseWaitsForReleases(t *testing.T) {
	o, _, dir := startOwner(t, small)
	r, rdev, rs := dial(t, dir, 0)
	ctx := bound(t)
	hashes := sealed(t, rdev, r, rs, 3, 4)
	_, err := r.Match(ctx, hashes) // held at Close
	require.NoError(t, err)
	m, err := r.Match(ctx, hashes[:2])
	require.NoError(t, err)
	resume, err := rdev.Stall(0, rs)
	require.NoError(t, err)
	t.Cleanup(resume)
	require.NoError(t, r.Release(ctx, m, rs))
	closed := make(chan error, 1)
	go func() { closed <- r.Close(ctx) }()
	eventually(t, "the held lease to end at Bye, behind its final event", func() bool { return device0(o).Leased == 0 })
	select {
	case err := <-closed:
		t.Fatalf("Close returned (%v) while a release waited for its stream", err)
	default:
	}
	assert.Equal(t, 4, device0(o).Releasing, "m's 2 pages, and the held lease's 4 behind Close's final event")
	resume()
	require.NoError(t, testwait.Recv(t, closed, "Close, once the release settled"))
	assert.Zero(t, device0(o).Releasing, "Close returned before the release settled")
	// The owner drops the replica when it reads the Bye, which Close does not wait for.
	eventually(t, "the owner to drop the closed replica", func() bool { return len(o.Stats().Replicas) == 0 })
}

// TestReplicasOfOneRuntime: one runtime holds several Replicas, each mapping the
// slab of its own (the VMM route imports each chunk anew): pages one seals read back
// through another's mapping, and one on another device works alongside.
func TestReplicasOfOneRuntime(t *testing.T) {
	o, _, dir := startOwner(t, small, 0, 1)
	w, dev, ws := dial(t, dir, 0)
	r, err := replica.Dial(bound(t), dir, dev, 0)
	require.NoError(t, err)
	other, err := replica.Dial(bound(t), dir, dev, 1)
	require.NoError(t, err)
	assert.NotEqual(t, w.Regions(), r.Regions(), "each maps the slab at addresses of its own")
	hashes := sealed(t, dev, w, ws, 3, 4)
	m, err := r.Match(bound(t), hashes)
	require.NoError(t, err)
	require.NoError(t, check(dev, r, ws, m.Pages(), hashes))
	require.NoError(t, r.Release(bound(t), m, ws))
	require.NoError(t, r.Close(bound(t)))
	require.NoError(t, other.Close(bound(t)))
	eventually(t, "the closed replicas' connections to end", func() bool { return len(o.Stats().Replicas) == 1 })
}

// TestConcurrentCalls: many goroutines share one replica, some of them giving up on
// their requests at once; every lease a call gave up on is given back.
func TestConcurrentCalls(t *testing.T) {
	g := small
	g.Pages = 512
	o, _, dir := startOwner(t, g)
	r, rdev, rs := dial(t, dir, 0)
	ctx := bound(t)
	shared := sealed(t, rdev, r, rs, 1, 8)
	var wg sync.WaitGroup
	for w := range 8 {
		wg.Go(func() {
			for i := range 30 {
				hashes := r.Hashes(tokens(g, 4, int32(100+w*1000+i)))
				l, err := r.Alloc(ctx, 4)
				if !assert.NoError(t, err) {
					return
				}
				_, err = r.Seal(ctx, l, hashes, rs, replica.WaitVisible())
				assert.NoError(t, err)
				m, err := r.Match(ctx, shared)
				assert.NoError(t, err)
				assert.Len(t, m.Pages(), 8)
				assert.NoError(t, r.Release(ctx, m, rs))
				// A caller that gives up at once: the owner's answer grants a lease
				// nobody takes, which the replica releases.
				gone, cancel := context.WithCancel(ctx)
				cancel()
				late, err := r.Match(gone, shared)
				if err != nil {
					assert.ErrorIs(t, err, context.Canceled)
				} else { // the answer came first: the lease is the caller's
					assert.NoError(t, r.Release(ctx, late, rs))
				}
			}
		})
	}
	wg.Wait()
	eventually(t, "every lease to end", func() bool {
		st := o.Stats()
		return st.Devices[0].Leased == 0 && st.Replicas[0].Leases == 0
	})
	st := device0(o)
	assert.Equal(t, uint64(8+8*30*4), st.Seals)
	assert.Equal(t, st.Seals-st.Evictions, uint64(st.Sealed))
}
