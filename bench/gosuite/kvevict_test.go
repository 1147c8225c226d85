package main

import (
	"context"
	"strings"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/cudapool/cudapool/cudart"
	"github.com/cudapool/cudapool/cudart/cudarttest"
	"github.com/cudapool/cudapool/internal/testwait"
	"github.com/cudapool/cudapool/kv"
	"github.com/cudapool/cudapool/kv/owner"
	"github.com/cudapool/cudapool/kv/replica"
)

// The interleaving behind TestKVRowsOnSoftwareDevice's rare "matched 0 of 512 pages",
// forced: a replica's rate cycle seals a batch, and before its Match reaches the
// owner (the replica's process descheduled under load) the other replicas' allocs
// have taken every page older than it, and then the batch itself, least recent of
// what is left: eviction takes a batch sealed and not yet matched, as kv/owner may.
// The row counts such a batch, and the cycle goes on.
func TestKVRateCountsABatchEvictedBeforeItsMatch(t *testing.T) {
	g, err := kv.Layout("llama-0.85b")
	require.NoError(t, err)
	g.Pages = 64
	dir := t.TempDir()
	o, err := owner.Listen(dir, cudarttest.ForTest(t), g)
	require.NoError(t, err)
	ctx, cancel := context.WithTimeout(context.Background(), testwait.Bound)
	t.Cleanup(cancel) // after the closes below, which use it
	t.Cleanup(func() { assert.NoError(t, o.Close(ctx)) })
	load := func() *kvLoad { // a replica, with a runtime of its own as a process has
		rt := cudarttest.ForTest(t)
		r, err := replica.Dial(ctx, dir, rt, 0)
		require.NoError(t, err)
		t.Cleanup(func() { assert.NoError(t, r.Close(ctx)) })
		s, err := rt.StreamCreate(0, cudart.StreamNonBlocking)
		require.NoError(t, err)
		t.Cleanup(func() { assert.NoError(t, rt.StreamDestroy(0, s)) })
		return &kvLoad{r: r, rt: rt, s: s}
	}
	a, other := load(), load()
	other.seq = 1 << 32
	evicted := 0
	a.afterSeal = func() {
		if evicted > 0 {
			return
		}
		evicted++
		// The others fill the slab: its 48 free pages, then the 16 just sealed.
		hs := make([]kv.Hash, g.Pages)
		nextHashes(hs, &other.seq)
		require.NoError(t, other.sealed(ctx, hs, nil))
	}
	line, err := a.rate(ctx, 16, 0)
	require.NoError(t, err, "a batch evicted before its match failed the row")
	f := strings.Fields(line)
	require.Len(t, f, 9, line)
	assert.Equal(t, "1", f[3], "one cycle: %s", line)
	assert.Equal(t, "1", f[8], "the batch evicted before its match is counted: %s", line)
}
