package pool

import (
	"bytes"
	"context"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/cudapool/cudapool/cudart"
	"github.com/cudapool/cudapool/cudart/cudarttest"
	"github.com/cudapool/cudapool/internal/intercept"
)

// countingRuntime counts the calls that exports make and that the cache exists to
// save.
type countingRuntime struct{ *intercept.Runtime }

func newCounting(rt cudart.Runtime) countingRuntime { return countingRuntime{intercept.Wrap(rt)} }

func (r countingRuntime) mallocs() int64     { return r.On.MallocFromPoolAsync.Calls() }
func (r countingRuntime) frees() int64       { return r.On.FreeAsync.Calls() }
func (r countingRuntime) poolExports() int64 { return r.On.MemPoolExportToShareableHandle.Calls() }
func (r countingRuntime) ptrExports() int64  { return r.On.MemPoolExportPointer.Calls() }
func (r countingRuntime) waits() int64       { return r.On.StreamWaitEvent.Calls() }

// calls is what the counting runtime has seen so far.
type calls struct{ mallocs, frees, ptrExports, waits int64 }

func (r countingRuntime) calls() calls {
	return calls{r.mallocs(), r.frees(), r.ptrExports(), r.waits()}
}

func newStream(t testing.TB, rt cudart.Runtime) cudart.Stream {
	t.Helper()
	return newTestEnv(t, rt, nil).stream
}

func TestCacheServesTheSameStreamWithoutTheDriver(t *testing.T) {
	onEachRuntime(t, func(t *testing.T, e testEnv) {
		rt := newCounting(e.rt)
		p := mustNew(t, rt, WithCache(64*mib))
		b := mustAlloc(t, p, mib, e.stream)
		mustFree(t, b, e.stream)
		s := mustStats(t, p)
		assert.Equal(t, 1, s.CachedBuffers)
		assert.Equal(t, p.Granularity(), s.CachedBytes)
		assert.Zero(t, s.LiveBuffers)

		before := rt.calls()
		again := mustAlloc(t, p, mib, e.stream)
		assert.Equal(t, before, rt.calls(), "a hit called the runtime")
		assert.Equal(t, b.Ptr(), again.Ptr())
		assert.Equal(t, b.Reserved(), again.Reserved())
		assert.NotEqual(t, b.ID(), again.ID(), "a recycled buffer is a new Buffer")

		// The old handle stays freed: it cannot free the memory now in use again.
		require.ErrorIs(t, b.Free(e.stream), ErrFreed)
		s = mustStats(t, p)
		assert.Equal(t, 1, s.LiveBuffers)
		assert.Zero(t, s.CachedBuffers)
		assert.Equal(t, uint64(1), s.CacheHits)
		assert.Equal(t, uint64(1), s.CacheMisses)
		mustFree(t, again, e.stream)
	})
}

func TestCacheLeavesOtherStreamsToTheDriver(t *testing.T) {
	onEachRuntime(t, func(t *testing.T, e testEnv) {
		rt := newCounting(e.rt)
		p := mustNew(t, rt, WithCache(64*mib))
		mustFree(t, mustAlloc(t, p, mib, e.stream), e.stream)
		other := newStream(t, e.rt)
		before := rt.calls()
		b := mustAlloc(t, p, mib, other)
		assert.Equal(t, before.mallocs+1, rt.mallocs(), "Alloc on another stream did not go to the driver")
		s := mustStats(t, p)
		assert.Equal(t, 1, s.CachedBuffers, "Alloc on another stream took the cached buffer")
		mustFree(t, b, other)
		require.NoError(t, p.Trim())
	})
}

func TestCacheOffByDefault(t *testing.T) {
	d := softDevice(t)
	e := newTestEnv(t, d, d)
	rt := newCounting(d)
	p := mustNew(t, rt)
	mustFree(t, mustAlloc(t, p, mib, e.stream), e.stream)
	assert.Equal(t, int64(1), rt.frees())
	s := mustStats(t, p)
	assert.Zero(t, s.CacheLimit)
	assert.Zero(t, s.CachedBuffers)
	assert.Zero(t, s.CacheMisses, "a pool without a cache counts no misses")
}

