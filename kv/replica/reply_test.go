package replica_test

import (
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"runtime"
	"slices"
	"sync"
	"sync/atomic"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/cudapool/cudapool/cudart"
	"github.com/cudapool/cudapool/cudart/cudarttest"
	"github.com/cudapool/cudapool/internal/testwait"
	"github.com/cudapool/cudapool/kv"
	"github.com/cudapool/cudapool/kv/kvtest"
	"github.com/cudapool/cudapool/kv/replica"
)

// Issue 29: a reply reaches the call that made its request, and only it, across
// reconnections. The connection fails at the worst point, as the reader has read its
// own call's reply and not handed it on yet; the replica reconnects (to an owner that
// keeps every lease), and each Match after it gets its own pages. It failed before
// the fix: the call whose reply was read went back to a pool still signalled by the
// failure, so the next Match, on a live connection, failed at once with
// kv.ErrOwnerGone and left its request's id to the recycled object, through which a
// later Match took another's reply.
func TestRepliesReachTheirCallsAcrossReconnects(t *testing.T) {
	// One P: an object recycled through a pool goes to the very next call, so that a
	// leftover signal is met at once rather than by chance.
	defer runtime.GOMAXPROCS(runtime.GOMAXPROCS(1))
	echo := kvtest.NewEcho(t, cudarttest.ForTest(t), small)
	r, _, s := dial(t, echo.Dir(), 0, replica.WithReconnect())
	var armed atomic.Bool
	injected := errors.New("failed by the test as the reply was read")
	replica.OnReply(r, func(uint32) {
		if armed.CompareAndSwap(true, false) {
			replica.FailConn(r, injected)
		}
	})
	next := 0
	match := func() (*replica.Lease, []kv.Hash, error) {
		hashes := []kv.Hash{{byte(next % small.Pages), byte(next)}}
		next++
		l, err := r.Match(bound(t), hashes)
		return l, hashes, err
	}
	const rounds, after = 16, 4
	for round := range rounds {
		armed.Store(true)
		l, hashes, err := match()
		if err != nil {
			require.ErrorIs(t, err, kv.ErrOwnerGone, "round %d: the Match the connection failed under", round)
		} else {
			require.Equal(t, echo.Pages(hashes), l.Pages(), "round %d: the Match the connection failed under got another's pages", round)
		}
		require.NoError(t, r.WaitAttached(bound(t)), "round %d", round)
		require.Equal(t, uint64(round+1), r.Reattaches())
		if err == nil {
			require.NoError(t, l.Lost(), "round %d: the owner kept every lease", round)
			require.NoError(t, r.Release(bound(t), l, s), "round %d: the lease re-declared", round)
		}
		for i := range after {
			l, hashes, err := match()
			require.NoError(t, err, "round %d, Match %d after the reconnection", round, i)
			require.Equal(t, echo.Pages(hashes), l.Pages(), "round %d, Match %d after the reconnection got another's pages", round, i)
			require.NoError(t, r.Release(bound(t), l, s), "round %d, Release %d after the reconnection", round, i)
		}
	}
	require.Empty(t, echo.Leases(), "leases the owner holds after every one was released")
}

// TestRepliesReachTheirCallsAcrossReconnects with four goroutines, as issue 29 saw it:
// each Matches and Releases in turn while the connection fails after a seeded number
// of replies read (1 to 6), the replica reconnecting each time; every Match gets its
// own pages or kv.ErrOwnerGone, and every lease is released in the end (a Release
// that failed with kv.ErrOwnerGone is made again once attached). Which reply the
// failure meets depends on how the goroutines interleave; the seed fixes how often.
func TestRepliesReachTheirCallsUnderConcurrentReconnects(t *testing.T) {
	const goroutines, matches, seed = 4, 40, 29
	echo := kvtest.NewEcho(t, cudarttest.ForTest(t), small)
	r, _, s := dial(t, echo.Dir(), 0, replica.WithReconnect())
	rng := rand.New(rand.NewPCG(seed, 0))
	var mu sync.Mutex
	left, fails := 1+rng.IntN(6), 0
	replica.OnReply(r, func(uint32) {
		mu.Lock()
		left--
		fail := left == 0
		if fail {
			left, fails = 1+rng.IntN(6), fails+1
		}
		mu.Unlock()
		if fail {
			replica.FailConn(r, errors.New("failed by the test"))
		}
	})
	errs := make(chan error, goroutines)
	for g := range goroutines {
		go func() { errs <- matchAndRelease(bound(t), r, echo, s, g, matches) }()
	}
	for range goroutines {
		require.NoError(t, testwait.Recv(t, errs, "a goroutine's Matches and Releases"))
	}
	t.Logf("%d failures injected, %d reattaches", fails, r.Reattaches())
	require.Empty(t, echo.Leases(), "leases the owner holds after every one was released")
}

