package replica_test

import (
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/cudapool/cudapool/kv/replica"
)

// A chain grown the usual way, a match of its prefix and then a seal of the rest, is
// evicted leaf first: the pages sealed last are the chain's leaves, and its parents,
// matched before them, must stay more recent (issue 23, N10).
func TestEvictionLeavesFirstAfterAGrownChain(t *testing.T) {
	g := small
	g.Pages = 8
	o, _, dir := startOwner(t, g)
	r, rdev, rs := dial(t, dir, 0)
	ctx := bound(t)
	toks := tokens(g, 6, 21)
	all := r.Hashes(toks)
	l, err := r.Alloc(ctx, 3)
	require.NoError(t, err)
	write(t, rdev, r, rs, l.Pages(), all[:3])
	res, err := r.Seal(ctx, l, all[:3], rs, replica.WaitVisible())
	require.NoError(t, err)
	require.Equal(t, 3, res.Visible)

	// Grow it: the prefix matched, the rest written and sealed.
	m, err := r.Match(ctx, all)
	require.NoError(t, err)
	require.Len(t, m.Pages(), 3)
	w, err := r.Alloc(ctx, 3)
	require.NoError(t, err)
	write(t, rdev, r, rs, w.Pages(), all[3:])
	res, err = r.Seal(ctx, w, all[3:], rs, replica.WaitVisible())
	require.NoError(t, err)
	require.Equal(t, 3, res.Visible)
	require.NoError(t, r.Release(ctx, m, rs))
	eventually(t, "the match's release to settle", func() bool { return device0(o).Releasing == 0 })

	// The 2 free pages and then one eviction.
	hold, err := r.Alloc(ctx, 3)
	require.NoError(t, err)
	assert.Equal(t, uint64(1), device0(o).Evictions)
	got, err := r.Match(ctx, all)
	require.NoError(t, err)
	assert.Len(t, got.Pages(), 5, "the chain lost its leaf; a parent evicted first leaves the rest unmatched")
	require.NoError(t, r.ReleaseAll(ctx, []*replica.Lease{got, hold}, rs))
}