// A buffer above the cache's limit is never cached: each pair goes to the driver, and
// each Alloc counts one miss, whether the driver answers or not.
func TestCacheTooSmallCountsEveryMiss(t *testing.T) {
	d := softDevice(t)
	e := newTestEnv(t, d, d)
	rt := newCounting(d)
	p := mustNew(t, rt, WithCache(1), WithMaxSize(2*mib))
	const pairs = 3
	for range pairs {
		mustFree(t, mustAlloc(t, p, mib, e.stream), e.stream)
	}
	b := mustAlloc(t, p, mib, e.stream)
	_, err := p.Alloc(context.Background(), 2*mib, e.stream)
	require.ErrorIs(t, err, cudart.ErrOutOfMemory, "an Alloc of a full pool")
	mustFree(t, b, e.stream)
	assert.Equal(t, int64(pairs+1), rt.frees(), "frees that reached the driver")
	s := mustStats(t, p)
	assert.Zero(t, s.CacheHits)
	assert.Equal(t, uint64(pairs+2), s.CacheMisses, "misses: %d pairs, one live buffer and one Alloc refused", pairs)
	assert.Zero(t, s.CachedBuffers)
}

func TestCacheSizeClasses(t *testing.T) {
	d := softDevice(t)
	e := newTestEnv(t, d, d)
	t.Run("local", func(t *testing.T) {
		p := mustNew(t, d, WithHandleType(cudart.HandleTypeNone), WithCache(mib))
		mustFree(t, mustAlloc(t, p, 1024, e.stream), e.stream)
		b := mustAlloc(t, p, 1000, e.stream)
		assert.Equal(t, uint64(1000), b.Size())
		assert.Equal(t, uint64(1024), b.Reserved(), "1000 bytes were not served by the cached 1 KiB")
		mustFree(t, b, e.stream)
		// Less than the class below, or more than the buffer holds: the driver.
		for _, size := range []uint64{700, 1025} {
			b := mustAlloc(t, p, size, e.stream)
			assert.Equal(t, size, b.Reserved(), "%d bytes were served by the cached 1 KiB", size)
			mustFree(t, b, e.stream)
		}
		assert.Equal(t, uint64(1), mustStats(t, p).CacheHits)
		require.NoError(t, p.Trim())
	})
	t.Run("exportable", func(t *testing.T) {
		p := mustNew(t, d, WithCache(64*mib))
		mustFree(t, mustAlloc(t, p, 4*mib, e.stream), e.stream)
		small := mustAlloc(t, p, 2*mib, e.stream) // a class below: the driver
		b := mustAlloc(t, p, 3*mib, e.stream)     // rounds to 4 MiB: the cache
		assert.Equal(t, uint64(4*mib), b.Reserved())
		assert.Equal(t, uint64(4*mib), small.Reserved()+2*mib)
		assert.Equal(t, uint64(1), mustStats(t, p).CacheHits)
		mustFree(t, small, e.stream)
		mustFree(t, b, e.stream)
		require.NoError(t, p.Trim())
	})
}

// A cached buffer of a request's size class but a smaller reservation never serves
// it: the newest one, and those the scan looks at behind it.
func TestCacheNeverServesASmallerReservation(t *testing.T) {
	d := softDevice(t)
	e := newTestEnv(t, d, d)
	p := mustNew(t, d, WithHandleType(cudart.HandleTypeNone), WithCache(mib))
	require.Equal(t, sizeClass(1000), sizeClass(1024), "the sizes share a class")
	mustFree(t, mustAlloc(t, p, 1000, e.stream), e.stream)
	b := mustAlloc(t, p, 1024, e.stream)
	assert.Equal(t, uint64(1024), b.Reserved(), "1,024 bytes were served by a cached 1,000")
	assert.Zero(t, mustStats(t, p).CacheHits)

	// Behind the newest, the scan looks at older buffers: the cache holds 1,000,
	// 1,024 and 1,001 (the newest), and of them only the 1,024 serves 1,024.
	c := mustAlloc(t, p, 1001, e.stream)
	mustFree(t, b, e.stream)
	mustFree(t, c, e.stream)
	var bufs []*Buffer
	for range 2 {
		b := mustAlloc(t, p, 1024, e.stream)
		assert.Equal(t, uint64(1024), b.Reserved(), "1,024 bytes were served by a smaller cached buffer")
		bufs = append(bufs, b)
	}
	assert.Equal(t, uint64(1), mustStats(t, p).CacheHits, "the cached 1,024 served one of them")
	for _, b := range bufs {
		mustFree(t, b, e.stream)
	}
	require.NoError(t, p.Trim())
}

func TestSizeClass(t *testing.T) {
	for _, c := range []struct {
		a, b uint64
		same bool
	}{
		{1, 2, false}, {4, 5, false}, {5, 6, false}, {8, 9, false}, {1000, 1024, true}, {896, 1024, false},
		{2 * mib, 2*mib - 1, true}, {2 * mib, 2*mib + 1, false}, {60 * mib, 64 * mib, true}, {56 * mib, 57 * mib, false},
		{1<<63 + 1, 1<<63 + 1<<61, true}, {1<<63 + 3<<61 + 1, 1<<64 - 1, true},
	} {
		assert.Equal(t, c.same, sizeClass(c.a) == sizeClass(c.b), "sizeClass(%d) == sizeClass(%d)", c.a, c.b)
	}
}

