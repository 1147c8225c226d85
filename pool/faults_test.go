package pool

import (
	"context"
	"errors"
	"strings"
	"sync"
	"sync/atomic"
	"testing"

	"github.com/cudapool/cudapool/cudart"
)

// faultyRuntime fails the calls it is told to, and can misalign pointers.
type faultyRuntime struct {
	cudart.Runtime
	mu    sync.Mutex
	fail  map[string]int // call name -> how many more calls fail
	shift cudart.DevicePtr
	attrs map[cudart.DeviceAttr]int // device attributes answered instead of the device
	pools int                       // pools created and not destroyed
}

var errInjected = cudart.NewError("injected", cudart.ErrUnknown)

func (r *faultyRuntime) failNext(call string, n int) {
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.fail == nil {
		r.fail = map[string]int{}
	}
	r.fail[call] = n
}

func (r *faultyRuntime) fails(call string) bool {
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.fail[call] > 0 {
		r.fail[call]--
		return true
	}
	return false
}

func (r *faultyRuntime) DeviceAttribute(dev int, attr cudart.DeviceAttr) (int, error) {
	if v, ok := r.attrs[attr]; ok {
		return v, nil
	}
	if r.fails("DeviceAttribute") {
		return 0, errInjected
	}
	return r.Runtime.DeviceAttribute(dev, attr)
}

func (r *faultyRuntime) MemPoolCreate(props cudart.PoolProps) (cudart.MemPool, error) {
	h, err := r.Runtime.MemPoolCreate(props)
	if err == nil {
		r.mu.Lock()
		r.pools++
		r.mu.Unlock()
	}
	return h, err
}

func (r *faultyRuntime) MemPoolDestroy(dev int, p cudart.MemPool) error {
	err := r.Runtime.MemPoolDestroy(dev, p)
	if err == nil {
		r.mu.Lock()
		r.pools--
		r.mu.Unlock()
	}
	return err
}

func (r *faultyRuntime) MemPoolSetAccess(dev int, p cudart.MemPool, descs []cudart.AccessDesc) error {
	if r.fails("MemPoolSetAccess") {
		return errInjected
	}
	return r.Runtime.MemPoolSetAccess(dev, p, descs)
}

func (r *faultyRuntime) MallocFromPoolAsync(dev int, size uint64, p cudart.MemPool, s cudart.Stream) (cudart.DevicePtr, error) {
	ptr, err := r.Runtime.MallocFromPoolAsync(dev, size, p, s)
	return ptr + r.shift, err
}

func (r *faultyRuntime) FreeAsync(dev int, ptr cudart.DevicePtr, s cudart.Stream) error {
	if r.fails("FreeAsync") {
		return errInjected
	}
	return r.Runtime.FreeAsync(dev, ptr-r.shift, s)
}

func (r *faultyRuntime) EventRecord(dev int, e cudart.Event, s cudart.Stream) error {
	if r.fails("EventRecord") {
		return errInjected
	}
	return r.Runtime.EventRecord(dev, e, s)
}

func (r *faultyRuntime) StreamCreate(dev int, flags cudart.StreamFlags) (cudart.Stream, error) {
	if r.fails("StreamCreate") {
		return 0, errInjected
	}
	return r.Runtime.StreamCreate(dev, flags)
}

func newFaulty(t testing.TB) (*faultyRuntime, testEnv) {
	d := softDevice(t)
	r := &faultyRuntime{Runtime: d, attrs: map[cudart.DeviceAttr]int{}}
	return r, newTestEnv(t, d, d)
}

func TestMisalignedPointerFailsLoudly(t *testing.T) {
	r, e := newFaulty(t)
	p := mustNew(t, r)
	r.shift = 512
	_, err := p.Alloc(context.Background(), 1, e.stream)
	wantErr(t, "Alloc returning a misaligned pointer", err, ErrMisaligned)
	r.shift = 0
	if s := mustStats(t, p); s.LiveBuffers != 0 || s.UsedCurrent != 0 {
		t.Fatalf("the misaligned pointer was kept: %v", s)
	}
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
		{"failing DeviceAttribute", func(r *faultyRuntime) { r.failNext("DeviceAttribute", 1) },
			nil, errInjected, "supports memory pools"},
		{"failing MemPoolSetAccess", func(r *faultyRuntime) { r.failNext("MemPoolSetAccess", 1) },
			[]Option{WithPeerAccess(1)}, errInjected, "access"},
	}
	for _, c := range cases {
		r, _ := newFaulty(t)
		c.setup(r)
		_, err := New(r, 0, c.opts...)
		wantErr(t, c.name, err, c.target)
		if !strings.Contains(err.Error(), c.says) {
			t.Errorf("%s: error %q does not say %q", c.name, err, c.says)
		}
		if r.pools != 0 {
			t.Errorf("%s: %d pools left behind", c.name, r.pools)
		}
	}
}

