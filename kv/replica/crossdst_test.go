package replica_test

import (
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/cudapool/cudapool/kv/replica"
)

// A cross-device match copies each page into the pages it leases on the reader's
// device, whatever their indices: here device 1's first free pages are held, so the
// copies land on other indices than their sources', and the reader checks the bytes
// of the pages it was given. (TestCrossDeviceMatchCopies has the same indices on both
// devices, where a copy into the source's index passes unseen.)
func TestCrossDeviceCopyLandsInTheLeasedPages(t *testing.T) {
	_, _, dir := startOwner(t, small, 0, 1)
	w, wdev, ws := dial(t, dir, 0)
	r, rdev, rs := dial(t, dir, 1)
	ctx := bound(t)
	hold, err := r.Alloc(ctx, 5) // device 1's pages 0-4, as device 0's chain has
	require.NoError(t, err)
	hashes := sealed(t, wdev, w, ws, 13, 5)
	src, err := w.Match(ctx, hashes)
	require.NoError(t, err)
	m, err := r.Match(ctx, hashes)
	require.NoError(t, err)
	require.Len(t, m.Pages(), 5)
	for i, p := range m.Pages() {
		assert.NotEqual(t, src.Pages()[i], p, "page %d: the copy's destination differs from its source", i)
	}
	require.NoError(t, check(rdev, r, rs, m.Pages(), hashes), "the bytes of the pages the reader leased")
	require.NoError(t, r.ReleaseAll(ctx, []*replica.Lease{m, hold}, rs))
	require.NoError(t, w.Release(ctx, src, ws))
}