func TestCacheLimit(t *testing.T) {
	d := softDevice(t)
	e := newTestEnv(t, d, d)
	rt := newCounting(d)
	p := mustNew(t, rt, WithCache(5*mib))
	bufs := []*Buffer{mustAlloc(t, p, mib, e.stream), mustAlloc(t, p, mib, e.stream), mustAlloc(t, p, mib, e.stream)}
	for _, b := range bufs {
		mustFree(t, b, e.stream)
	}
	s := mustStats(t, p)
	assert.Equal(t, 2, s.CachedBuffers)
	assert.Equal(t, uint64(4*mib), s.CachedBytes)
	assert.Equal(t, uint64(5*mib), s.CacheLimit)
	assert.Equal(t, int64(1), rt.frees(), "the buffer past the limit did not go to the driver")
	require.NoError(t, p.Trim())
}

func TestTrim(t *testing.T) {
	onEachRuntime(t, func(t *testing.T, e testEnv) {
		rt := newCounting(e.rt)
		p := mustNew(t, rt, WithCache(64*mib))
		other := newStream(t, e.rt)
		a, b, c := mustAlloc(t, p, mib, e.stream), mustAlloc(t, p, mib, e.stream), mustAlloc(t, p, mib, other)
		mustFree(t, a, e.stream)
		mustFree(t, b, e.stream)
		mustFree(t, c, other)
		require.Equal(t, 3, mustStats(t, p).CachedBuffers)

		require.NoError(t, p.TrimStream(e.stream))
		assert.Equal(t, int64(2), rt.frees())
		s := mustStats(t, p)
		assert.Equal(t, 1, s.CachedBuffers)
		assert.Equal(t, p.Granularity(), s.CachedBytes)

		require.NoError(t, p.Trim())
		assert.Equal(t, int64(3), rt.frees())
		s = mustStats(t, p)
		assert.Zero(t, s.CachedBuffers)
		assert.Zero(t, s.CachedBytes)
		if e.soft != nil {
			// The driver counts memory as in use until its frees have run.
			require.NoError(t, e.rt.StreamSynchronize(0, e.stream))
			require.NoError(t, e.rt.StreamSynchronize(0, other))
			assert.Zero(t, mustStats(t, p).UsedCurrent, "the driver still counts memory in use after Trim")
		}
	})
}

// A full pool returns the cache to the driver and tries again before it fails.
func TestFullPoolTrimsTheCache(t *testing.T) {
	onEachRuntime(t, func(t *testing.T, e testEnv) {
		rt := newCounting(e.rt)
		gran := mustNew(t, e.rt).Granularity()
		p := mustNew(t, rt, WithMaxSize(4*gran), WithCache(4*gran))
		var bufs []*Buffer
		for range 4 {
			bufs = append(bufs, mustAlloc(t, p, gran, e.stream))
		}
		for _, b := range bufs {
			mustFree(t, b, e.stream)
		}
		require.Equal(t, 4, mustStats(t, p).CachedBuffers)
		other := newStream(t, e.rt)
		b := mustAlloc(t, p, 2*gran, other)
		s := mustStats(t, p)
		assert.Zero(t, s.CachedBuffers, "the cache was not trimmed")
		assert.Equal(t, int64(4), rt.frees())
		mustFree(t, b, other)
		require.NoError(t, p.Trim())
	})
}

// An Alloc waiting for memory on another stream gets it when a Free puts a buffer in
// the cache: it cannot take it, but the cache is returned to the driver for it.
func TestWaitingAllocTrimsTheCache(t *testing.T) {
	d := softDevice(t)
	e := newTestEnv(t, d, d)
	p := mustNew(t, d, WithMaxSize(4*mib), WithCache(4*mib), WaitForMemory())
	a, b := mustAlloc(t, p, 2*mib, e.stream), mustAlloc(t, p, 2*mib, e.stream)
	other := newStream(t, d)
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	got := make(chan error, 1)
	var waited *Buffer
	go func() {
		var err error
		waited, err = p.Alloc(ctx, 2*mib, other)
		got <- err
	}()
	blockedWaiting(t, p, got)
	mustFree(t, a, e.stream)
	select {
	case err := <-got:
		require.NoError(t, err)
	case <-ctx.Done():
		require.FailNow(t, "the waiting Alloc did not get the cached memory")
	}
	mustFree(t, waited, other)
	mustFree(t, b, e.stream)
	require.NoError(t, p.Trim())
}

