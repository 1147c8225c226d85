package pages_test

import (
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/cudapool/cudapool/kv"
	"github.com/cudapool/cudapool/kv/internal/pages"
)

// TestGrow: an Alloc the mapped pages cannot serve answers ErrNoSpace until the
// table grows; the pages grown are free, the lowest first; growth past the Bound,
// or not past Mapped, is refused with nothing changed.
func TestGrow(t *testing.T) {
	tab, j := fresh(t, pages.Config{Pages: 2, Bound: 6, Epoch: 1})
	assert.Equal(t, 2, tab.Mapped())
	_, _, _, err := tab.Alloc(writer, 3)
	require.ErrorIs(t, err, pages.ErrNoSpace)
	_, _, _, err = tab.Alloc(writer, 7)
	require.ErrorIs(t, err, pages.ErrInput, "more than the Bound")
	require.ErrorIs(t, tab.Grow(2), pages.ErrInput)
	require.ErrorIs(t, tab.Grow(7), pages.ErrInput)
	require.NoError(t, tab.Check())

	require.NoError(t, tab.Grow(4))
	assert.Equal(t, 4, tab.Mapped())
	_, got := alloc(t, tab, j, writer, 3)
	assert.Equal(t, []uint32{2, 3, 0}, got, "the pages grown first, the lowest on top")
	require.NoError(t, tab.Check())
	require.NoError(t, tab.Grow(6))
	st := tab.Stats()
	assert.Equal(t, 6, st.Pages)
	assert.Equal(t, 6, st.Bound)
	assert.Equal(t, 3, st.Free)
	require.NoError(t, tab.Check())
	_, err = pages.New(pages.Config{Pages: 3, Bound: 2, Epoch: 1})
	require.ErrorIs(t, err, pages.ErrInput, "a Bound below Pages")
}

// TestRestartDropsUnmapped: a restart told that fewer pages are mapped than the
// journal names never hands out or restores one past them: their seals are dropped
// (the hashes not visible, though their host copies stay), a lease that names one
// is stranded over its other pages and its reattach is refused; the pages grown
// again are free.
func TestRestartDropsUnmapped(t *testing.T) {
	cfg := pages.Config{Pages: 6, HostPages: 2, Epoch: 1}
	tab, j := fresh(t, cfg)
	seal(t, tab, j, writer, chainHash(1, 0), chainHash(1, 1), chainHash(1, 2), chainHash(1, 3), chainHash(1, 4))
	spillAll(t, tab, j)
	p4, ok := tab.Lookup(chainHash(1, 4))
	require.True(t, ok)
	require.Equal(t, uint32(4), p4)
	res, fx, err := tab.Match(reader, []kv.Hash{chainHash(1, 3), chainHash(1, 4)})
	require.NoError(t, err)
	j.add(fx)
	wid, wpages := alloc(t, tab, j, other, 1)
	require.Equal(t, []uint32{5}, wpages)

	cfg.Bound, cfg.Pages = 6, 4
	again := j.restart(t, cfg, pages.Rules{})
	assert.Equal(t, 4, again.Mapped())
	_, ok = again.Lookup(chainHash(1, 4))
	assert.False(t, ok, "a page not mapped holds no hash")
	_, ok = again.HostLookup(chainHash(1, 4))
	assert.True(t, ok, "its host copy stays")
	require.ErrorIs(t, again.Reattach(reader, res.Lease, false, res.Pages, []kv.Hash{chainHash(1, 3), chainHash(1, 4)}), pages.ErrLost)
	require.ErrorIs(t, again.Reattach(other, wid, true, wpages, nil), pages.ErrLost)
	p3, ok := again.Lookup(chainHash(1, 3))
	require.True(t, ok)
	assert.Equal(t, 1, pages.Readers(again, p3), "the lease's mapped page stays held until its holder declares")
	again.Declared(reader)
	again.Declared(other)
	assert.Equal(t, 0, pages.Readers(again, p3))
	require.NoError(t, again.Check())

	require.NoError(t, again.Grow(6))
	for _, p := range []uint32{4, 5} {
		st, _, _ := again.Page(p)
		assert.Equal(t, pages.Free, st)
	}
	require.NoError(t, again.Check())
	cfg.Pages, cfg.Bound, cfg.Epoch = 4, 4, 9
	_, err = pages.Restart(cfg, mustReplay(t, j))
	require.ErrorIs(t, err, pages.ErrJournal, "a page past the Bound")
	assert.Contains(t, err.Error(), "page 4 of 4")
}