func TestFailedFreeKeepsBufferLive(t *testing.T) {
	r, e := newFaulty(t)
	p := mustNew(t, r)
	b := mustAlloc(t, p, 1, e.stream)
	r.failNext("FreeAsync", 1)
	wantErr(t, "Free with failing FreeAsync", b.Free(e.stream), errInjected)
	wantCounts(t, p, 1, 0, 0, 0)
	mustFree(t, b, e.stream)

	// The same for a buffer that was shared, and one whose free is deferred.
	b = mustAlloc(t, p, 1, e.stream)
	if err := mustLease(t, b).End(0); err != nil {
		t.Fatal(err)
	}
	r.failNext("EventRecord", 1)
	wantErr(t, "Free of a shared buffer with failing EventRecord", b.Free(e.stream), errInjected)
	wantCounts(t, p, 1, 0, 0, 0)
	mustFree(t, b, e.stream)

	b = mustAlloc(t, p, 1, e.stream)
	l := mustLease(t, b)
	r.failNext("EventRecord", 1)
	wantErr(t, "deferred Free with failing EventRecord", b.Free(e.stream), errInjected)
	wantCounts(t, p, 1, 1, 1, 0)
	mustFree(t, b, e.stream)
	if err := l.End(0); err != nil {
		t.Fatal(err)
	}
	wantCounts(t, p, 0, 0, 0, 0)
}

func TestFailedDeferredFreeIsReported(t *testing.T) {
	r, e := newFaulty(t)
	p := mustNew(t, r)
	b := mustAlloc(t, p, 1, e.stream)
	l := mustLease(t, b)
	mustFree(t, b, e.stream)
	r.failNext("FreeAsync", 1)
	err := l.End(0)
	wantErr(t, "End issuing a failing deferred free", err, ErrFreeFailed, errInjected)
	wantErr(t, "End again", l.End(0), ErrLeaseEnded)
	s := mustStats(t, p)
	if s.FailedFrees != 1 || s.FailedFreeBytes != b.Reserved() || s.LiveBuffers != 1 || s.DeferredFrees != 0 {
		t.Fatalf("Stats = %v; want the failed free counted", s)
	}
	wantErr(t, "Free of a buffer whose deferred free failed", b.Free(e.stream), ErrFreed)
	_, err = p.Close(context.Background())
	wantErr(t, "Close with a failed free", err, ErrBusy)
	report, err := p.Close(context.Background(), Force())
	if err != nil || len(report.FailedFrees) != 1 || !errors.Is(report.FailedFrees[0], errInjected) || report.ReleasedBuffers != 0 {
		t.Fatalf("Close(Force) = %v, %v; want the failed free reported", report, err)
	}
}

func TestReleaseStreamFailure(t *testing.T) {
	r, e := newFaulty(t)
	p := mustNew(t, r)
	b := mustAlloc(t, p, 1, e.stream)
	r.failNext("StreamCreate", 1)
	_, err := b.Lease()
	wantErr(t, "Lease without a release stream", err, errInjected)
	wantCounts(t, p, 1, 0, 0, 0)
	if b.Shared() {
		t.Fatal("a failed Lease marked the buffer shared")
	}
	mustFree(t, b, e.stream)
}

// blockingRuntime holds the first MallocFromPoolAsync until released.
type blockingRuntime struct {
	cudart.Runtime
	entered, release chan struct{}
	blocked          atomic.Bool
}

func (r *blockingRuntime) MallocFromPoolAsync(dev int, size uint64, p cudart.MemPool, s cudart.Stream) (cudart.DevicePtr, error) {
	if r.blocked.CompareAndSwap(false, true) {
		close(r.entered)
		<-r.release
	}
	return r.Runtime.MallocFromPoolAsync(dev, size, p, s)
}

func TestCloseWaitsForCallsInFlight(t *testing.T) {
	d := softDevice(t)
	r := &blockingRuntime{Runtime: d, entered: make(chan struct{}), release: make(chan struct{})}
	p := mustNew(t, r)
	got := make(chan error, 1)
	go func() {
		_, err := p.Alloc(context.Background(), 1, 0)
		got <- err
	}()
	<-r.entered
	_, err := p.Close(context.Background())
	wantErr(t, "Close during an Alloc", err, ErrBusy)

	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	_, err = p.Close(ctx, Force())
	wantErr(t, "Close(Force) running out of time", err, context.Canceled)
	_, err = p.Alloc(context.Background(), 1, 0)
	wantErr(t, "Alloc while closing", err, ErrClosed)

	close(r.release)
	if err := <-got; err != nil {
		t.Fatalf("Alloc in flight during Close: %v", err)
	}
	report, err := p.Close(context.Background())
	if err != nil || report.ReleasedBuffers != 1 || !report.Destroyed {
		t.Fatalf("Close finishing the forced close = %v, %v; want the in-flight buffer released", report, err)
	}
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
	if s := mustStats(t, p); s.LiveBuffers != 0 || s.BytesReserved != 0 {
		t.Fatalf("after freeing everything: %v", s)
	}
}

