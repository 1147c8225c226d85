package owner_test

import (
	"os"
	"path/filepath"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/cudapool/cudapool/cudart/cudarttest"
	"github.com/cudapool/cudapool/internal/testlog"
	"github.com/cudapool/cudapool/internal/testwait"
	"github.com/cudapool/cudapool/kv"
	"github.com/cudapool/cudapool/kv/internal/index"
	"github.com/cudapool/cudapool/kv/owner"
	"github.com/cudapool/cudapool/kv/replica"
)

// A disk that hangs (the index's writer held in its write) while replicas go on
// fails the index once its queue passes its bound, and the owner carries on without
// it: the Alloc that waited for its grant to be written is answered, so are the Alloc
// whose grant took the queue past the bound and a Match, the index's file is gone (no
// restart reads a record of it), and the log says why. (Before, the queue grew with
// every record, and every Alloc and Match waited until its caller gave up.)
func TestAnIndexPastItsBoundLeavesTheOwnerServing(t *testing.T) {
	const maxQueued = 512 // a grant of 32 pages is over 700 bytes of records
	gt := newGate()
	t.Cleanup(owner.SetIndexOptions(index.BeforeWrite(gt.before), index.WithMaxQueued(maxQueued)))
	dir := tempDir(t)
	path := filepath.Join(dir, owner.IndexFile)
	var log testlog.Buffer
	o, err := owner.Listen(dir, cudarttest.ForTest(t), small, owner.WithIndex(path), owner.WithLogger(log.Logger()))
	require.NoError(t, err)
	t.Cleanup(func() { assert.NoError(t, o.Close(bound(t))) })
	t.Cleanup(gt.reopen) // before the Close above: the writer's write returns
	r, err := replica.Dial(bound(t), dir, cudarttest.ForTest(t), 0)
	require.NoError(t, err)
	t.Cleanup(func() { r.Close(bound(t)) })
	other, err := replica.Dial(bound(t), dir, cudarttest.ForTest(t), 0)
	require.NoError(t, err)
	t.Cleanup(func() { other.Close(bound(t)) })
	hashes := sealPages(t, r, 4, 1)
	_, err = other.Stats(bound(t)) // served: its admission is in the index
	require.NoError(t, err)

	gt.close()
	allocated := make(chan error, 1)
	go func() {
		w, err := r.Alloc(bound(t), 1)
		if err == nil {
			_, err = r.Seal(bound(t), w, []kv.Hash{{9, 9}}, 0)
		}
		allocated <- err
	}()
	testwait.Recv(t, gt.inside, "the index's writer held in a write")
	select {
	case err := <-allocated:
		t.Fatalf("an Alloc was answered (%v) before its grant was written, the index not failed", err)
	default:
	}
	w, err := other.Alloc(bound(t), 32) // its grant takes the queue past the bound
	require.NoError(t, err, "an Alloc served with the index failed")
	require.NoError(t, testwait.Recv(t, allocated, "the Alloc that waited for the held write"))
	m, err := other.Match(bound(t), hashes)
	require.NoError(t, err, "a Match served with the index failed")
	assert.Equal(t, len(hashes), len(m.Pages()))
	require.NoError(t, other.Release(bound(t), m, 0))
	_, err = other.Seal(bound(t), w, nil, 0)
	require.NoError(t, err)

	_, err = os.Lstat(path)
	assert.ErrorIs(t, err, os.ErrNotExist, "the failed index's file is removed")
	logged := log.String()
	assert.Contains(t, logged, "the index cannot be written; it is removed")
	assert.Contains(t, logged, "over the bound of 512")
}
