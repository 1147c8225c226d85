package pool

import (
	"bytes"
	"context"
	"sync"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/cudapool/cudapool/cudart"
	"github.com/cudapool/cudapool/cudart/cudarttest"
)

// importer is a second software device standing for another process that imported
// a pool's buffer.
type importer struct {
	t      testing.TB
	d      *cudarttest.Device
	stream cudart.Stream
	pool   cudart.MemPool
	ptr    cudart.DevicePtr
}

// importBuffer imports b into a fresh software device, as a consumer process would.
func importBuffer(t testing.TB, b *Buffer) *importer {
	t.Helper()
	d := softDevice(t)
	e := newTestEnv(t, d, d)
	rec, err := b.ExportRecord()
	require.NoError(t, err, "ExportRecord")
	h, err := b.Pool().ExportHandle()
	require.NoError(t, err, "ExportHandle")
	ip, err := d.MemPoolImportFromShareableHandle(0, h)
	require.NoError(t, err, "MemPoolImportFromShareableHandle")
	ptr, err := d.MemPoolImportPointer(0, ip, rec)
	require.NoError(t, err, "MemPoolImportPointer")
	return &importer{t: t, d: d, stream: e.stream, pool: ip, ptr: ptr}
}

// read copies n bytes of the import.
func (im *importer) read(n int) []byte {
	buf := make([]byte, n)
	require.NoError(im.t, im.d.MemcpyDtoHAsync(0, buf, im.ptr, im.stream), "importer read")
	return buf
}

// freeImport frees the import and returns, opened on the exporter's device, an IPC
// event recorded after that free: the completion a sharing layer passes to End.
func (im *importer) freeImport(exporter cudart.Runtime) cudart.Event {
	t := im.t
	t.Helper()
	require.NoError(t, im.d.FreeAsync(0, im.ptr, im.stream), "importer FreeAsync")
	ev, err := im.d.EventCreate(0, cudart.EventIPC)
	require.NoError(t, err, "importer EventCreate")
	t.Cleanup(func() { _ = im.d.EventDestroy(0, ev) }) // test cleanup
	require.NoError(t, im.d.EventRecord(0, ev, im.stream), "importer EventRecord")
	h, err := im.d.IpcGetEventHandle(0, ev)
	require.NoError(t, err, "IpcGetEventHandle")
	opened, err := exporter.IpcOpenEventHandle(0, h)
	require.NoError(t, err, "IpcOpenEventHandle")
	return opened
}

func (im *importer) close() {
	assert.NoError(im.t, im.d.MemPoolDestroy(0, im.pool), "importer MemPoolDestroy")
}

func mustLease(t testing.TB, b *Buffer) *Lease {
	t.Helper()
	l, err := b.Lease()
	require.NoError(t, err, "Lease")
	return l
}

func wantCounts(t testing.TB, p *Pool, live, shared, leases, deferred int) {
	t.Helper()
	s := mustStats(t, p)
	require.Equal(t, [4]int{live, shared, leases, deferred}, [4]int{s.LiveBuffers, s.SharedBuffers, s.ActiveLeases, s.DeferredFrees},
		"live, shared, leases, deferred frees in %v", s)
}

// The exporter frees first; the real free waits for the importer's free, so the
// software device sees no exporter free while imported.
func TestLeasedFreeWaitsForImporter(t *testing.T) {
	exp := softDevice(t)
	e := newTestEnv(t, exp, exp)
	p := mustNew(t, exp)
	b := mustAlloc(t, p, 1000, e.stream)
	require.NoError(t, exp.MemsetAsync(0, b.Ptr(), 0xab, 1000, e.stream))
	ready, err := exp.EventCreate(0, cudart.EventIPC)
	require.NoError(t, err)
	defer func() { _ = exp.EventDestroy(0, ready) }() // test cleanup
	require.NoError(t, exp.EventRecord(0, ready, e.stream))
	l := mustLease(t, b)
	im := importBuffer(t, b)
	defer im.close()
	rh, err := exp.IpcGetEventHandle(0, ready)
	require.NoError(t, err)
	imReady, err := im.d.IpcOpenEventHandle(0, rh)
	require.NoError(t, err)
	require.NoError(t, im.d.StreamWaitEvent(0, im.stream, imReady))

	mustFree(t, b, e.stream)
	wantCounts(t, p, 1, 1, 1, 1)
	wantErr(t, "Free while the free is deferred", b.Free(e.stream), ErrFreed)
	_, err = b.Lease()
	wantErr(t, "Lease while the free is deferred", err, ErrFreed)
	require.Equal(t, bytes.Repeat([]byte{0xab}, 1000), im.read(1000), "importer read other bytes than the exporter wrote")

	done := im.freeImport(exp)
	require.NoError(t, l.End(done), "End")
	_ = exp.EventDestroy(0, done) // test cleanup
	wantCounts(t, p, 0, 0, 0, 0)
	wantErr(t, "second End", l.End(0), ErrLeaseEnded)
	assert.True(t, b.Shared(), "Shared() = false for a buffer that was leased")
}

