package pool

import (
	"bytes"
	"context"
	"errors"
	"sync"
	"testing"

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
	if err != nil {
		t.Fatalf("ExportRecord: %v", err)
	}
	h, err := b.Pool().ExportHandle()
	if err != nil {
		t.Fatalf("ExportHandle: %v", err)
	}
	ip, err := d.MemPoolImportFromShareableHandle(0, h)
	if err != nil {
		t.Fatalf("MemPoolImportFromShareableHandle: %v", err)
	}
	ptr, err := d.MemPoolImportPointer(0, ip, rec)
	if err != nil {
		t.Fatalf("MemPoolImportPointer: %v", err)
	}
	return &importer{t: t, d: d, stream: e.stream, pool: ip, ptr: ptr}
}

// read copies n bytes of the import.
func (im *importer) read(n int) []byte {
	buf := make([]byte, n)
	if err := im.d.MemcpyDtoHAsync(0, buf, im.ptr, im.stream); err != nil {
		im.t.Fatalf("importer read: %v", err)
	}
	return buf
}

// freeImport frees the import and returns, opened on the exporter's device, an IPC
// event recorded after that free: the completion a sharing layer passes to End.
func (im *importer) freeImport(exporter cudart.Runtime) cudart.Event {
	t := im.t
	t.Helper()
	if err := im.d.FreeAsync(0, im.ptr, im.stream); err != nil {
		t.Fatalf("importer FreeAsync: %v", err)
	}
	ev, err := im.d.EventCreate(0, cudart.EventIPC)
	if err != nil {
		t.Fatalf("importer EventCreate: %v", err)
	}
	t.Cleanup(func() { im.d.EventDestroy(0, ev) })
	if err := im.d.EventRecord(0, ev, im.stream); err != nil {
		t.Fatalf("importer EventRecord: %v", err)
	}
	h, err := im.d.IpcGetEventHandle(0, ev)
	if err != nil {
		t.Fatalf("IpcGetEventHandle: %v", err)
	}
	opened, err := exporter.IpcOpenEventHandle(0, h)
	if err != nil {
		t.Fatalf("IpcOpenEventHandle: %v", err)
	}
	return opened
}

func (im *importer) close() {
	if err := im.d.MemPoolDestroy(0, im.pool); err != nil {
		im.t.Errorf("importer MemPoolDestroy: %v", err)
	}
}

func mustLease(t testing.TB, b *Buffer) *Lease {
	t.Helper()
	l, err := b.Lease()
	if err != nil {
		t.Fatalf("Lease: %v", err)
	}
	return l
}

func wantCounts(t testing.TB, p *Pool, live, shared, leases, deferred int) {
	t.Helper()
	s := mustStats(t, p)
	if s.LiveBuffers != live || s.SharedBuffers != shared || s.ActiveLeases != leases || s.DeferredFrees != deferred {
		t.Fatalf("Stats = %v; want %d live, %d shared, %d leases, %d deferred frees", s, live, shared, leases, deferred)
	}
}

// The exporter frees first; the real free waits for the importer's free, so the
// software device sees no exporter free while imported.
func TestLeasedFreeWaitsForImporter(t *testing.T) {
	exp := softDevice(t)
	e := newTestEnv(t, exp, exp)
	p := mustNew(t, exp)
	b := mustAlloc(t, p, 1000, e.stream)
	if err := exp.MemsetAsync(0, b.Ptr(), 0xab, 1000, e.stream); err != nil {
		t.Fatal(err)
	}
	ready, err := exp.EventCreate(0, cudart.EventIPC)
	if err != nil {
		t.Fatal(err)
	}
	defer exp.EventDestroy(0, ready)
	if err := exp.EventRecord(0, ready, e.stream); err != nil {
		t.Fatal(err)
	}
	l := mustLease(t, b)
	im := importBuffer(t, b)
	defer im.close()
	rh, err := exp.IpcGetEventHandle(0, ready)
	if err != nil {
		t.Fatal(err)
	}
	imReady, err := im.d.IpcOpenEventHandle(0, rh)
	if err != nil {
		t.Fatal(err)
	}
	if err := im.d.StreamWaitEvent(0, im.stream, imReady); err != nil {
		t.Fatal(err)
	}

	mustFree(t, b, e.stream)
	wantCounts(t, p, 1, 1, 1, 1)
	wantErr(t, "Free while the free is deferred", b.Free(e.stream), ErrFreed)
	_, err = b.Lease()
	wantErr(t, "Lease while the free is deferred", err, ErrFreed)
	if !bytes.Equal(im.read(1000), bytes.Repeat([]byte{0xab}, 1000)) {
		t.Fatal("importer read other bytes than the exporter wrote")
	}

	done := im.freeImport(exp)
	if err := l.End(done); err != nil {
		t.Fatalf("End: %v", err)
	}
	exp.EventDestroy(0, done)
	wantCounts(t, p, 0, 0, 0, 0)
	wantErr(t, "second End", l.End(0), ErrLeaseEnded)
	if !b.Shared() {
		t.Error("Shared() = false for a buffer that was leased")
	}
}