func TestCloseReturnsTheCache(t *testing.T) {
	onEachRuntime(t, func(t *testing.T, e testEnv) {
		p := mustNew(t, e.rt, WithCache(64*mib))
		mustFree(t, mustAlloc(t, p, mib, e.stream), e.stream)
		r, err := p.Close(context.Background())
		require.NoError(t, err)
		assert.Equal(t, 1, r.CachedBuffers)
		assert.Equal(t, p.Granularity(), r.CachedBytes)
		assert.Contains(t, r.String(), "returned 1 cached buffers (2.0 MiB)")
		assert.True(t, r.Destroyed)
	})
}

func TestRecycledBufferKeepsItsExportRecord(t *testing.T) {
	onEachRuntime(t, func(t *testing.T, e testEnv) {
		rt := newCounting(e.rt)
		p := mustNew(t, rt, WithCache(64*mib))
		b := mustAlloc(t, p, mib, e.stream)
		rec, err := b.ExportRecord()
		require.NoError(t, err)
		mustFree(t, b, e.stream)
		again := mustAlloc(t, p, mib, e.stream)
		rec2, err := again.ExportRecord()
		require.NoError(t, err)
		assert.Equal(t, rec, rec2)
		assert.Equal(t, int64(1), rt.ptrExports(), "a recycled buffer was exported again")
		mustFree(t, again, e.stream)
	})
}

// A buffer that was shared goes to the cache after its importers' completions: Free's
// stream waits for them at once when no lease is live (for the release stream, which
// waited for them, after End; for an EndAt's completion itself unless it is done; for
// nothing after End(0)), and the taking stream waits when the free was deferred until
// the last lease ended.
func TestSharedBufferIsRecycledAfterItsLeases(t *testing.T) {
	onEachRuntime(t, func(t *testing.T, e testEnv) {
		rt := newCounting(e.rt)
		p := mustNew(t, rt, WithCache(64*mib))
		done, err := e.rt.EventCreate(0, cudart.EventDisableTiming)
		require.NoError(t, err)
		t.Cleanup(func() { _ = e.rt.EventDestroy(0, done) }) // test cleanup
		require.NoError(t, e.rt.EventRecord(0, done, newStream(t, e.rt)))
		c := p.NewCompletion(done, nil)
		t.Cleanup(func() { _ = c.Close(false) }) // test cleanup

		for _, end := range []struct {
			how   string
			end   func(l *Lease) error
			waits int64
		}{
			{"End", func(l *Lease) error { return l.End(done) }, 1},
			{"End(0)", func(l *Lease) error { return l.End(0) }, 0},
			{"EndAt of a completion done", func(l *Lease) error { return l.EndAt(c) }, 0},
		} {
			b := mustAlloc(t, p, mib, e.stream)
			require.NoError(t, e.rt.StreamSynchronize(0, e.stream))
			if end.waits == 0 {
				require.NoError(t, e.rt.EventSynchronize(0, done))
			}
			require.NoError(t, end.end(mustLease(t, b)), end.how)
			before := rt.calls()
			mustFree(t, b, e.stream)
			assert.Equal(t, before.waits+end.waits, rt.waits(), "%s: Free's stream waits", end.how)
			assert.Equal(t, before.frees, rt.frees(), end.how)
			before = rt.calls()
			again := mustAlloc(t, p, mib, e.stream)
			assert.Equal(t, before, rt.calls(), "%s: a shared buffer freed with no lease live was not a plain hit", end.how)
			assert.Equal(t, b.Ptr(), again.Ptr(), end.how)
			mustFree(t, again, e.stream)
		}
		b := mustAlloc(t, p, mib, e.stream)

		l := mustLease(t, b)
		mustFree(t, b, e.stream)
		wantCounts(t, p, 1, 1, 1, 1)
		require.NoError(t, l.End(0))
		wantCounts(t, p, 0, 0, 0, 0)
		require.Equal(t, 1, mustStats(t, p).CachedBuffers)
		before := rt.calls()
		again := mustAlloc(t, p, mib, e.stream)
		assert.Equal(t, b.Ptr(), again.Ptr())
		assert.Equal(t, before.waits+1, rt.waits(), "the taking stream did not wait for the deferred free's event")
		assert.Equal(t, before.mallocs, rt.mallocs())
		mustFree(t, again, e.stream)
		assert.Zero(t, mustStats(t, p).CacheMisses-1, "only the first Alloc missed")
	})
}

