package pool

import (
	"context"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/cudapool/cudapool/cudart"
	"github.com/cudapool/cudapool/cudart/cudarttest"
)

// The tests here make a GPU busy (cudarttest's Stall: a long kernel on a stream) and
// check what the software device saw: a free that does not wait for the work it must
// follow runs first, and breaks a rule.

// stall holds s on d until the returned resume is called (or the test ends).
func stall(t testing.TB, d *cudarttest.Device, s cudart.Stream) (resume func()) {
	t.Helper()
	resume, err := d.Stall(0, s)
	require.NoError(t, err)
	t.Cleanup(resume)
	return resume
}

// busyImporter leases b to an importer whose GPU is busy: its free of the import is
// queued behind a stall, and the lease is ended with the completion recorded after
// that free, as the sharing layer ends it. It returns the stall's resume.
func busyImporter(t *testing.T, b *Buffer) (resume func()) {
	t.Helper()
	l := mustLease(t, b)
	im := importBuffer(t, b)
	t.Cleanup(im.close)
	resume = stall(t, im.d, im.stream)
	done := im.freeImport(b.Pool().Runtime())
	require.NoError(t, l.End(done))
	return resume
}

// A deferred free follows the work queued on the freeing stream before Free, even
// when that work runs long after the last lease ended.
func TestDeferredFreeWaitsForTheFreeingStream(t *testing.T) {
	exp := softDevice(t)
	e := newTestEnv(t, exp, exp)
	p := mustNew(t, exp)
	b := mustAlloc(t, p, 1000, e.stream)
	l := mustLease(t, b)
	resume := stall(t, exp, e.stream) // the write below has not run when the free is issued
	require.NoError(t, exp.MemsetAsync(0, b.Ptr(), 0xab, 1000, e.stream))
	mustFree(t, b, e.stream)
	require.NoError(t, l.End(0), "End of the last lease, which issues the free")
	resume()
	require.NoError(t, exp.StreamSynchronize(0, e.stream), "the producer's write ran after the buffer's free")
	require.NoError(t, exp.Synchronize())
}

// A buffer shared before, whose last lease ended, is freed on the release stream,
// which waits for the importers' frees, not at once on the caller's stream.
func TestSharedFreeWaitsForTheImportersFree(t *testing.T) {
	exp := softDevice(t)
	e := newTestEnv(t, exp, exp)
	p := mustNew(t, exp)
	b := mustAlloc(t, p, 1000, e.stream)
	resume := busyImporter(t, b)
	mustFree(t, b, e.stream)
	require.NoError(t, exp.Err(), "the free ran before the importer's free of its import")
	resume()
	require.NoError(t, exp.Synchronize())
}

// Close(Force) frees a buffer that no importer holds any more on the release stream,
// which waits for the importers' frees, not on a stream that waited for nothing.
func TestCloseForceFreesAfterTheImportersFree(t *testing.T) {
	exp := softDevice(t)
	e := newTestEnv(t, exp, exp)
	p := mustNew(t, exp)
	b := mustAlloc(t, p, 1000, e.stream)
	resume := busyImporter(t, b)
	require.NoError(t, exp.StreamSynchronize(0, e.stream)) // the caller's own work is done
	r, err := p.Close(context.Background(), Force())
	require.NoError(t, err)
	require.Equal(t, 1, r.ReleasedBuffers, "Close(Force) = %v", r)
	require.Zero(t, r.AbandonedBuffers, "Close(Force) = %v", r)
	require.NoError(t, exp.Err(), "Close(Force)'s free ran before the importer's free of its import")
	resume()
	require.NoError(t, exp.Synchronize())
}