// matchAndRelease Matches n chains of goroutine g's through r from echo,
// each of its own pages, and releases each lease on s, waiting for the reconnection
// where the owner is gone.
func matchAndRelease(ctx context.Context, r *replica.Replica, echo *kvtest.Echo, s cudart.Stream, g, n int) error {
	for i := range n {
		hashes := []kv.Hash{{byte((g*n + i) % small.Pages), byte(g), byte(i)}, {byte(i % small.Pages), byte(g), byte(i), 1}}
		l, err := r.Match(ctx, hashes)
		if errors.Is(err, kv.ErrOwnerGone) {
			if err := r.WaitAttached(ctx); err != nil {
				return err
			}
			continue
		}
		if err != nil {
			return fmt.Errorf("goroutine %d, Match %d: %w", g, i, err)
		}
		if !slices.Equal(echo.Pages(hashes), l.Pages()) {
			return fmt.Errorf("goroutine %d, Match %d got pages %v, another's: want %v", g, i, l.Pages(), echo.Pages(hashes))
		}
		for {
			err := r.Release(ctx, l, s)
			if !errors.Is(err, kv.ErrOwnerGone) {
				if err != nil {
					return fmt.Errorf("goroutine %d, Release %d: %w", g, i, err)
				}
				break
			}
			if err := r.WaitAttached(ctx); err != nil {
				return err
			}
		}
	}
	return nil
}

// The leases a restarted owner is told of are those the replica holds as the
// connection fails: one whose grant was read just before is re-declared, and one
// whose release was answered just before is not (else the new owner would hold its
// pages for good). The connection fails as a Match, then a Release, has its reply,
// and the re-declaration ends before the call returns. Before the fix, the replica
// recorded what the reply did only after that: the restarted owner did not hold the
// lease matched (its Release failed with kv.ErrStaleLease), and held the one released.
func TestReattachDeclaresTheLeasesTheRepliesLeft(t *testing.T) {
	echo := kvtest.NewEcho(t, cudarttest.ForTest(t), small)
	r, _, s := dial(t, echo.Dir(), 0, replica.WithReconnect())
	var armed atomic.Bool
	replica.OnReplied(r, func() {
		if armed.CompareAndSwap(true, false) {
			replica.FailConn(r, errors.New("failed by the test as the reply came"))
			testwait.Recv(t, echo.Listed(), "the re-declaration to the restarted owner")
		}
	})
	armed.Store(true)
	l, err := r.Match(bound(t), []kv.Hash{{1}})
	require.NoError(t, err)
	require.NoError(t, r.WaitAttached(bound(t)))
	require.Equal(t, []uint64{l.ID()}, echo.Leases(), "the leases the restarted owner holds after a Match answered as the connection failed")
	require.NoError(t, l.Lost())
	armed.Store(true)
	require.NoError(t, r.Release(bound(t), l, s))
	require.NoError(t, r.WaitAttached(bound(t)))
	require.Empty(t, echo.Leases(), "the leases the restarted owner holds after a Release answered as the connection failed")
	require.Equal(t, uint64(2), r.Reattaches())
}

// A Release whose caller gave up before its reply (its ctx ended) still ends the
// lease for the replica once the reply comes: the restarted owner is not told of it.
// It failed before: the lease stayed among those held, and was re-declared to the
// restarted owner, which then held its pages until Close.
func TestReleaseGivenUpOnIsNotRedeclared(t *testing.T) {
	echo := kvtest.NewEcho(t, cudarttest.ForTest(t), small)
	r, _, s := dial(t, echo.Dir(), 0, replica.WithReconnect())
	l, err := r.Match(bound(t), []kv.Hash{{1}})
	require.NoError(t, err)

	waiting, resume := echo.HoldReplies()
	ctx, cancel := context.WithCancel(context.Background())
	released := make(chan error, 1)
	go func() { released <- r.Release(ctx, l, s) }()
	testwait.Recv(t, waiting, "the owner's Released, held back")
	cancel()
	require.ErrorIs(t, testwait.Recv(t, released, "the Release given up on"), context.Canceled)
	resume()
	// Replies come in order: once this Match has its own, the Released was read.
	other, err := r.Match(bound(t), []kv.Hash{{2}})
	require.NoError(t, err)

	replica.FailConn(r, errors.New("failed by the test"))
	require.NoError(t, r.WaitAttached(bound(t)))
	require.Equal(t, []uint64{other.ID()}, echo.Leases(), "the leases re-declared: the one matched, not the one released")
}