// The same sharing without a lease frees under the importer: the software device must
// catch it, or the test above proves nothing.
func TestUnleasedSharedFreeIsCaught(t *testing.T) {
	exp := cudarttest.New()
	defer exp.Close()
	p, err := New(exp, 0)
	if err != nil {
		t.Fatal(err)
	}
	b, err := p.Alloc(context.Background(), 1000, 0)
	if err != nil {
		t.Fatal(err)
	}
	im := importBuffer(t, b)
	defer im.close()
	if err := b.Free(0); !errors.Is(err, cudarttest.ErrViolation) {
		t.Fatalf("Free under an importer without a lease: %v; want a violation", err)
	}
	var kinds []cudarttest.ViolationKind
	for _, v := range exp.Violations() {
		kinds = append(kinds, v.Kind)
	}
	if len(kinds) != 1 || kinds[0] != cudarttest.ViolationExporterFreedWhileImported {
		t.Fatalf("violations %v; want one exporter-freed-while-imported", kinds)
	}
}

func TestLastLeaseReleases(t *testing.T) {
	onEachRuntime(t, func(t *testing.T, e testEnv) {
		p := mustNew(t, e.rt)
		b := mustAlloc(t, p, 10, e.stream)
		l1, l2 := mustLease(t, b), mustLease(t, b)
		wantCounts(t, p, 1, 1, 2, 0)
		mustFree(t, b, e.stream)
		wantCounts(t, p, 1, 1, 2, 1)
		// A completion event on the pool's device: the importer's free, here work
		// on a stream of our own.
		ev, err := e.rt.EventCreate(0, cudart.EventDisableTiming)
		if err != nil {
			t.Fatal(err)
		}
		defer e.rt.EventDestroy(0, ev)
		if err := e.rt.EventRecord(0, ev, e.stream); err != nil {
			t.Fatal(err)
		}
		if err := l1.End(ev); err != nil {
			t.Fatalf("End: %v", err)
		}
		wantCounts(t, p, 1, 1, 1, 1)
		if err := l2.End(0); err != nil {
			t.Fatalf("End: %v", err)
		}
		wantCounts(t, p, 0, 0, 0, 0)
		if err := e.rt.StreamSynchronize(0, p.relStream); err != nil {
			t.Fatal(err)
		}
		if s := mustStats(t, p); s.UsedCurrent != 0 {
			t.Fatalf("driver still counts %d bytes used after the deferred free", s.UsedCurrent)
		}
	})
}

func TestFreeAfterLeasesEnded(t *testing.T) {
	onEachRuntime(t, func(t *testing.T, e testEnv) {
		p := mustNew(t, e.rt)
		b := mustAlloc(t, p, 10, e.stream)
		if err := mustLease(t, b).End(0); err != nil {
			t.Fatal(err)
		}
		wantCounts(t, p, 1, 0, 0, 0)
		mustFree(t, b, e.stream)
		wantCounts(t, p, 0, 0, 0, 0)
		wantErr(t, "second Free", b.Free(e.stream), ErrFreed)
	})
}

func TestExportRecordIsCached(t *testing.T) {
	onEachRuntime(t, func(t *testing.T, e testEnv) {
		rt := &countingRuntime{Runtime: e.rt}
		p := mustNew(t, rt)
		b := mustAlloc(t, p, 10, e.stream)
		l := mustLease(t, b)
		r1, err := b.ExportRecord()
		if err != nil {
			t.Fatalf("ExportRecord before the pool was exported: %v", err)
		}
		r2, err := b.ExportRecord()
		if err != nil || r1 != r2 {
			t.Fatalf("second ExportRecord = %x, %v; want the same bytes", r2, err)
		}
		h1, _ := p.ExportHandle()
		h2, _ := p.ExportHandle()
		if h1 != h2 || rt.poolExports.Load() != 1 || rt.ptrExports.Load() != 1 {
			t.Fatalf("pool exported %d times, pointer %d times; want once each", rt.poolExports.Load(), rt.ptrExports.Load())
		}
		mustFree(t, b, e.stream)
		if err := l.End(0); err != nil {
			t.Fatal(err)
		}
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
	if err := l.End(0); err != nil {
		t.Fatalf("End after a failed End: %v", err)
	}
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
					if err != nil {
						t.Error(err)
						return
					}
					var ls []*Lease
					for j := 0; j < leases; j++ {
						l, err := b.Lease()
						if err != nil {
							t.Error(err)
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
								if err := b.Free(e.stream); err != nil {
									t.Error(err)
								}
							}
							if err := l.End(0); err != nil {
								t.Error(err)
							}
						}()
					}
					inner.Wait()
				}
			}()
		}
		wg.Wait()
		wantCounts(t, p, 0, 0, 0, 0)
		if _, err := p.Close(context.Background()); err != nil {
			t.Fatalf("Close: %v", err)
		}
	})
}
