package index

import (
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"sync/atomic"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/cudapool/cudapool/internal/testlog"
	"github.com/cudapool/cudapool/internal/testwait"
	"github.com/cudapool/cudapool/kv"
)

// queuedBytes is the bytes of records queued and not yet taken by the writer.
func (ix *Index) queuedBytes() int {
	ix.mu.Lock()
	defer ix.mu.Unlock()
	return len(ix.queue) - ix.head
}

// onRename makes a compaction call f before it renames its new file over the index
// (done false), and once it did (true).
func onRename(f func(done bool)) Option { return func(o *options) { o.onRename = f } }

// A disk that hangs (the writer held in its write, as a write blocked in the kernel
// holds it) does not make the queue grow without bound: the record that takes it past
// its bound (by default, the most bytes a file of the shape holds, 16 MiB at
// least) drops it, and the
// index fails while the write still hangs: its file is removed, every Wait (one that
// waited before included) returns ErrFailed, the reason is logged once, and later
// records are not queued. (Before, the queue grew with every record, and every Wait
// waited until its ctx ended.)
func TestAQueuePastItsBoundFailsTheIndex(t *testing.T) {
	path := filepath.Join(t.TempDir(), "index")
	h := newHeld()
	var log testlog.Buffer
	ix, err := Open(path, hdr, shape, func(b *Batch) uint64 { return b.Queued() },
		BeforeWrite(h.before), WithLogger(log.Logger()))
	require.NoError(t, err)
	first := ix.Seal(0, 1, kv.Hash{1})
	testwait.Recv(t, h.in, "the writer at its first write")
	waited := make(chan error, 1)
	go func() { waited <- ix.Wait(bound(t), first) }()

	limit := max(int(shape.maxBytes()), minQueued)
	record := frame + pagePayload
	for i := range limit / record { // up to the bound: queued
		ix.Seal(0, uint32(i%16), kv.Hash{1})
	}
	assert.Equal(t, limit/record*record, ix.queuedBytes(), "every record queued up to the bound, none dropped")
	select {
	case err := <-waited:
		t.Fatalf("Wait returned (%v) with the writer held and the queue within its bound", err)
	default:
	}
	last := ix.Seal(0, 1, kv.Hash{1}) // past it
	assert.Equal(t, 0, ix.queuedBytes(), "the queue past its bound is dropped")

	err = ix.Wait(bound(t), last)
	require.ErrorIs(t, err, ErrFailed, "the writer still held in its write")
	assert.NotErrorIs(t, err, ErrStale)
	assert.Contains(t, err.Error(), fmt.Sprintf("over the bound of %d", limit))
	_, serr := os.Lstat(path)
	assert.ErrorIs(t, serr, os.ErrNotExist, "the file is removed before Wait says the index failed")
	assert.ErrorIs(t, testwait.Recv(t, waited, "the Wait that waited for the held write"), ErrFailed)
	assert.ErrorIs(t, ix.Err(), ErrFailed)
	ix.Seal(0, 2, kv.Hash{2})
	assert.Equal(t, 0, ix.queuedBytes(), "no record is queued once the index failed")

	close(h.out) // the write returns: nothing more is written, and the file stays gone
	require.NoError(t, ix.Close(bound(t)))
	_, serr = os.Lstat(path)
	assert.ErrorIs(t, serr, os.ErrNotExist)
	logged := log.String()
	assert.Equal(t, 1, strings.Count(logged, "\n"), "logged once: %s", logged)
	assert.Contains(t, logged, "the index cannot be written; it is removed")
	assert.Contains(t, logged, fmt.Sprintf("bytes of records queued, over the bound of %d", limit))
}

// WithMaxQueued sets the bound; and a compaction that was under way as the queue
// passed it (held before its rename, as a disk that hangs in its fsync holds it)
// renames no file over the path the failure removed. (Without the check under fileMu,
// it renamed its snapshot there after the index had failed: the file came back, if
// only until the writer removed it again, and an owner killed meanwhile restarted
// from a snapshot that missed every record dropped since.)
func TestACompactionAfterTheFailureRenamesNothing(t *testing.T) {
	path := filepath.Join(t.TempDir(), "index")
	var armed, renamed atomic.Bool
	renaming, release := make(chan struct{}, 1), make(chan struct{})
	const maxQueued = 100_000
	ix, err := Open(path, hdr, shape, func(b *Batch) uint64 { b.Seal(0, 1, kv.Hash{1}); return b.Queued() },
		WithMaxQueued(maxQueued), onRename(func(done bool) {
			switch {
			case !armed.Load(): // Open's own compaction
			case done:
				renamed.Store(true)
			default:
				renaming <- struct{}{}
				<-release
			}
		}))
	require.NoError(t, err)
	armed.Store(true)
	record := frame + pagePayload
	n := shape.limit() + 1 // past the compaction limit, within the bound
	require.Less(t, n*record, maxQueued)
	for i := range n {
		ix.Seal(0, uint32(i%16), kv.Hash{1})
	}
	testwait.Recv(t, renaming, "the compaction at its rename")
	var last uint64
	for i := range maxQueued/record + 1 {
		last = ix.Seal(0, uint32(i%16), kv.Hash{1})
	}
	err = ix.Wait(bound(t), last)
	require.ErrorIs(t, err, ErrFailed, "the compaction still held")
	assert.Contains(t, err.Error(), "over the bound of 100000")
	_, serr := os.Lstat(path)
	assert.ErrorIs(t, serr, os.ErrNotExist, "the file is removed")

	close(release)
	require.NoError(t, ix.Close(bound(t)))
	assert.False(t, renamed.Load(), "the compaction renamed its file over the path after the index failed")
	for _, p := range []string{path, path + ".new"} {
		_, serr = os.Lstat(p)
		assert.ErrorIs(t, serr, os.ErrNotExist, p)
	}
}
