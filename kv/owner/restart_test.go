package owner_test

import (
	"os"
	"path/filepath"
	"slices"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/cudapool/cudapool/cudart/cudarttest"
	"github.com/cudapool/cudapool/internal/testwait"
	"github.com/cudapool/cudapool/kv"
	"github.com/cudapool/cudapool/kv/internal/kvwire"
	"github.com/cudapool/cudapool/kv/owner"
	"github.com/cudapool/cudapool/kv/replica"
)

// kept is a keeper and the page server over its slabs, both in this process: the
// page server is restarted as kvpoold's SIGKILL and start would (Crash, Close, Listen
// again on the directory), and the keeper keeps the slabs, the host tiers' memory and
// the index throughout. Every replica is this process, alive throughout.
type kept struct {
	t    *testing.T
	dir  string
	opts []owner.Option
	o    *owner.Owner
}

// keep starts a keeper of small and a page server over it, with an index and opts.
func keep(t *testing.T, opts ...owner.Option) *kept {
	t.Helper()
	dir, err := os.MkdirTemp("", "kvr")
	require.NoError(t, err)
	t.Cleanup(func() { os.RemoveAll(dir) })
	kdev := cudarttest.ForTest(t)
	kp, err := owner.Keep(dir, kdev, small, owner.WithoutAnnounce())
	require.NoError(t, err)
	t.Cleanup(func() { assert.NoError(t, kp.Close(bound(t))) })
	k := &kept{t: t, dir: dir, opts: append([]owner.Option{owner.WithoutAnnounce(), owner.WithKeeper(nil),
		owner.WithIndex(filepath.Join(dir, owner.IndexFile))}, opts...)}
	k.start()
	return k
}

// start starts a page server over the keeper's slabs and returns what it took back.
func (k *kept) start() owner.Recovery {
	k.t.Helper()
	dev := cudarttest.ForTest(k.t)
	o, err := owner.Listen(k.dir, dev, small, k.opts...)
	require.NoError(k.t, err)
	k.o = o
	k.t.Cleanup(func() {
		if k.o == o {
			assert.NoError(k.t, o.Close(bound(k.t)))
		}
	})
	return o.Recovery()
}

// restart ends the page server as its process's death would, for the index and the
// replicas, and starts another.
func (k *kept) restart() owner.Recovery {
	k.t.Helper()
	owner.Crash(k.o)
	require.NoError(k.t, k.o.Close(bound(k.t)))
	return k.start()
}

// windowWaits returns a channel that gets a value each time a request begins to wait
// for the reattach window, until the test ends.
func windowWaits(t *testing.T) <-chan struct{} {
	ch := make(chan struct{}, 16)
	t.Cleanup(owner.OnWindowWait(func() { ch <- struct{}{} }))
	return ch
}

// allocPages leases n pages on r and returns the lease's id and pages.
func (r *raw) allocPages(id uint32, n uint32) (uint64, []uint32) {
	r.send(kvwire.AppendU32(nil, kvwire.TypeAlloc, id, n))
	h, p, err := r.next()
	require.NoError(r.t, err)
	require.Equal(r.t, kvwire.TypeLeased, h.Type, "%v", kvwire.ParseError(h.Type, p))
	l, err := kvwire.DecodeLease(h.Type, p, nil)
	require.NoError(r.t, err)
	return l.ID, l.Pages
}

// chain is n hashes of seed, distinct from every other seed's.
func chain(seed byte, n int) []kv.Hash {
	hs := make([]kv.Hash, n)
	for i := range hs {
		hs[i] = kv.Hash{0xc4, seed, byte(i)}
	}
	return hs
}

// sealChain seals n fresh pages under chain(seed, n) through r (no bytes written: only
// the page table is looked at), visible when it returns.
func sealChain(t *testing.T, r *replica.Replica, seed byte, n int) {
	t.Helper()
	w, err := r.Alloc(bound(t), n)
	require.NoError(t, err)
	res, err := r.Seal(bound(t), w, chain(seed, n), 0, replica.WaitVisible())
	require.NoError(t, err)
	require.Equal(t, n, res.Visible)
}

// A Match that restores pages from the host tier waits for the reattach window, as an
// Alloc does: the pages of a write lease held across the restart are not taken before
// its writer re-declares it. (Before, the restore took them at once, and the writer's
// queued writes landed on pages another replica read.)
func TestRestoreWaitsForTheReattachWindow(t *testing.T) {
	k := keep(t, owner.WithHostBytes(128*owner.HostPageBytes(small)))
	a, err := replica.Dial(bound(t), k.dir, cudarttest.ForTest(t), 0)
	require.NoError(t, err)
	for seed := range byte(4) { // the slab's 64 pages; the 16 least recent are copied ahead
		sealChain(t, a, seed, 16)
		require.NoError(t, k.o.WaitSpills(bound(t)))
	}
	require.NoError(t, a.Close(bound(t))) // gone: the writer alone is awaited after the restart
	w := dialRaw(t, k.dir)
	w.hello()
	lease, pages := w.allocPages(2, 16) // evicts chain 0, whose host copies stay
	require.Equal(t, 16, k.o.Stats().Devices[0].Host.Sealed-k.o.Stats().Devices[0].Host.Twins, "chain 0 is in the host tier alone")

	waits := windowWaits(t)
	rec := k.restart()
	require.Equal(t, 1, rec.Replicas, "the writer is awaited: %v", rec)
	require.Equal(t, 1, rec.HostTiersKept)
	w = dialRaw(t, k.dir)
	w.hello()

	m, err := replica.Dial(bound(t), k.dir, cudarttest.ForTest(t), 0)
	require.NoError(t, err)
	t.Cleanup(func() { m.Close(bound(t)) })
	type result struct {
		l   *replica.Lease
		err error
	}
	matched := make(chan result, 1)
	go func() {
		l, err := m.Match(bound(t), chain(0, 16))
		matched <- result{l, err}
	}()
	var got result
	select {
	case <-waits: // the restore waits; the writer's re-declaration ends the window
		status, why := w.reattach(3, kvwire.Reattach{Lease: lease, Write: true, Pages: pages})
		assert.Equal(t, kvwire.ReattachKept, status, "the write lease: %s", why)
		status, _ = w.reattach(4, kvwire.Reattach{})
		assert.Equal(t, kvwire.ReattachKept, status)
		got = testwait.Recv(t, matched, "the match, once the window has ended")
	case got = <-matched:
		status, why := w.reattach(3, kvwire.Reattach{Lease: lease, Write: true, Pages: pages})
		assert.Equal(t, kvwire.ReattachKept, status, "the write lease, re-declared after a restore that did not wait: %s", why)
	}
	require.NoError(t, got.err)
	require.Len(t, got.l.Pages(), 16, "chain 0 is restored from the host tier")
	for _, p := range got.l.Pages() {
		assert.False(t, slices.Contains(pages, p), "the restore took page %d of the write lease %v held across the restart", p, pages)
	}
}
