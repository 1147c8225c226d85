package replica_test

import (
	"context"
	"math/rand/v2"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/cudapool/cudapool/cudart"
	"github.com/cudapool/cudapool/kv"
	"github.com/cudapool/cudapool/kv/owner"
	"github.com/cudapool/cudapool/kv/replica"
)

// Seals on several streams of one replica become visible through each stream's
// notifier, each once its own stream has run and not before: the streams, stalled
// behind their writes, are resumed in a seeded order, and after each the pages of the
// streams still stalled stay invisible while the resumed stream's appear, with the
// bytes written. One eventfd per stream, and the owner makes one notifier wait per
// stream with a seal pending.
func TestSealsOnSeveralStreamsBecomeVisibleInTheirOrder(t *testing.T) {
	o, calls, dir := countedOwner(t)
	w, wdev, _ := dial(t, dir, 0)
	r, rdev, rs := dial(t, dir, 0)
	ctx := bound(t)
	const streams = 3
	seed := uint64(7)
	t.Logf("seed %d", seed)
	rng := rand.New(rand.NewPCG(seed, 29))
	type lane struct {
		s      cudart.Stream
		resume func()
		hashes []kv.Hash
		pages  []uint32
	}
	lanes := make([]*lane, streams)
	for i := range lanes {
		s, err := wdev.StreamCreate(0, cudart.StreamNonBlocking)
		require.NoError(t, err)
		t.Cleanup(func() {
			require.NoError(t, w.Forget(s))
			wdev.StreamDestroy(0, s)
		})
		resume, err := wdev.Stall(0, s)
		require.NoError(t, err)
		t.Cleanup(resume)
		l, hashes := written(t, wdev, w, s, int32(40+i), 2)
		res, err := w.Seal(ctx, l, hashes, s)
		require.NoError(t, err)
		require.Equal(t, replica.SealResult{Pending: 2}, res, "stream %d is stalled", i)
		lanes[i] = &lane{s: s, resume: resume, hashes: hashes, pages: l.Pages()}
	}
	assert.Equal(t, streams, o.Pace().Waiting, "a notifier waiting per stream")
	assert.Equal(t, streams, replica.OpenEventfds(w), "an eventfd per stream")
	called := calls.Calls()
	order := rng.Perm(streams)
	for k, i := range order {
		lanes[i].resume()
		eventually(t, "the resumed stream's seal to become visible", func() bool {
			m, err := r.Match(ctx, lanes[i].hashes)
			require.NoError(t, err)
			defer func() { require.NoError(t, r.Release(ctx, m, rs)) }()
			return len(m.Pages()) == 2
		})
		m, err := r.Match(ctx, lanes[i].hashes)
		require.NoError(t, err)
		assert.Equal(t, lanes[i].pages, m.Pages())
		require.NoError(t, check(rdev, r, rs, m.Pages(), lanes[i].hashes), "stream %d's bytes", i)
		require.NoError(t, r.Release(ctx, m, rs))
		for _, j := range order[k+1:] {
			m, err := r.Match(ctx, lanes[j].hashes)
			require.NoError(t, err)
			assert.Empty(t, m.Pages(), "stream %d, still stalled, is not visible", j)
		}
		assert.Equal(t, streams-k-1, o.Pace().Waiting, "notifiers still waiting")
	}
	assert.Equal(t, called, calls.Calls(), "no driver call of the owner's made them visible")
	assert.Equal(t, 3*2, device0(o).Sealed)
}

// A forgotten stream's notifier serves the next new stream once its work has all
// completed: a replica that seals on one short-lived stream after another (each
// given to Forget and destroyed) registers as many notifiers as it uses streams at
// once, and an owner capped at two notifiers serves five such streams in turn.
func TestForgottenStreamsLendTheirNotifiers(t *testing.T) {
	o, _, dir := countedOwner(t, owner.WithMaxNotifiers(2))
	w, wdev, _ := dial(t, dir, 0)
	ctx := bound(t)
	for i := range 5 {
		s, err := wdev.StreamCreate(0, cudart.StreamNonBlocking)
		require.NoError(t, err)
		resume, err := wdev.Stall(0, s)
		require.NoError(t, err)
		l, hashes := written(t, wdev, w, s, int32(60+i), 2)
		res, err := w.Seal(ctx, l, hashes, s)
		require.NoError(t, err, "stream %d", i)
		require.Equal(t, replica.SealResult{Pending: 2}, res, "stream %d is stalled", i)
		resume()
		require.NoError(t, wdev.StreamSynchronize(0, s))
		require.NoError(t, w.Forget(s))
		require.NoError(t, wdev.StreamDestroy(0, s))
	}
	eventually(t, "every seal to become visible", func() bool { return device0(o).Sealed == 5*2 })
	assert.Equal(t, 1, replica.OpenEventfds(w), "one eventfd served the five streams")
}

// A registration that fails (its Seal's ctx had ended before the Notifier frame went
// out) fails that Seal, and the next Seal on the stream registers an eventfd anew:
// the owner never hears of a notifier it was not sent.
func TestAFailedRegistrationIsMadeAgain(t *testing.T) {
	o, _, dir := countedOwner(t)
	w, wdev, ws := dial(t, dir, 0)
	resume, err := wdev.Stall(0, ws)
	require.NoError(t, err)
	t.Cleanup(resume)
	l, hashes := written(t, wdev, w, ws, 70, 2)
	ended, cancel := context.WithCancel(bound(t))
	cancel()
	_, err = w.Seal(ended, l, hashes, ws)
	require.ErrorIs(t, err, context.Canceled)
	res, err := w.Seal(bound(t), l, hashes, ws)
	require.NoError(t, err, "the second seal registers its notifier")
	assert.Equal(t, replica.SealResult{Pending: 2}, res)
	resume()
	eventually(t, "the seal to become visible", func() bool { return device0(o).Sealed == 2 })
}
