package pool

import (
	"context"
	"errors"
	"sync"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/cudapool/cudapool/cudart"
	"github.com/cudapool/cudapool/internal/intercept"
	"github.com/cudapool/cudapool/internal/testwait"
)

// faultyRuntime fails the calls it is told to (r.On.<Method>.Fail(1, errInjected)),
// answers device attributes, and can misalign pointers.
type faultyRuntime struct {
	*intercept.Runtime
	mu    sync.Mutex
	shift cudart.DevicePtr
	attrs map[cudart.DeviceAttr]int // device attributes answered instead of the device
	pools int                       // pools created and not destroyed
}

var errInjected = cudart.NewError("injected", cudart.ErrUnknown)

func newFaulty(t testing.TB) (*faultyRuntime, testEnv) {
	d := softDevice(t)
	r := &faultyRuntime{Runtime: intercept.Wrap(d), attrs: map[cudart.DeviceAttr]int{}}
	r.On.DeviceAttribute.Around(func(next intercept.DeviceAttributeFunc, dev int, attr cudart.DeviceAttr) (int, error) {
		if v, ok := r.attrs[attr]; ok {
			return v, nil
		}
		return next(dev, attr)
	})
	r.On.MallocFromPoolAsync.After(func(p cudart.DevicePtr, err error) (cudart.DevicePtr, error) { return p + r.shift, err })
	r.On.FreeAsync.Around(func(next intercept.FreeAsyncFunc, dev int, p cudart.DevicePtr, s cudart.Stream) error {
		return next(dev, p-r.shift, s)
	})
	count := func(d int, err error) {
		if err == nil {
			r.mu.Lock()
			r.pools += d
			r.mu.Unlock()
		}
	}
	r.On.MemPoolCreate.After(func(p cudart.MemPool, err error) (cudart.MemPool, error) { count(1, err); return p, err })
	r.On.MemPoolDestroy.After(func(err error) error { count(-1, err); return err })
	return r, newTestEnv(t, d, d)
}

func TestMisalignedPointerFailsLoudly(t *testing.T) {
	r, e := newFaulty(t)
	p := mustNew(t, r)
	r.shift = 512
	_, err := p.Alloc(context.Background(), 1, e.stream)
	wantErr(t, "Alloc returning a misaligned pointer", err, ErrMisaligned)
	r.shift = 0
	require.NoError(t, e.rt.StreamSynchronize(0, e.stream)) // the free of the misaligned pointer has run
	s := mustStats(t, p)
	require.Zero(t, s.LiveBuffers, "the misaligned pointer was kept: %v", s)
	require.Zero(t, s.UsedCurrent, "the misaligned pointer was kept: %v", s)
	// A local pool does not care.
	local := mustNew(t, r, WithHandleType(cudart.HandleTypeNone))
	r.shift = 512
	b := mustAlloc(t, local, 1, e.stream)
	mustFree(t, b, e.stream)
}

func TestNewFailuresLeaveNothing(t *testing.T) {
	cases := []struct {
		name   string
		setup  func(r *faultyRuntime)
		opts   []Option
		target error
		says   string
	}{
		{"fabric on a posix-fd device", func(r *faultyRuntime) { r.attrs[cudart.DevAttrMemoryPoolSupportedHandles] = 0x1 },
			[]Option{WithHandleType(cudart.HandleTypeFabric)}, ErrUnsupportedHandleType, "supports posix-fd (0x1), not fabric"},
		{"posix-fd on a win32 device", func(r *faultyRuntime) { r.attrs[cudart.DevAttrMemoryPoolSupportedHandles] = 0x2 },
			nil, ErrUnsupportedHandleType, "supports win32 (0x2)"},
		{"no memory pools", func(r *faultyRuntime) { r.attrs[cudart.DevAttrMemoryPoolsSupported] = 0 },
			nil, cudart.ErrNotSupported, "does not support memory pools"},
		{"failing DeviceAttribute", func(r *faultyRuntime) { r.On.DeviceAttribute.Fail(1, errInjected) },
			nil, errInjected, "supports memory pools"},
		{"failing MemPoolSetAccess", func(r *faultyRuntime) { r.On.MemPoolSetAccess.Fail(1, errInjected) },
			[]Option{WithPeerAccess(1)}, errInjected, "access"},
	}
	for _, c := range cases {
		r, _ := newFaulty(t)
		c.setup(r)
		_, err := New(r, 0, c.opts...)
		wantErr(t, c.name, err, c.target)
		assert.Contains(t, err.Error(), c.says, c.name)
		assert.Zero(t, r.pools, "%s: pools left behind", c.name)
	}
}

