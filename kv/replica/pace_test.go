package replica_test

import (
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/cudapool/cudapool/kv/owner"
	"github.com/cudapool/cudapool/kv/replica"
)

// The owner's pace, by its counters: a seal pending behind a stalled stream costs one
// query at the seal and one wait in the driver, however many requests the owner serves
// meanwhile (no poll while it waits: quiet), the pages are visible once that one wait
// returns (no backoff to sit out: fast), and an owner with nothing pending makes no
// call at all (idle).
func TestOwnerPace(t *testing.T) {
	o, _, dir := startOwner(t, small)
	w, wdev, ws := dial(t, dir, 0)
	r, _, rs := dial(t, dir, 0)
	ctx := bound(t)
	resume, err := wdev.Stall(0, ws)
	require.NoError(t, err)
	t.Cleanup(resume)
	l, hashes := written(t, wdev, w, ws, 11, 4)
	before := o.Pace()
	res, err := w.Seal(ctx, l, hashes, ws)
	require.NoError(t, err)
	require.Equal(t, replica.SealResult{Pending: 4}, res)
	eventually(t, "the owner to wait for the writer's event", func() bool { return o.Pace().Waiting == 1 && o.Pace().Waits == before.Waits+1 })
	waiting := o.Pace()
	assert.Equal(t, before.Queries+1, waiting.Queries, "one query, at the seal")
	for range 50 {
		m, err := r.Match(ctx, hashes)
		require.NoError(t, err)
		require.Empty(t, m.Pages(), "the writer's work has not run")
		_, err = r.Stats(ctx)
		require.NoError(t, err)
	}
	assert.Equal(t, waiting, o.Pace(), "no call while the owner waits: requests served meanwhile do not make it poll")

	resume()
	eventually(t, "the seal to become visible", func() bool { return device0(o).Sealed == 4 })
	eventually(t, "the waiter to return", func() bool { return o.Pace().Waiting == 0 })
	settled := o.Pace()
	assert.Equal(t, owner.Pace{Queries: waiting.Queries, Waits: waiting.Waits}, settled, "one wait made the run visible")
	var held []*replica.Lease
	for range 50 {
		m, err := r.Match(ctx, hashes)
		require.NoError(t, err)
		require.Len(t, m.Pages(), 4)
		held = append(held, m)
	}
	assert.Equal(t, settled, o.Pace(), "an owner with nothing pending makes no call")
	require.NoError(t, r.ReleaseAll(ctx, held, rs))
}

// A seal and a release from a stream whose work has all completed carry no event: the
// owner makes them visible (settled) at once, with no query of the replica's event.
func TestIdleStreamNeedsNoEvent(t *testing.T) {
	o, _, dir := startOwner(t, small)
	w, wdev, ws := dial(t, dir, 0)
	ctx := bound(t)
	l, hashes := written(t, wdev, w, ws, 12, 4)
	require.NoError(t, wdev.StreamSynchronize(0, ws))
	before := o.Pace()
	res, err := w.Seal(ctx, l, hashes, ws)
	require.NoError(t, err)
	assert.Equal(t, replica.SealResult{Visible: 4}, res, "visible at once: the writes had completed")
	m, err := w.Match(ctx, hashes)
	require.NoError(t, err)
	require.NoError(t, w.Release(ctx, m, ws))
	assert.Zero(t, device0(o).Releasing, "settled at once: nothing was queued on the stream")
	assert.Equal(t, before, o.Pace(), "no event was queried or waited for")
}
