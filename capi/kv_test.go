//go:build cgo

package main

import (
	"context"
	"os"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/cudapool/cudapool/cudart"
	"github.com/cudapool/cudapool/cudart/cudarttest"
	"github.com/cudapool/cudapool/internal/testwait"
	"github.com/cudapool/cudapool/kv"
	"github.com/cudapool/cudapool/kv/owner"
	"github.com/cudapool/cudapool/kv/replica"
)

// kvSmall is a geometry of 64 KiB slabs.
var kvSmall = kv.Geometry{Layers: 2, KVHeads: 2, HeadDim: 8, TokensPerPage: 4, DType: kv.DTypeFP32, Pages: 64}

// kvOwner serves a new directory with an owner on a software device of its own (as a
// process of its own would) and returns the directory and the owner.
func kvOwner(t *testing.T) (string, *owner.Owner) {
	t.Helper()
	dir, err := os.MkdirTemp("", "capikv")
	require.NoError(t, err)
	t.Cleanup(func() { os.RemoveAll(dir) })
	dev := cudarttest.ForTest(t)
	o, err := owner.Listen(dir, dev, owner.Options{Geometry: kvSmall, Devices: []int{0}, NoAnnounce: true})
	require.NoError(t, err)
	t.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), testwait.Bound)
		defer cancel()
		_ = o.Close(ctx) // the test's end: what it checks is checked already
	})
	return dir, o
}

// kvDial is a replica of the owner at dir as C holds it, on the library's runtime.
func kvDial(t *testing.T, dir string) (*kvReplica, cudart.Stream) {
	t.Helper()
	rt, err := runtimeNow()
	require.NoError(t, err)
	ctx, cancel := context.WithTimeout(context.Background(), testwait.Bound)
	defer cancel()
	r, err := replica.Dial(ctx, dir, rt, 0)
	require.NoError(t, err)
	k := newKVReplica(r, "", 0)
	s, err := rt.StreamCreate(0, cudart.StreamNonBlocking)
	require.NoError(t, err)
	t.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), testwait.Bound)
		defer cancel()
		_ = k.close(ctx)           // the test's end
		_ = rt.StreamDestroy(0, s) // the test's end
	})
	return k, s
}

// ownerLeases is the number of leases the owner holds for its one replica.
func ownerLeases(o *owner.Owner) int {
	n := 0
	for _, r := range o.Stats().Replicas {
		n += r.Leases
	}
	return n
}

// TestTimedOutSealOrReleaseHoldsNothing: a seal or release whose time ran out may have
// reached the owner, which then ended the lease. capi kept the lease in its table, so
// every later batch naming it failed whole with StaleLease, and it stayed there
// forever. The call holds nothing, as CUDAPOOL_ETIMEOUT says: the table forgets the
// lease and the owner ends up holding none of it.
func TestTimedOutSealOrReleaseHoldsNothing(t *testing.T) {
	dir, o := kvOwner(t)
	k, s := kvDial(t, dir)
	ctx, cancel := context.WithTimeout(context.Background(), testwait.Bound)
	defer cancel()
	spent, stop := context.WithCancel(context.Background())
	stop() // a context that has run out: the request goes, its answer is not waited for

	for _, how := range []string{"seal", "release"} {
		l, err := k.r.Alloc(ctx, 2)
		require.NoError(t, err)
		k.put(l)
		keep, err := k.r.Alloc(ctx, 1)
		require.NoError(t, err)
		k.put(keep)
		if how == "seal" {
			_, err = k.seal(spent, l.ID(), kv.PrefixHashes("", []int32{1, 2, 3, 4, 5, 6, 7, 8}, 4), s, false)
		} else {
			err = k.release(spent, []uint64{l.ID()}, s)
		}
		if err != nil { // else the answer was there before the wait looked at the context
			require.ErrorIs(t, err, context.Canceled, how)
		}
		k.mu.Lock()
		_, kept := k.leases[l.ID()]
		k.mu.Unlock()
		assert.False(t, kept, "%s: the C table still holds the lease its timed-out call named", how)
		deadline := time.Now().Add(testwait.Bound)
		for ownerLeases(o) != 1 && time.Now().Before(deadline) {
			time.Sleep(time.Millisecond)
		}
		assert.Equal(t, 1, ownerLeases(o), "%s: the owner holds only the other lease", how)
		// A batch naming the other lease alone is released: nothing stale lingers.
		require.NoError(t, k.release(ctx, []uint64{keep.ID()}, s), how)
		require.Equal(t, 0, ownerLeases(o), how)
	}
}