func TestFailedFreeKeepsBufferLive(t *testing.T) {
	r, e := newFaulty(t)
	p := mustNew(t, r)
	b := mustAlloc(t, p, 1, e.stream)
	r.On.FreeAsync.Fail(1, errInjected)
	wantErr(t, "Free with failing FreeAsync", b.Free(e.stream), errInjected)
	wantCounts(t, p, 1, 0, 0, 0)
	mustFree(t, b, e.stream)

	// The same for a buffer that was shared, and one whose free is deferred.
	b = mustAlloc(t, p, 1, e.stream)
	require.NoError(t, mustLease(t, b).End(0))
	r.On.EventRecord.Fail(1, errInjected)
	wantErr(t, "Free of a shared buffer with failing EventRecord", b.Free(e.stream), errInjected)
	wantCounts(t, p, 1, 0, 0, 0)
	mustFree(t, b, e.stream)

	b = mustAlloc(t, p, 1, e.stream)
	l := mustLease(t, b)
	r.On.EventRecord.Fail(1, errInjected)
	wantErr(t, "deferred Free with failing EventRecord", b.Free(e.stream), errInjected)
	wantCounts(t, p, 1, 1, 1, 0)
	mustFree(t, b, e.stream)
	require.NoError(t, l.End(0))
	wantCounts(t, p, 0, 0, 0, 0)
}

func TestFailedDeferredFreeIsReported(t *testing.T) {
	r, e := newFaulty(t)
	p := mustNew(t, r)
	b := mustAlloc(t, p, 1, e.stream)
	l := mustLease(t, b)
	mustFree(t, b, e.stream)
	r.On.FreeAsync.Fail(1, errInjected)
	err := l.End(0)
	wantErr(t, "End issuing a failing deferred free", err, ErrFreeFailed, errInjected)
	wantErr(t, "End again", l.End(0), ErrLeaseEnded)
	s := mustStats(t, p)
	require.Equal(t, [4]uint64{1, b.Reserved(), 1, 0}, [4]uint64{uint64(s.FailedFrees), s.FailedFreeBytes, uint64(s.LiveBuffers), uint64(s.DeferredFrees)},
		"failed frees, their bytes, live buffers, deferred frees: want the failed free counted (%v)", s)
	wantErr(t, "Free of a buffer whose deferred free failed", b.Free(e.stream), ErrFreed)
	_, err = p.Close(context.Background())
	wantErr(t, "Close with a failed free", err, ErrBusy)
	report, err := p.Close(context.Background(), Force())
	require.NoError(t, err, "Close(Force)")
	require.Len(t, report.FailedFrees, 1, "Close(Force) = %v; want the failed free reported", report)
	require.ErrorIs(t, report.FailedFrees[0], errInjected)
	require.Zero(t, report.ReleasedBuffers, "Close(Force) = %v", report)
}

func TestReleaseStreamFailure(t *testing.T) {
	r, e := newFaulty(t)
	p := mustNew(t, r)
	b := mustAlloc(t, p, 1, e.stream)
	r.On.StreamCreate.Fail(1, errInjected)
	_, err := b.Lease()
	wantErr(t, "Lease without a release stream", err, errInjected)
	wantCounts(t, p, 1, 0, 0, 0)
	require.False(t, b.Shared(), "a failed Lease marked the buffer shared")
	mustFree(t, b, e.stream)
}

// blockingRuntime holds the first call of one method (hold's) until release is closed,
// saying on entered that it is inside.
type blockingRuntime struct {
	*intercept.Runtime
	entered, release chan struct{}
}

func newBlocking(rt cudart.Runtime) *blockingRuntime {
	return &blockingRuntime{Runtime: intercept.Wrap(rt), entered: make(chan struct{}), release: make(chan struct{})}
}

// hold makes the first call of m, one of r's methods, block until release is closed.
func (r *blockingRuntime) hold(m intercept.Method) {
	m.Once(func() {
		close(r.entered)
		<-r.release
	})
}

func TestCloseWaitsForCallsInFlight(t *testing.T) {
	d := softDevice(t)
	r := newBlocking(d)
	r.hold(&r.On.MallocFromPoolAsync)
	release := sync.OnceFunc(func() { close(r.release) })
	t.Cleanup(release) // a failure before the release must not leave the call blocked
	p := mustNew(t, r)
	got := make(chan error, 1)
	go func() {
		_, err := p.Alloc(context.Background(), 1, 0)
		got <- err
	}()
	testwait.Recv(t, r.entered, "the Alloc to be in the driver")
	_, err := p.Close(context.Background())
	wantErr(t, "Close during an Alloc", err, ErrBusy)

	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	_, err = p.Close(ctx, Force())
	wantErr(t, "Close(Force) running out of time", err, context.Canceled)
	_, err = p.Alloc(context.Background(), 1, 0)
	wantErr(t, "Alloc while closing", err, ErrClosed)

	release()
	require.NoError(t, testwait.Recv(t, got, "the Alloc in flight to return"), "Alloc in flight during Close")
	report, err := p.Close(context.Background())
	require.NoError(t, err, "Close finishing the forced close")
	require.Equal(t, 1, report.ReleasedBuffers, "Close finishing the forced close = %v; want the in-flight buffer released", report)
	require.True(t, report.Destroyed, "Close finishing the forced close = %v", report)
}

