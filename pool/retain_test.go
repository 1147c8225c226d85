package pool

import (
	"bytes"
	"context"
	"sync/atomic"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/cudapool/cudapool/cudart"
)

// retainer counts the revocations of a Retention that a test holds.
type retainer struct {
	revoked atomic.Int32
}

func (r *retainer) revoke() { r.revoked.Add(1) }

// retain leases b, retains its memory and ends the lease, as a sharing layer does
// when an importer releases but keeps its mapping.
func retain(t testing.TB, b *Buffer, completion cudart.Event) (*Retention, *retainer) {
	t.Helper()
	l := mustLease(t, b)
	rr := &retainer{}
	r, err := b.Retain(rr.revoke)
	require.NoError(t, err, "Retain")
	require.NoError(t, l.End(completion))
	return r, rr
}

func TestRetainNeedsALease(t *testing.T) {
	d := softDevice(t)
	e := newTestEnv(t, d, d)
	p := mustNew(t, d)
	b := mustAlloc(t, p, mib, e.stream)
	_, err := b.Retain(func() {})
	require.ErrorIs(t, err, ErrNotLeased)
	_, err = b.Retain(nil)
	require.ErrorIs(t, err, ErrInvalidOption)
	mustFree(t, b, e.stream)

	local := mustNew(t, d, WithHandleType(cudart.HandleTypeNone))
	b = mustAlloc(t, local, mib, e.stream)
	_, err = b.Retain(func() {})
	require.ErrorIs(t, err, ErrNotShareable)
	mustFree(t, b, e.stream)
}

// Retained memory passes through the cache to the next buffer with its retention; a
// Trim asks the retainer to let go and frees the memory only once it has.
func TestRetainedMemoryIsRecycledAndRevokedBeforeItIsFreed(t *testing.T) {
	onEachRuntime(t, func(t *testing.T, e testEnv) {
		rt := newCounting(e.rt)
		p := mustNew(t, rt, WithCache(64*mib))
		b := mustAlloc(t, p, mib, e.stream)
		r, rr := retain(t, b, 0)
		mustFree(t, b, e.stream)
		again := mustAlloc(t, p, mib, e.stream)
		require.Equal(t, b.Ptr(), again.Ptr(), "the retained memory was not recycled")
		assert.Equal(t, 1, mustStats(t, p).Retentions)
		mustFree(t, again, e.stream)

		frees := rt.frees()
		require.NoError(t, p.Trim())
		assert.Equal(t, int32(1), rr.revoked.Load(), "Trim did not revoke the retention")
		assert.Equal(t, frees, rt.frees(), "retained memory went back to the driver before its retainer let go")
		s := mustStats(t, p)
		assert.Equal(t, 1, s.RevokingBuffers)
		assert.Equal(t, p.Granularity(), s.RevokingBytes)
		assert.Zero(t, s.CachedBuffers)

		require.NoError(t, r.End(0))
		assert.Equal(t, frees+1, rt.frees(), "the last retention's end did not free the memory")
		s = mustStats(t, p)
		assert.Zero(t, s.RevokingBuffers+s.Retentions)
		require.ErrorIs(t, r.End(0), ErrLeaseEnded)
		assert.Equal(t, int32(1), rr.revoked.Load(), "revoked twice")
	})
}

// Without a cache, and through a deferred free, retained memory is revoked at once.
func TestRetainedMemoryFreedPastTheCache(t *testing.T) {
	onEachRuntime(t, func(t *testing.T, e testEnv) {
		rt := newCounting(e.rt)
		p := mustNew(t, rt)
		for _, deferred := range []bool{false, true} {
			b := mustAlloc(t, p, mib, e.stream)
			l := mustLease(t, b)
			rr := &retainer{}
			r, err := b.Retain(rr.revoke)
			require.NoError(t, err)
			frees := rt.frees()
			if deferred {
				mustFree(t, b, e.stream)
				require.NoError(t, l.End(0))
			} else {
				require.NoError(t, l.End(0))
				mustFree(t, b, e.stream)
			}
			assert.Equal(t, int32(1), rr.revoked.Load(), "deferred %v: not revoked", deferred)
			assert.Equal(t, frees, rt.frees(), "deferred %v: freed before the retainer let go", deferred)
			wantCounts(t, p, 0, 0, 0, 0)
			require.NoError(t, r.End(0))
			assert.Equal(t, frees+1, rt.frees(), "deferred %v: not freed", deferred)
		}
	})
}

// An importer that keeps its import past its lease, and frees it only when revoked:
// the software device sees the exporter's free ordered after that free, and the
// importer reads the new contents of the recycled memory through its old mapping.
func TestRevokedImportIsFreedBeforeTheMemory(t *testing.T) {
	sh := shareFilled(t, 0x31)
	exp, e, p, b, l, im := sh.exp, sh.e, sh.p, sh.b, sh.l, sh.im
	const n = shareSize
	rr := &retainer{}
	r, err := b.Retain(rr.revoke)
	require.NoError(t, err)
	require.NoError(t, l.End(im.recordDone(exp)))
	mustFree(t, b, e.stream)

	again := mustAlloc(t, p, n, e.stream)
	require.Equal(t, b.Ptr(), again.Ptr())
	require.NoError(t, exp.MemsetAsync(0, again.Ptr(), 0x32, n, e.stream))
	l = mustLease(t, again)
	im.waitFor(exp, e.stream)
	assert.Equal(t, bytes.Repeat([]byte{0x32}, n), im.read(n), "the retained mapping does not show the new contents")
	require.NoError(t, l.End(im.recordDone(exp)))
	mustFree(t, again, e.stream)

	require.NoError(t, p.Trim())
	require.Equal(t, int32(1), rr.revoked.Load())
	require.NoError(t, r.End(im.freeImport(exp)))
	im.close()
	assert.Zero(t, mustStats(t, p).RevokingBuffers)
}

func TestCloseWithRetentions(t *testing.T) {
	d := softDevice(t)
	e := newTestEnv(t, d, d)
	p := mustNew(t, d, WithCache(64*mib))
	b := mustAlloc(t, p, mib, e.stream)
	r, _ := retain(t, b, 0)
	mustFree(t, b, e.stream)
	_, err := p.Close(context.Background())
	require.ErrorIs(t, err, ErrBusy)
	assert.Contains(t, err.Error(), "retain")
	report, err := p.Close(context.Background(), Force())
	require.NoError(t, err)
	assert.Equal(t, 1, report.AbandonedBuffers, "report %v", report)
	assert.Zero(t, report.CachedBuffers, "report %v", report)
	require.NoError(t, r.End(0), "End after Close")
}

// recordDone returns, opened on the exporter's device, an IPC event recorded on the
// importer's stream after its work so far: the completion of a lease whose import
// stays mapped.
func (im *importer) recordDone(exporter cudart.Runtime) cudart.Event {
	im.t.Helper()
	return crossEvent(im.t, im.d, im.stream, exporter)
}
