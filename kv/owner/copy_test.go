package owner_test

import (
	"context"
	"os"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/cudapool/cudapool/cudart/cudarttest"
	"github.com/cudapool/cudapool/internal/testwait"
	"github.com/cudapool/cudapool/kv/owner"
	"github.com/cudapool/cudapool/kv/replica"
)

// A cross-device copy whose stream does not run holds nothing without bound: the
// Match waiting for it ends at the owner's Close, and Close(1 s) returns.
func TestCloseEndsAHungCrossDeviceCopy(t *testing.T) {
	dir, err := os.MkdirTemp("", "kvc")
	require.NoError(t, err)
	t.Cleanup(func() { os.RemoveAll(dir) })
	odev := cudarttest.ForTest(t)
	o, err := owner.Listen(dir, odev, small, owner.WithDevices(0, 1))
	require.NoError(t, err)
	wdev, rdev := cudarttest.ForTest(t), cudarttest.ForTest(t)
	w, err := replica.Dial(bound(t), dir, wdev, 0)
	require.NoError(t, err)
	r, err := replica.Dial(bound(t), dir, rdev, 1)
	require.NoError(t, err)
	ctx := bound(t)
	hashes := w.Hashes(make([]int32, 2*small.TokensPerPage))
	l, err := w.Alloc(ctx, 2)
	require.NoError(t, err)
	_, err = w.Seal(ctx, l, hashes, 0, replica.WaitVisible())
	require.NoError(t, err)

	resume, err := odev.Stall(0, owner.SlabStream(o, 0))
	require.NoError(t, err)
	defer resume()
	matched := make(chan error, 1)
	go func() {
		_, err := r.Match(ctx, hashes)
		matched <- err
	}()
	require.Eventually(t, func() bool { return o.Stats().Devices[1].Writing == 2 }, testwait.Bound, time.Millisecond, "the copy to start")
	closed := make(chan error, 1)
	go func() {
		cctx, cancel := context.WithTimeout(context.Background(), time.Second)
		defer cancel()
		closed <- o.Close(cctx)
	}()
	err = testwait.Recv(t, closed, "the owner's Close(1 s) with a copy hung")
	t.Logf("Close: %v", err)
	assert.Error(t, testwait.Recv(t, matched, "the Match whose copy hung"))
	resume()
	_ = w.Close(bound(t)) // the owner is gone: they complete, and return nil
	_ = r.Close(bound(t))
}