// looseCapRuntime creates pools without the max size it is given, as the real driver
// enforces a looser cap than asked (9 granules from a 16 MiB pool on driver 580).
type looseCapRuntime struct{ cudart.Runtime }

func (r looseCapRuntime) MemPoolCreate(props cudart.PoolProps) (cudart.MemPool, error) {
	props.MaxSize = 0
	return r.Runtime.MemPoolCreate(props)
}

func TestMaxSizeHeldByThePoolWhateverTheDriver(t *testing.T) {
	d := softDevice(t)
	e := newTestEnv(t, d, d)
	p := mustNew(t, looseCapRuntime{d}, WithMaxSize(8*mib))
	g := p.Granularity()
	var bufs []*Buffer
	for uint64(len(bufs))*g < p.MaxSize() {
		bufs = append(bufs, mustAlloc(t, p, g, e.stream))
	}
	_, err := p.Alloc(context.Background(), 1, e.stream)
	wantErr(t, "Alloc past max size", err, cudart.ErrOutOfMemory)
	mustFree(t, bufs[0], e.stream)
	bufs[0] = mustAlloc(t, p, g, e.stream) // the freed granule fits again
	for _, b := range bufs {
		mustFree(t, b, e.stream)
	}
	s := mustStats(t, p)
	require.Zero(t, s.LiveBuffers, "after freeing everything: %v", s)
	require.Zero(t, s.BytesReserved, "after freeing everything: %v", s)
}

// On the GPU host (no IMEX channel) the driver refuses the export, and destroying the
// pool afterwards crashed the process: this test is the proof that Close does not.
func TestFabricPoolWhoseExportWasRefusedIsNotDestroyed(t *testing.T) {
	onEachRuntime(t, func(t *testing.T, e testEnv) {
		for _, export := range []bool{false, true} {
			r := intercept.Wrap(e.rt) // counts MemPoolDestroy calls
			p := mustNew(t, r, WithHandleType(cudart.HandleTypeFabric))
			refused := false
			if export {
				_, err := p.ExportHandle()
				switch {
				case errors.Is(err, cudart.ErrNotPermitted):
					refused = true
				case err != nil:
					require.NoError(t, err, "FABRIC export: want success or not permitted (no IMEX)")
				}
			}
			report, err := p.Close(context.Background())
			require.NoError(t, err)
			want := !refused
			assert.Equal(t, want, report.Destroyed, "export refused %v: Close destroyed", refused)
			assert.Equal(t, map[bool]int64{true: 1}[want], r.On.MemPoolDestroy.Calls(), "export refused %v: MemPoolDestroy calls", refused)
			if e.soft != nil && export {
				assert.True(t, refused, "the software device without WithFabric let a FABRIC pool be exported")
			}
		}
	})
}

// A second End of a lease whose first End is still waiting for its completion, made
// after Close(Force) began, must not end the lease a second time: that would take
// another importer's lease with it and free the buffer under that importer.
func TestEndDuringEndAfterCloseBeganEndsOnce(t *testing.T) {
	d := softDevice(t)
	e := newTestEnv(t, d, d)
	r := newBlocking(d)
	r.hold(&r.On.StreamWaitEvent)
	release := sync.OnceFunc(func() { close(r.release) })
	t.Cleanup(release) // a failure before the release must not leave End blocked
	p := mustNew(t, r)
	b := mustAlloc(t, p, 1, e.stream)
	first, other := mustLease(t, b), mustLease(t, b)
	mustFree(t, b, e.stream)
	completion, err := d.EventCreate(0, cudart.EventDisableTiming)
	require.NoError(t, err)
	defer func() { _ = d.EventDestroy(0, completion) }() // test cleanup
	require.NoError(t, d.EventRecord(0, completion, e.stream))

	ended := make(chan error, 1)
	go func() { ended <- first.End(completion) }()
	testwait.Recv(t, r.entered, "the first End to wait for its completion")
	closed := make(chan error, 1)
	go func() {
		_, err := p.Close(context.Background(), Force())
		closed <- err
	}()
	testwait.Recv(t, p.closing, "Close(Force) to begin")
	again := first.End(0)
	release()
	wantErr(t, "End while the first End of the lease is in flight", again, ErrLeaseEnded)
	require.NoError(t, testwait.Recv(t, ended, "the first End to return"), "first End")
	require.NoError(t, testwait.Recv(t, closed, "Close(Force) to return"), "Close(Force)")
	p.mu.Lock()
	leases, state := b.leases, b.state
	p.mu.Unlock()
	require.EqualValues(t, 1, leases, "after one End of two leases: want the other lease live")
	require.NotEqual(t, bufFreed, state, "after one End of two leases: the buffer was freed")
	require.NoError(t, other.End(0), "ending the other lease after Close")
}
