package e2e_test

import (
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/cudapool/cudapool/cudart"
	"github.com/cudapool/cudapool/export/internal/exporttest"
)

// A block released while another block of its slab keeps the import: its Release
// still orders the release stream after the caller's stream, so that the import's
// free, whichever Release issues it on whichever stream, follows this block's use too.
// (It did not: a block written on a busy stream and released, then another released on
// an idle stream, had the import freed under the busy stream's write.)
func TestRangeReleaseOrdersTheImportsFree(t *testing.T) {
	pr := exporttest.NewProducer(t, nil, nil)
	ctx := exporttest.Ctx(t)
	rp := exporttest.RetainingPair{Pr: pr}
	_, names := rp.Slab(t, 2, 64<<10, 0)
	c := exporttest.NewConsumer(t, pr.Path, 0)
	other, err := c.Dev.StreamCreate(0, cudart.StreamNonBlocking)
	require.NoError(t, err)
	busy, err := c.Imp.Open(ctx, names[0], c.Stream)
	require.NoError(t, err)
	last, err := c.Imp.Open(ctx, names[1], other)
	require.NoError(t, err)
	require.NoError(t, c.Dev.StreamSynchronize(0, c.Stream)) // the ready waits are done
	resume := exporttest.Stall(t, c.Side)
	// The busy stream's last use of its block, still queued when the block is released.
	require.NoError(t, c.Dev.MemsetAsync(0, busy.Ptr(), 0x5a, busy.Size(), c.Stream))
	require.NoError(t, busy.Release(ctx, c.Stream))
	require.NoError(t, last.Release(ctx, other)) // frees the import on the release stream
	require.NoError(t, c.Dev.Err(), "the import was freed before the busy stream's use of it")
	resume()
	require.NoError(t, c.Dev.Synchronize(), "the import was freed before the busy stream's use of it")
	c.CheckClean(t)
}