// A consumer of a recycled buffer reads what the producer wrote after recycling it,
// never the old contents, and the software device sees no rule broken.
func TestRecycledBufferCarriesNewContents(t *testing.T) {
	sh := shareFilled(t, 0x11)
	exp, e, p, b, l, first := sh.exp, sh.e, sh.p, sh.b, sh.l, sh.im
	const n = shareSize
	mustFree(t, b, e.stream) // deferred: the lease is live
	done := first.freeImport(exp)
	require.NoError(t, l.End(done))
	require.NoError(t, exp.EventDestroy(0, done))
	first.close()

	again := mustAlloc(t, p, n, e.stream)
	require.Equal(t, b.Ptr(), again.Ptr(), "the buffer was not recycled")
	require.NoError(t, exp.MemsetAsync(0, again.Ptr(), 0x22, n, e.stream))
	l = mustLease(t, again)
	second := importBuffer(t, again)
	second.waitFor(exp, e.stream)
	assert.Equal(t, bytes.Repeat([]byte{0x22}, n), second.read(n))
	mustFree(t, again, e.stream)
	done = second.freeImport(exp)
	require.NoError(t, l.End(done))
	require.NoError(t, exp.EventDestroy(0, done))
	second.close()
	require.NoError(t, p.Trim())
}

// Many goroutines, each on its own stream, allocate and free through the cache at
// once; the figures add up at the end.
func TestCacheConcurrent(t *testing.T) {
	d := softDevice(t)
	p := mustNew(t, d, WithCache(16*mib))
	const workers, rounds = 8, 200
	var wg sync.WaitGroup
	for w := range workers {
		s := newStream(t, d)
		wg.Go(func() {
			for i := range rounds {
				size := uint64(1+(w+i)%3) * mib
				b, err := p.Alloc(context.Background(), size, s)
				if !assert.NoError(t, err) {
					return
				}
				if !assert.NoError(t, b.Free(s)) {
					return
				}
			}
		})
	}
	wg.Wait()
	s := mustStats(t, p)
	assert.Zero(t, s.LiveBuffers)
	assert.LessOrEqual(t, s.CachedBytes, s.CacheLimit)
	assert.Equal(t, uint64(workers*rounds), s.CacheHits+s.CacheMisses)
	assert.Positive(t, s.CacheHits)
	r, err := p.Close(context.Background())
	require.NoError(t, err)
	assert.Equal(t, s.CachedBuffers, r.CachedBuffers)
}

// sharing is a buffer of a cached pool on a software device, filled with one byte,
// leased and imported into another software device, which has read it.
type sharing struct {
	exp *cudarttest.Device
	e   testEnv
	p   *Pool
	b   *Buffer
	l   *Lease
	im  *importer
}

// shareSize is the size of a sharing's buffer.
const shareSize = 4096

func shareFilled(t *testing.T, fill byte) sharing {
	t.Helper()
	exp := softDevice(t)
	e := newTestEnv(t, exp, exp)
	p := mustNew(t, exp, WithCache(64*mib))
	b := mustAlloc(t, p, shareSize, e.stream)
	require.NoError(t, exp.MemsetAsync(0, b.Ptr(), fill, shareSize, e.stream))
	l := mustLease(t, b)
	im := importBuffer(t, b)
	im.waitFor(exp, e.stream)
	require.Equal(t, bytes.Repeat([]byte{fill}, shareSize), im.read(shareSize))
	return sharing{exp, e, p, b, l, im}
}

// waitFor orders the importer's stream after the work queued on the exporter's
// stream s so far, through an IPC event, as a sharing layer does before a read.
func (im *importer) waitFor(exp cudart.Runtime, s cudart.Stream) {
	im.t.Helper()
	require.NoError(im.t, im.d.StreamWaitEvent(0, im.stream, crossEvent(im.t, exp, s, im.d)))
}

// crossEvent records an IPC event on stream s of from and returns it opened on to,
// as another process sees it.
func crossEvent(t testing.TB, from cudart.Runtime, s cudart.Stream, to cudart.Runtime) cudart.Event {
	t.Helper()
	ev, err := from.EventCreate(0, cudart.EventIPC)
	require.NoError(t, err)
	t.Cleanup(func() { assert.NoError(t, from.EventDestroy(0, ev)) })
	require.NoError(t, from.EventRecord(0, ev, s))
	h, err := from.IpcGetEventHandle(0, ev)
	require.NoError(t, err)
	opened, err := to.IpcOpenEventHandle(0, h)
	require.NoError(t, err)
	t.Cleanup(func() { assert.NoError(t, to.EventDestroy(0, opened)) })
	return opened
}
