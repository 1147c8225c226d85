package replica_test

import (
	"context"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/cudapool/cudapool/internal/testwait"
	"github.com/cudapool/cudapool/kv"
	"github.com/cudapool/cudapool/kv/replica"
)

// An Alloc right after a release of the whole pool, whose pages still settle behind
// the releasing stream, waits for them instead of answering NoSpace, and is answered
// once they have settled; meanwhile the replica's other requests are served. One that
// no settling page can help is refused at once.
func TestAllocWaitsForSettlingPages(t *testing.T) {
	g := small
	g.Pages = 8
	o, _, dir := startOwner(t, g)
	r, rdev, rs := dial(t, dir, 0)
	ctx := bound(t)
	all, err := r.Alloc(ctx, 8)
	require.NoError(t, err)
	resume, err := rdev.Stall(0, rs)
	require.NoError(t, err)
	t.Cleanup(resume)
	require.NoError(t, r.Release(ctx, all, rs))
	assert.Equal(t, 8, device0(o).Settling)

	_, err = r.Alloc(ctx, 9)
	require.ErrorIs(t, err, kv.ErrGeometry, "more than the slab")
	got := make(chan error, 1)
	var l *replica.Lease
	go func() {
		var err error
		l, err = r.Alloc(ctx, 8)
		got <- err
	}()
	eventually(t, "the Alloc to wait for the settling pages", func() bool {
		select {
		case err := <-got:
			t.Fatalf("the Alloc was answered (%v) before the pages settled", err)
		default:
		}
		return o.Pace().AllocWaits == 1
	})
	_, err = r.Stats(ctx)
	require.NoError(t, err, "the replica's other requests are served while its Alloc waits")
	select {
	case err := <-got:
		t.Fatalf("the Alloc was answered (%v) before the pages settled", err)
	default:
	}
	resume()
	require.NoError(t, testwait.Recv(t, got, "the Alloc's answer once the pages settled"))
	assert.Len(t, l.Pages(), 8)

	// Nothing settles now: an Alloc of more than is free is refused at once, and one
	// whose ctx ends first gives up (the late lease, if any, is released).
	_, err = r.Alloc(ctx, 1)
	require.ErrorIs(t, err, kv.ErrNoSpace, "every page is held")
	short, cancel := context.WithCancel(ctx)
	cancel()
	_, err = r.Alloc(short, 1)
	require.ErrorIs(t, err, context.Canceled)
	require.NoError(t, r.Release(ctx, l, rs))
}
