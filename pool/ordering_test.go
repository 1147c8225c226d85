package pool

import (
	"context"
	"fmt"
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
// that free, as the sharing layer ends it (End, or EndAt with endAt set). It returns
// the stall's resume.
func busyImporter(t *testing.T, b *Buffer) (resume func()) {
	t.Helper()
	resume, _ = busyImporterEnding(t, b, false)
	return resume
}

func busyImporterEnding(t *testing.T, b *Buffer, endAt bool) (resume func(), c *Completion) {
	t.Helper()
	l := mustLease(t, b)
	im := importBuffer(t, b)
	t.Cleanup(im.close)
	resume = stall(t, im.d, im.stream)
	done := im.freeImport(b.Pool().Runtime())
	if endAt {
		c = b.Pool().NewCompletion(done, nil)
		t.Cleanup(func() { _ = c.Close(false) }) // test cleanup
		require.NoError(t, l.EndAt(c))
	} else {
		require.NoError(t, l.End(done))
	}
	return resume, c
}

// A lease ended by EndAt leaves the wait for the importer's free to the buffer's free:
// every way the memory goes back (a free with no lease live, the deferred free of the
// last lease, the cache and its next Alloc, Close(Force)) follows the importer's free.
func TestEndAtFreesFollowTheImportersFree(t *testing.T) {
	for name, free := range map[string]func(t *testing.T, e testEnv, p *Pool, b *Buffer){
		"free": func(t *testing.T, e testEnv, p *Pool, b *Buffer) {
			mustFree(t, b, e.stream)
			require.NoError(t, p.Trim()) // to the driver, not the cache's next Alloc
		},
		"cache": func(t *testing.T, e testEnv, p *Pool, b *Buffer) {
			mustFree(t, b, e.stream)
			again := mustAlloc(t, p, 1000, e.stream)
			require.Equal(t, b.Ptr(), again.Ptr(), "not recycled")
			require.NoError(t, e.rt.MemsetAsync(0, again.Ptr(), 0xcd, 1000, e.stream))
			mustFree(t, again, e.stream)
			require.NoError(t, p.Trim()) // on the stream that took it from the cache
		},
		"close": func(t *testing.T, e testEnv, p *Pool, b *Buffer) {
			require.NoError(t, e.rt.StreamSynchronize(0, e.stream))
			r, err := p.Close(context.Background(), Force())
			require.NoError(t, err)
			require.Equal(t, 1, r.ReleasedBuffers, "Close(Force) = %v", r)
		},
	} {
		for _, closing := range []bool{false, true} {
			t.Run(fmt.Sprintf("%s/closed=%v", name, closing), func(t *testing.T) {
				exp := softDevice(t)
				e := newTestEnv(t, exp, exp)
				p := mustNew(t, exp, WithCache(64*mib))
				b := mustAlloc(t, p, 1000, e.stream)
				resume, c := busyImporterEnding(t, b, true)
				if closing {
					// The importer leaves: its event may go, the release stream waits for it.
					require.NoError(t, c.Close(true))
				}
				free(t, e, p, b)
				require.NoError(t, exp.Err(), "the memory went back before the importer's free of its import")
				resume()
				require.NoError(t, exp.Synchronize())
			})
		}
	}
	t.Run("deferred", func(t *testing.T) {
		exp := softDevice(t)
		e := newTestEnv(t, exp, exp)
		p := mustNew(t, exp)
		b := mustAlloc(t, p, 1000, e.stream)
		l := mustLease(t, b) // keeps the free deferred until busyImporter's lease ended
		resume, _ := busyImporterEnding(t, b, true)
		mustFree(t, b, e.stream)
		require.NoError(t, l.End(0), "the last lease, which issues the free")
		require.NoError(t, exp.Err(), "the deferred free ran before the importer's free of its import")
		resume()
		require.NoError(t, exp.Synchronize())
	})
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