// The same sharing without a lease frees under the importer: the software device must
// catch it, or the test above proves nothing.
func TestUnleasedSharedFreeIsCaught(t *testing.T) {
	exp := cudarttest.New()
	defer func() { _ = exp.Close() }() // test cleanup
	p, err := New(exp, 0)
	require.NoError(t, err)
	b, err := p.Alloc(context.Background(), 1000, 0)
	require.NoError(t, err)
	im := importBuffer(t, b)
	defer im.close()
	require.NoError(t, b.Free(0))
	// The free runs later; the stream reports what it found.
	require.ErrorIs(t, exp.StreamSynchronize(0, 0), cudarttest.ErrViolation, "Free under an importer without a lease")
	var kinds []cudarttest.ViolationKind
	for _, v := range exp.Violations() {
		kinds = append(kinds, v.Kind)
	}
	require.Equal(t, []cudarttest.ViolationKind{cudarttest.ViolationExporterFreedWhileImported}, kinds)
}

func TestLastLeaseReleases(t *testing.T) {
	onEachRuntime(t, func(t *testing.T, e testEnv) {
		p := mustNew(t, e.rt)
		b := mustAlloc(t, p, 10, e.stream)
		l1, l2 := mustLease(t, b), mustLease(t, b)
		wantCounts(t, p, 1, 1, 2, 0)
		mustFree(t, b, e.stream)
		wantCounts(t, p, 1, 1, 2, 1)
		// A release event on the pool's device: the importer's free, here work
		// on a stream of our own.
		ev, err := e.rt.EventCreate(0, cudart.EventDisableTiming)
		require.NoError(t, err)
		defer func() { _ = e.rt.EventDestroy(0, ev) }() // test cleanup
		require.NoError(t, e.rt.EventRecord(0, ev, e.stream))
		require.NoError(t, l1.End(ev), "End")
		wantCounts(t, p, 1, 1, 1, 1)
		require.NoError(t, l2.End(0), "End")
		wantCounts(t, p, 0, 0, 0, 0)
		require.NoError(t, e.rt.StreamSynchronize(0, p.relStream))
		require.Zero(t, mustStats(t, p).UsedCurrent, "driver still counts bytes used after the deferred free")
	})
}

func TestFreeAfterLeasesEnded(t *testing.T) {
	onEachRuntime(t, func(t *testing.T, e testEnv) {
		p := mustNew(t, e.rt)
		b := mustAlloc(t, p, 10, e.stream)
		require.NoError(t, mustLease(t, b).End(0))
		wantCounts(t, p, 1, 0, 0, 0)
		mustFree(t, b, e.stream)
		wantCounts(t, p, 0, 0, 0, 0)
		wantErr(t, "second Free", b.Free(e.stream), ErrFreed)
	})
}

func TestExportRecordIsCached(t *testing.T) {
	onEachRuntime(t, func(t *testing.T, e testEnv) {
		rt := newCounting(e.rt)
		p := mustNew(t, rt)
		b := mustAlloc(t, p, 10, e.stream)
		l := mustLease(t, b)
		r1, err := b.ExportRecord()
		require.NoError(t, err, "ExportRecord before the pool was exported")
		r2, err := b.ExportRecord()
		require.NoError(t, err, "second ExportRecord")
		require.Equal(t, r1, r2, "second ExportRecord: want the same bytes")
		h1, _ := p.ExportHandle()
		h2, _ := p.ExportHandle()
		require.Equal(t, h1, h2)
		require.Equal(t, int64(1), rt.poolExports(), "pool exports")
		require.Equal(t, int64(1), rt.ptrExports(), "pointer exports")
		mustFree(t, b, e.stream)
		require.NoError(t, l.End(0))
	})
}

func TestLeaseMisuse(t *testing.T) {
	d := softDevice(t)
	p := mustNew(t, d)
	b := mustAlloc(t, p, 10, 0)
	l := mustLease(t, b)
	// A completion that cannot be waited for leaves the lease live.
	wantErr(t, "End with a bogus event", l.End(0xbad), cudart.ErrInvalidResourceHandle)
	wantCounts(t, p, 1, 1, 1, 0)
	require.NoError(t, l.End(0), "End after a failed End")
	wantErr(t, "second End", l.End(0), ErrLeaseEnded)
	wantCounts(t, p, 1, 0, 0, 0)
	mustFree(t, b, 0)
}

func TestConcurrentLeases(t *testing.T) {
	onEachRuntime(t, func(t *testing.T, e testEnv) {
		p := mustNew(t, e.rt)
		const workers, rounds, leases = 6, 30, 3
		var wg sync.WaitGroup
		for w := 0; w < workers; w++ {
			wg.Add(1)
			go func() {
				defer wg.Done()
				for i := 0; i < rounds; i++ {
					b, err := p.Alloc(context.Background(), 100, e.stream)
					if !assert.NoError(t, err) {
						return
					}
					var ls []*Lease
					for j := 0; j < leases; j++ {
						l, err := b.Lease()
						if !assert.NoError(t, err) {
							return
						}
						ls = append(ls, l)
					}
					// Free and the ends race: the free comes first, last or between.
					var inner sync.WaitGroup
					for j, l := range ls {
						inner.Add(1)
						go func() {
							defer inner.Done()
							if j == i%leases {
								assert.NoError(t, b.Free(e.stream))
							}
							assert.NoError(t, l.End(0))
						}()
					}
					inner.Wait()
				}
			}()
		}
		wg.Wait()
		wantCounts(t, p, 0, 0, 0, 0)
		_, err := p.Close(context.Background())
		require.NoError(t, err, "Close")
	})
}