func mustReplay(t *testing.T, j *journal) pages.Recovered {
	t.Helper()
	rec, err := pages.Replay(j.recs)
	require.NoError(t, err)
	return rec
}

// shrinkScene is a table of 8 pages, 4 host pages: pages 0..5 sealed (chain 1),
// page 5 read by reader, page 6 written by writer, page 7 free; then Shrink(4).
// Page 4 is evicted at once into a host page (a copy), page 5 waits for its
// reader, page 6 for its writer.
func shrinkScene(t *testing.T, r pages.Rules) (*pages.Table, *journal, pages.LeaseID, pages.LeaseID, pages.Effects) {
	t.Helper()
	tab, err := pages.NewWith(pages.Config{Pages: 8, HostPages: 4, Epoch: 1}, r)
	require.NoError(t, err)
	j := &journal{}
	got := seal(t, tab, j, writer, chainHash(1, 0), chainHash(1, 1), chainHash(1, 2), chainHash(1, 3), chainHash(1, 4), chainHash(1, 5))
	require.Equal(t, []uint32{0, 1, 2, 3, 4, 5}, got)
	res, fx, err := tab.Match(reader, []kv.Hash{chainHash(1, 0), chainHash(1, 1), chainHash(1, 2), chainHash(1, 3), chainHash(1, 4), chainHash(1, 5)})
	require.NoError(t, err)
	j.add(fx)
	// The reader has read 0..5 (the most recent first: 5 the least), keeps 5.
	require.NoError(t, tab.Release(reader, res.Lease))
	j.add(must(tab.ReleaseDone(res.Lease)))
	res, fx, err = tab.Match(reader, []kv.Hash{chainHash(1, 5)})
	require.NoError(t, err)
	j.add(fx)
	rl := res.Lease
	wl, wp := alloc(t, tab, j, writer, 1)
	require.Equal(t, []uint32{6}, wp)
	fx, err = tab.Shrink(4)
	require.NoError(t, err)
	j.add(fx)
	require.NoError(t, tab.Check())
	return tab, j, rl, wl, fx
}