// destroyCounter counts MemPoolDestroy calls.
type destroyCounter struct {
	cudart.Runtime
	destroys atomic.Int32
}

func (r *destroyCounter) MemPoolDestroy(dev int, p cudart.MemPool) error {
	r.destroys.Add(1)
	return r.Runtime.MemPoolDestroy(dev, p)
}

// On the GPU host (no IMEX channel) the driver refuses the export, and destroying the
// pool afterwards crashed the process: this test is the proof that Close does not.
func TestFabricPoolWhoseExportWasRefusedIsNotDestroyed(t *testing.T) {
	onEachRuntime(t, func(t *testing.T, e testEnv) {
		for _, export := range []bool{false, true} {
			r := &destroyCounter{Runtime: e.rt}
			p := mustNew(t, r, WithHandleType(cudart.HandleTypeFabric))
			refused := false
			if export {
				_, err := p.ExportHandle()
				switch {
				case errors.Is(err, cudart.ErrNotPermitted):
					refused = true
				case err != nil:
					t.Fatalf("FABRIC export: %v; want success or not permitted (no IMEX)", err)
				}
			}
			report, err := p.Close(context.Background())
			if err != nil {
				t.Fatal(err)
			}
			want := !refused
			if report.Destroyed != want || r.destroys.Load() != map[bool]int32{true: 1}[want] {
				t.Errorf("export refused %v: Close destroyed %v with %d MemPoolDestroy calls; want destroyed %v",
					refused, report.Destroyed, r.destroys.Load(), want)
			}
			if e.soft != nil && export && !refused {
				t.Error("the software device without WithFabric let a FABRIC pool be exported")
			}
		}
	})
}

// waitBlockingRuntime holds the first StreamWaitEvent until released.
type waitBlockingRuntime struct {
	cudart.Runtime
	entered, release chan struct{}
	blocked          atomic.Bool
}

func (r *waitBlockingRuntime) StreamWaitEvent(dev int, s cudart.Stream, e cudart.Event) error {
	if r.blocked.CompareAndSwap(false, true) {
		close(r.entered)
		<-r.release
	}
	return r.Runtime.StreamWaitEvent(dev, s, e)
}

// A second End of a lease whose first End is still waiting for its completion, made
// after Close(Force) began, must not end the lease a second time: that would take
// another importer's lease with it and free the buffer under that importer.
func TestEndDuringEndAfterCloseBeganEndsOnce(t *testing.T) {
	d := softDevice(t)
	e := newTestEnv(t, d, d)
	r := &waitBlockingRuntime{Runtime: d, entered: make(chan struct{}), release: make(chan struct{})}
	p := mustNew(t, r)
	b := mustAlloc(t, p, 1, e.stream)
	first, other := mustLease(t, b), mustLease(t, b)
	mustFree(t, b, e.stream)
	completion, err := d.EventCreate(0, cudart.EventDisableTiming)
	if err != nil {
		t.Fatal(err)
	}
	defer d.EventDestroy(0, completion)
	if err := d.EventRecord(0, completion, e.stream); err != nil {
		t.Fatal(err)
	}

	ended := make(chan error, 1)
	go func() { ended <- first.End(completion) }()
	<-r.entered
	closed := make(chan error, 1)
	go func() {
		_, err := p.Close(context.Background(), Force())
		closed <- err
	}()
	<-p.closing
	again := first.End(0)
	close(r.release)
	wantErr(t, "End while the first End of the lease is in flight", again, ErrLeaseEnded)
	if err := <-ended; err != nil {
		t.Fatalf("first End: %v", err)
	}
	if err := <-closed; err != nil {
		t.Fatalf("Close(Force): %v", err)
	}
	p.mu.Lock()
	leases, state := b.leases, b.state
	p.mu.Unlock()
	if leases != 1 || state == bufFreed {
		t.Fatalf("after one End of two leases: %d leases, state %d; want the other lease live and the buffer not freed", leases, state)
	}
	if err := other.End(0); err != nil {
		t.Fatalf("ending the other lease after Close: %v", err)
	}
}
