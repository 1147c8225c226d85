package replica_test

import (
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/cudapool/cudapool/cudart/cudarttest"
	"github.com/cudapool/cudapool/internal/intercept"
	"github.com/cudapool/cudapool/kv/owner"
	"github.com/cudapool/cudapool/kv/replica"
)

// countedOwner is startOwner with opts and every call the owner makes to its runtime
// counted (calls.Calls()).
func countedOwner(t *testing.T, opts ...owner.Option) (o *owner.Owner, calls *intercept.Runtime, dir string) {
	t.Helper()
	dir = shortDir(t)
	dev := cudarttest.ForTest(t)
	rt := intercept.Wrap(dev)
	o, err := owner.Listen(dir, rt, small, opts...)
	require.NoError(t, err)
	t.Cleanup(func() {
		o.Close(bound(t))
		require.NoError(t, dev.Err(), "the owner's device saw broken rules")
	})
	return o, rt, dir
}

// The owner's pace, by its counters and by every call it makes to its runtime: while a
// seal waits behind a stalled stream the owner makes no driver call at all, however
// many requests it serves meanwhile (it sleeps in the netpoller on the writer's
// eventfd: quiet), and it does not wake; the pages are visible once the stream's point
// is counted (one wake: fast); an owner with nothing pending wakes for nothing and
// calls nothing (idle).
func TestOwnerPace(t *testing.T) {
	o, calls, dir := countedOwner(t)
	w, wdev, ws := dial(t, dir, 0)
	r, _, rs := dial(t, dir, 0)
	ctx := bound(t)
	resume, err := wdev.Stall(0, ws)
	require.NoError(t, err)
	t.Cleanup(resume)
	l, hashes := written(t, wdev, w, ws, 11, 4)
	before, called := o.Pace(), calls.Calls()
	res, err := w.Seal(ctx, l, hashes, ws)
	require.NoError(t, err)
	require.Equal(t, replica.SealResult{Pending: 4}, res)
	assert.Equal(t, owner.Pace{Wakes: before.Wakes, Waiting: 1}, o.Pace(), "one notifier with a seal pending, not woken")
	for range 50 {
		m, err := r.Match(ctx, hashes)
		require.NoError(t, err)
		require.Empty(t, m.Pages(), "the writer's work has not run")
		_, err = r.Stats(ctx)
		require.NoError(t, err)
	}
	assert.Equal(t, owner.Pace{Wakes: before.Wakes, Waiting: 1}, o.Pace(), "no wake while the stream is stalled: requests served meanwhile do not make it poll")
	assert.Equal(t, called, calls.Calls(), "no driver call while the seal is pending")

	resume()
	eventually(t, "the seal to become visible", func() bool { return device0(o).Sealed == 4 })
	settled := o.Pace()
	assert.Equal(t, owner.Pace{Wakes: before.Wakes + 1}, settled, "one wake made the run visible")
	var held []*replica.Lease
	for range 50 {
		m, err := r.Match(ctx, hashes)
		require.NoError(t, err)
		require.Len(t, m.Pages(), 4)
		held = append(held, m)
	}
	assert.Equal(t, settled, o.Pace(), "an owner with nothing pending wakes for nothing")
	assert.Equal(t, called, calls.Calls(), "and calls nothing")
	require.NoError(t, r.ReleaseAll(ctx, held, rs))
}

// A seal and a release from a stream whose work has all completed name no notifier:
// the owner makes them visible (settled) at once, with nothing to read.
func TestIdleStreamNeedsNoPoint(t *testing.T) {
	o, calls, dir := countedOwner(t)
	w, wdev, ws := dial(t, dir, 0)
	ctx := bound(t)
	l, hashes := written(t, wdev, w, ws, 12, 4)
	require.NoError(t, wdev.StreamSynchronize(0, ws))
	before, called := o.Pace(), calls.Calls()
	res, err := w.Seal(ctx, l, hashes, ws)
	require.NoError(t, err)
	assert.Equal(t, replica.SealResult{Visible: 4}, res, "visible at once: the writes had completed")
	m, err := w.Match(ctx, hashes)
	require.NoError(t, err)
	require.NoError(t, w.Release(ctx, m, ws))
	assert.Zero(t, device0(o).Releasing, "settled at once: nothing was queued on the stream")
	assert.Equal(t, before, o.Pace(), "no eventfd was read")
	assert.Equal(t, called, calls.Calls(), "no driver call")
	assert.Zero(t, replica.OpenEventfds(w), "no eventfd was made")
}