// TestShrinkWaitsForLeases: a shrink evicts the unleased pages it gives back (their
// bytes copied to the host tier), hands none out or matches none again, and is
// over only once every lease of its pages has ended and every copy has completed.
// Without the rule (ShrinkTakes) the reader's lease is taken from under it.
func TestShrinkWaitsForLeases(t *testing.T) {
	tab, j, rl, wl, sfx := shrinkScene(t, pages.Rules{})
	require.Len(t, sfx.Copies, 1, "page 4 is copied out")
	assert.Equal(t, []uint32{4}, sfx.Copies[0].GPU)
	assert.Equal(t, pages.Spill, sfx.Copies[0].Kind)
	require.Len(t, sfx.Records, 1)
	assert.Equal(t, pages.Record{Seq: sfx.Records[0].Seq, Kind: pages.RecFree, Page: 4}, sfx.Records[0])
	to, ok := tab.Shrinking()
	assert.True(t, ok)
	assert.Equal(t, 4, to)
	assert.Equal(t, 8, tab.Mapped())

	// Nothing past page 3 is handed out or matched.
	_, _, _, err := tab.Alloc(other, 5)
	require.ErrorIs(t, err, pages.ErrNoSpace, "pages 0..3 are all an Alloc may take")
	res, fx, err := tab.Match(other, []kv.Hash{chainHash(1, 5)})
	require.NoError(t, err)
	j.add(fx)
	assert.Zero(t, res.Lease, "page 5 is given back: matched no more")
	require.ErrorIs(t, tab.Grow(4), pages.ErrInput)
	_, err = tab.Shrink(4)
	require.ErrorIs(t, err, pages.ErrInput)

	_, _, err = tab.Shrunk()
	require.ErrorIs(t, err, pages.ErrInUse)
	assert.Contains(t, err.Error(), "3 of the 4")
	_, fx, err = tab.CopyDone(sfx.Copies[0].ID, true)
	require.NoError(t, err)
	j.add(fx)
	_, ok = tab.HostLookup(chainHash(1, 4))
	assert.True(t, ok, "page 4's bytes are in the host tier")

	// The writer seals page 6 (chain 2): published, sealed and unheld until Drain
	// evicts it.
	j.add(must(tab.Seal(writer, wl, []kv.Hash{chainHash(2, 0)}, pages.NoRef)))
	_, _, err = tab.Shrunk()
	require.ErrorIs(t, err, pages.ErrInUse)
	_, _, fx, err = tab.SealDone(wl, true)
	require.NoError(t, err)
	j.add(fx)
	assert.Empty(t, fx.Copies, "only Shrink and Drain evict the pages given back")
	res, fx, err = tab.Match(other, []kv.Hash{chainHash(2, 0)})
	require.NoError(t, err)
	j.add(fx)
	assert.Zero(t, res.Lease, "a page given back, sealed since, is not matched")
	_, _, err = tab.Shrunk()
	require.ErrorIs(t, err, pages.ErrInUse, "page 6 waits for Drain")
	fx, left := tab.Drain()
	j.add(fx)
	assert.Equal(t, 2, left, "page 5 read, page 6 read by its copy out")
	_, ok = tab.Lookup(chainHash(2, 0))
	assert.False(t, ok, "Drain evicted it")
	require.Len(t, fx.Copies, 1, "and copied it out")
	_, fx, err = tab.CopyDone(fx.Copies[0].ID, true)
	require.NoError(t, err)
	j.add(fx)

	_, _, err = tab.Shrunk()
	require.ErrorIs(t, err, pages.ErrInUse, "the reader still holds page 5")
	require.NoError(t, tab.Release(reader, rl))
	_, _, err = tab.Shrunk()
	require.ErrorIs(t, err, pages.ErrInUse, "until its release completes")
	j.add(must(tab.ReleaseDone(rl)))
	fx, left = tab.Drain()
	j.add(fx)
	assert.Equal(t, 1, left)
	require.Len(t, fx.Copies, 1, "page 5, let go, is evicted and copied out")
	_, _, err = tab.Shrunk()
	require.ErrorIs(t, err, pages.ErrInUse, "until the copy completes")
	_, fx, err = tab.CopyDone(fx.Copies[0].ID, true)
	require.NoError(t, err)
	j.add(fx)
	require.NoError(t, tab.Check())
	to, wait, err := tab.Shrunk()
	require.NoError(t, err)
	assert.Equal(t, 4, to)
	assert.Equal(t, j.recs[len(j.recs)-1].Seq, wait)
	assert.Equal(t, 4, tab.Mapped())
	_, ok = tab.Shrinking()
	assert.False(t, ok)
	_, _, err = tab.Shrunk()
	require.ErrorIs(t, err, pages.ErrInput, "no shrink in progress")
	require.NoError(t, tab.Check())
	for _, h := range []kv.Hash{chainHash(1, 4), chainHash(1, 5), chainHash(2, 0)} {
		_, ok = tab.HostLookup(h)
		assert.True(t, ok, "every sealed page given back is in the host tier")
	}
	st, _, _ := tab.Page(7)
	assert.Equal(t, pages.Free, st, "a page given back is free, not out of range")
	assert.Equal(t, pages.NoRef, tab.Ref(7))
	again := j.restart(t, pages.Config{Pages: 4, Bound: 8, HostPages: 4, Epoch: 1}, pages.Rules{})
	assert.Equal(t, 4, again.Stats().Sealed, "the journal names no page past 3")

	tab, _, rl, _, _ = shrinkScene(t, pages.Rules{ShrinkTakes: true})
	_, held := tab.Lease(rl)
	assert.False(t, held, "without the rule, the shrink takes the reader's lease")
}

