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
