package replica_test

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/cudapool/cudapool/cudart"
	"github.com/cudapool/cudapool/cudart/cudarttest"
	"github.com/cudapool/cudapool/kv"
	"github.com/cudapool/cudapool/kv/replica"
)

// Replicas side by side, on one device and across two, each on a software device of
// its own (as processes are): each writes and seals (without waiting) chains of its
// own, every other round behind a stall of its stream, while the others match and read
// its latest chain and the first chains of two others, so that seals are pending and
// pages are evicted and reused while other replicas read and write other pages of the
// same slab. Every byte read is checked, and every device's rules: a seal made visible
// before its writes ran, or a page reused before its reader's release settled, shows
// as wrong bytes or an unordered read or write. Making the owner take a seal's event
// as completed when its query says pending (submitLocked's "case done:" made
// "case done, !done:") fails it.
func TestReplicasSideBySide(t *testing.T) {
	for _, devices := range []int{1, 2} {
		t.Run(fmt.Sprintf("%d devices", devices), func(t *testing.T) {
			sideBySide(t, devices)
		})
	}
}

// side is one replica of sideBySide.
type side struct {
	r     *replica.Replica
	dev   *cudarttest.Device
	s     cudart.Stream // reads, and the writes of its first chain
	ws    cudart.Stream // the writes of the rounds, stalled every other round
	chain []kv.Hash     // the chain it sealed first, which others read
}

// readEach matches each chain, checks the bytes of the run it got, and releases it.
func (sd side) readEach(ctx context.Context, chains ...[]kv.Hash) error {
	for _, chain := range chains {
		if len(chain) == 0 {
			continue
		}
		m, err := sd.r.Match(ctx, chain)
		if err != nil {
			return fmt.Errorf("match: %w", err)
		}
		if err := check(sd.dev, sd.r, sd.s, m.Pages(), chain); err != nil {
			return err
		}
		if err := sd.r.Release(ctx, m, sd.s); err != nil {
			return fmt.Errorf("release: %w", err)
		}
	}
	return nil
}

func sideBySide(t *testing.T, devices int) {
	const replicas, rounds, pages = 4, 24, 4
	g := small
	g.Pages = 48 // small enough that seals evict
	devs := []int{0}
	if devices == 2 {
		devs = []int{0, 1}
	}
	o, _, dir := startOwner(t, g, devs...)
	sides := make([]side, replicas)
	for i := range sides {
		r, dev, s := dial(t, dir, i%devices)
		ws, err := dev.StreamCreate(i%devices, cudart.StreamNonBlocking)
		require.NoError(t, err)
		t.Cleanup(func() {
			_ = r.Forget(ws) // before ws goes: r's Close records on it otherwise
			dev.StreamDestroy(i%devices, ws)
		})
		sides[i] = side{r: r, dev: dev, s: s, ws: ws, chain: sealed(t, dev, r, s, int32(1000+i), pages)}
	}
	ctx := bound(t)
	var mu sync.Mutex
	latest := make([][]kv.Hash, replicas) // each replica's latest seal, pending or not
	round := func(i, k int) error {
		sd := sides[i]
		hashes := sd.r.Hashes(tokens(g, pages, int32(10000*i+k)))
		w, err := sd.r.Alloc(ctx, pages)
		if errors.Is(err, kv.ErrNoSpace) {
			return nil // every page held by the others' leases at this instant
		}
		if err != nil {
			return fmt.Errorf("alloc: %w", err)
		}
		if k%2 == 0 {
			resume, err := sd.dev.Stall(sd.r.Device(), sd.ws)
			if err != nil {
				return err
			}
			defer resume()
		}
		if err := writeErr(sd.dev, sd.r, sd.ws, w.Pages(), hashes); err != nil {
			return fmt.Errorf("write: %w", err)
		}
		if _, err := sd.r.Seal(ctx, w, hashes, sd.ws); err != nil {
			return fmt.Errorf("seal: %w", err)
		}
		mu.Lock()
		latest[i] = hashes
		a, b := latest[(i+1)%replicas], latest[(i+2)%replicas]
		mu.Unlock()
		return sd.readEach(ctx, a, b, sides[(i+1)%replicas].chain, sides[(i+2)%replicas].chain)
	}
	var wg sync.WaitGroup
	errs := make(chan error, replicas)
	for i := range sides {
		wg.Go(func() {
			for k := range rounds {
				if err := round(i, k); err != nil {
					errs <- fmt.Errorf("replica %d, round %d: %w", i, k, err)
					return
				}
			}
		})
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		require.NoError(t, err)
	}
	for _, sd := range sides {
		require.NoError(t, sd.dev.Err(), "a replica's device saw broken rules")
	}
	var evictions, seals uint64
	for _, d := range o.Stats().Devices {
		evictions += d.Evictions
		seals += d.Seals
	}
	assert.Positive(t, evictions, "pages were evicted and reused while others read")
	assert.Greater(t, seals, uint64(replicas*pages))
}