// TestGrowStopsShrink: growing during a shrink takes back the pages given back
// below the new size as they are, leases and bytes kept; growing past Mapped ends
// the shrink.
func TestGrowStopsShrink(t *testing.T) {
	tab, j, rl, _, _ := shrinkScene(t, pages.Rules{})
	require.NoError(t, tab.Grow(6))
	to, ok := tab.Shrinking()
	assert.True(t, ok)
	assert.Equal(t, 6, to)
	require.NoError(t, tab.Check())
	res, fx, err := tab.Match(other, []kv.Hash{chainHash(1, 5)})
	require.NoError(t, err)
	j.add(fx)
	assert.Equal(t, []uint32{5}, res.Pages, "page 5 is the table's again, and matched")
	info, held := tab.Lease(rl)
	require.True(t, held)
	assert.Equal(t, []uint32{5}, info.Pages)
	_, ok = tab.Lookup(chainHash(1, 4))
	assert.False(t, ok, "page 4, evicted, stays evicted")
	_, _, err = tab.Shrunk()
	require.ErrorIs(t, err, pages.ErrInUse, "page 6 is written")
	require.NoError(t, tab.Grow(8))
	_, ok = tab.Shrinking()
	assert.False(t, ok)
	assert.Equal(t, 8, tab.Mapped())
	_, _, err = tab.Shrunk()
	require.ErrorIs(t, err, pages.ErrInput)
	assert.Equal(t, 2, tab.Stats().Free, "pages 4 and 7 free")
	require.NoError(t, tab.Check())
}

// TestRestartMidShrink: an owner that restarts mid-shrink, its memory held, maps
// every page again and starts over: the shrink is forgotten, the leases from
// before (stranded) are not taken by the new shrink, which is over once their
// holders have declared or died.
func TestRestartMidShrink(t *testing.T) {
	_, j, _, _, _ := shrinkScene(t, pages.Rules{})
	cfg := pages.Config{Pages: 8, HostPages: 4, Epoch: 1}
	tab := j.restart(t, cfg, pages.Rules{})
	_, ok := tab.Shrinking()
	assert.False(t, ok)
	_, ok = tab.Lookup(chainHash(1, 4))
	assert.False(t, ok, "page 4's eviction was journaled")
	j.add(must(tab.Shrink(4)))
	require.NoError(t, tab.Check())
	_, _, err := tab.Shrunk()
	require.ErrorIs(t, err, pages.ErrInUse, "the stranded leases hold pages 5 and 6")
	j.add(tab.HolderDead(writer))
	j.add(tab.Declared(reader))
	fx, left := tab.Drain()
	j.add(fx)
	assert.Equal(t, 1, left, "page 5 read by its copy out")
	require.Len(t, fx.Copies, 1, "page 5, let go, is copied out")
	_, fx, err = tab.CopyDone(fx.Copies[0].ID, true)
	require.NoError(t, err)
	j.add(fx)
	to, _, err := tab.Shrunk()
	require.NoError(t, err)
	assert.Equal(t, 4, to)
	require.NoError(t, tab.Check())
}

// TestGrowKeepsLeavesFirst: pages given back whose leases ended wait, sealed, for
// Drain; a grow that takes them back lists them again with their ancestors more
// recent than they, so that eviction still takes a chain's leaves first.
func TestGrowKeepsLeavesFirst(t *testing.T) {
	tab, j := fresh(t, pages.Config{Pages: 8, Epoch: 1})
	hs := []kv.Hash{chainHash(1, 0), chainHash(1, 1), chainHash(1, 2), chainHash(1, 3), chainHash(1, 4), chainHash(1, 5)}
	require.Equal(t, []uint32{0, 1, 2, 3, 4, 5}, seal(t, tab, j, writer, hs...))
	res, fx, err := tab.Match(reader, hs)
	require.NoError(t, err)
	j.add(fx)
	j.add(must(tab.Shrink(4)))
	require.NoError(t, tab.Release(reader, res.Lease))
	j.add(must(tab.ReleaseDone(res.Lease)))
	require.NoError(t, tab.Grow(8), "pages 4 and 5 back, sealed, not drained")
	require.NoError(t, pages.LeavesFirst(tab))
	gpu, _ := pages.Order(tab)
	assert.Equal(t, []uint32{0, 1, 2, 3, 4, 5}, gpu, "the chain's root the most recent")
	require.NoError(t, tab.Check())
}
