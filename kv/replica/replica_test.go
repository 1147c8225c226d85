package replica_test

import (
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// roles are the processes the tests start (proctest).
var roles = map[string]func(args []string) int{}

// TestRoundTrip writes pages through one replica's mapping, seals them, and reads them
// back through another replica's, matched by their hashes.
func TestRoundTrip(t *testing.T) {
	o, _, dir := startOwner(t, small)
	w, wdev, ws := dial(t, dir, 0)
	r, rdev, rs := dial(t, dir, 0)
	ctx := bound(t)

	hashes := w.Hashes(tokens(small, 5, 1))
	require.Len(t, hashes, 5)
	l, err := w.Alloc(ctx, 5)
	require.NoError(t, err)
	require.True(t, l.Writable())
	require.Len(t, l.Pages(), 5)
	write(t, wdev, w, ws, l.Pages(), hashes)
	res, err := w.Seal(ctx, l, hashes, ws, replicaWait())
	require.NoError(t, err)
	assert.Equal(t, 5, res.Visible)
	assert.Zero(t, res.Pending)

	m, err := r.Match(ctx, hashes, rs)
	require.NoError(t, err)
	assert.False(t, m.Writable())
	assert.Equal(t, l.Pages(), m.Pages(), "the pages the writer sealed")
	require.NoError(t, check(rdev, r, rs, m.Pages(), hashes))

	st := o.Stats()
	require.Len(t, st.Devices, 1)
	assert.Equal(t, 5, st.Devices[0].Sealed)
	assert.Equal(t, 5, st.Devices[0].Leased)
	assert.Equal(t, uint64(5), st.Devices[0].Hits)
	require.NoError(t, r.Release(ctx, rs, m))
	remote, err := r.Stats(ctx)
	require.NoError(t, err)
	assert.Equal(t, small.Pages, remote.Geometry.Pages)
	assert.Equal(t, 0, remote.Devices[0].Leased, "after the release")
	assert.Equal(t, 5, remote.Devices[0].Sealed)
}
