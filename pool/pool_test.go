package pool

import (
	"context"
	"errors"
	"math"
	"strings"
	"sync"
	"testing"

	"github.com/cudapool/cudapool/cudart"
	"github.com/cudapool/cudapool/internal/granularity"
)

func TestExportablePoolRoundsAndAligns(t *testing.T) {
	onEachRuntime(t, func(t *testing.T, e testEnv) {
		p := mustNew(t, e.rt, WithMaxSize(64*mib+1))
		g := p.Granularity()
		if g < 2 || p.HandleType() != cudart.HandleTypePosixFD {
			t.Fatalf("granularity %d, handle type %v; want a real granularity and posix-fd", g, p.HandleType())
		}
		if want, _ := granularity.RoundUp(64*mib+1, g); p.MaxSize() != want {
			t.Fatalf("MaxSize() = %d; want %d (rounded up)", p.MaxSize(), want)
		}
		// Mixed sizes: the driver would pack the small ones below the granularity
		// (FACTS 1) if the pool did not round them.
		sizes := []uint64{1, 512, g - 1, g, g + 1, 3 * mib, 1}
		var bufs []*Buffer
		var requested, reserved uint64
		for _, n := range sizes {
			b := mustAlloc(t, p, n, e.stream)
			want, _ := granularity.RoundUp(n, g)
			if b.Size() != n || b.Reserved() != want {
				t.Errorf("Alloc(%d): Size %d, Reserved %d; want %d, %d", n, b.Size(), b.Reserved(), n, want)
			}
			if !granularity.IsAligned(uint64(b.Ptr()), g) {
				t.Errorf("Alloc(%d) = %#x: not aligned to %d", n, b.Ptr(), g)
			}
			if b.Device() != 0 || b.Pool() != p || b.Shared() {
				t.Errorf("buffer %v: device %d, pool %p, shared %v", b, b.Device(), b.Pool(), b.Shared())
			}
			bufs = append(bufs, b)
			requested += n
			reserved += want
		}
		for i, b := range bufs {
			for _, c := range bufs[i+1:] {
				if b.ID() == c.ID() {
					t.Errorf("two buffers with ID %d", b.ID())
				}
				if b.Ptr() < c.Ptr()+cudart.DevicePtr(c.Reserved()) && c.Ptr() < b.Ptr()+cudart.DevicePtr(b.Reserved()) {
					t.Errorf("%v and %v overlap", b, c)
				}
			}
		}
		s := mustStats(t, p)
		if s.LiveBuffers != len(sizes) || s.BytesRequested != requested || s.BytesReserved != reserved || s.RoundingOverhead() != reserved-requested {
			t.Errorf("Stats = %v; want %d buffers, %d requested, %d reserved", s, len(sizes), requested, reserved)
		}
		if s.UsedCurrent != reserved || s.ReservedCurrent < reserved || s.UsedHigh < s.UsedCurrent || s.ReservedHigh < s.ReservedCurrent {
			t.Errorf("driver figures %v do not match %d bytes in use", s, reserved)
		}
		for _, b := range bufs {
			mustFree(t, b, e.stream)
		}
		if s := mustStats(t, p); s.LiveBuffers != 0 || s.BytesRequested != 0 || s.BytesReserved != 0 {
			t.Errorf("Stats after freeing everything = %v", s)
		}
	})
}

func TestLocalPoolDoesNotRound(t *testing.T) {
	onEachRuntime(t, func(t *testing.T, e testEnv) {
		p := mustNew(t, e.rt, WithHandleType(cudart.HandleTypeNone), WithMaxSize(3*mib+5), WithName("local"))
		if p.Granularity() != 1 || p.MaxSize() != 3*mib+5 || p.Name() != "local" {
			t.Fatalf("local pool: granularity %d, max size %d, name %q", p.Granularity(), p.MaxSize(), p.Name())
		}
		b := mustAlloc(t, p, 1000, e.stream)
		if b.Reserved() != 1000 {
			t.Errorf("Reserved() = %d; want 1000", b.Reserved())
		}
		if s := mustStats(t, p); s.RoundingOverhead() != 0 || s.BytesReserved != 1000 {
			t.Errorf("Stats = %v; want 1000 bytes and no overhead", s)
		}
		_, err := b.Lease()
		wantErr(t, "Lease on a local pool", err, ErrNotShareable)
		_, err = b.ExportRecord()
		wantErr(t, "ExportRecord on a local pool", err, ErrNotShareable)
		_, err = p.ExportHandle()
		wantErr(t, "ExportHandle on a local pool", err, ErrNotShareable)
		mustFree(t, b, e.stream)
	})
}

func TestDefaultPoolAdapter(t *testing.T) {
	onEachRuntime(t, func(t *testing.T, e testEnv) {
		p, err := FromDefault(e.rt, 0)
		if err != nil {
			t.Fatalf("FromDefault: %v", err)
		}
		closeAtEnd(t, p)
		var a Allocator = p
		b, err := a.Alloc(context.Background(), 4096, e.stream)
		if err != nil {
			t.Fatalf("Alloc: %v", err)
		}
		if a.Device() != 0 || b.Reserved() != 4096 || p.HandleType() != cudart.HandleTypeNone {
			t.Errorf("default pool: device %d, reserved %d, handle type %v", a.Device(), b.Reserved(), p.HandleType())
		}
		if err := a.Free(b, e.stream); err != nil {
			t.Fatalf("Free: %v", err)
		}
		r, err := p.Close(context.Background())
		if err != nil || r.Destroyed {
			t.Fatalf("Close = %v, %v; want the default pool kept", r, err)
		}
	})
}

func TestNewRefusesBadOptions(t *testing.T) {
	d := softDevice(t)
	cases := []struct {
		name   string
		dev    int
		opts   []Option
		target error
	}{
		{"unknown handle type", 0, []Option{WithHandleType(0x2)}, ErrInvalidOption},
		{"negative device", -1, nil, ErrInvalidOption},
		{"negative peer", 0, []Option{WithPeerAccess(-1)}, ErrInvalidOption},
		{"own device as peer", 0, []Option{WithPeerAccess(1, 0)}, ErrInvalidOption},
		{"max size overflows", 0, []Option{WithMaxSize(math.MaxUint64)}, granularity.ErrOverflow},
		{"no such device", 7, nil, cudart.ErrInvalidDevice},
	}
	for _, c := range cases {
		p, err := New(d, c.dev, c.opts...)
		if p != nil {
			closeAtEnd(t, p)
		}
		wantErr(t, c.name, err, c.target)
	}
	if _, err := New(nil, 0); !errors.Is(err, ErrInvalidOption) {
		t.Errorf("New(nil) error = %v; want ErrInvalidOption", err)
	}
}

func TestPeerAccess(t *testing.T) {
	d := softDevice(t)
	p := mustNew(t, d, WithPeerAccess(1, 1))
	if f, err := d.MemPoolGetAccess(0, p.Handle(), cudart.DeviceLocation(1)); err != nil || f != cudart.AccessReadWrite {
		t.Fatalf("device 1's access = %v, %v; want read-write", f, err)
	}
}

func TestFullPool(t *testing.T) {
	onEachRuntime(t, func(t *testing.T, e testEnv) {
		p := mustNew(t, e.rt, WithMaxSize(16*mib))
		var bufs []*Buffer
		defer func() {
			for _, b := range bufs {
				mustFree(t, b, e.stream)
			}
		}()
		g := p.Granularity()
		for i := uint64(0); ; i++ {
			if i > p.MaxSize()/g {
				t.Fatalf("allocated %d granules from a pool of %d bytes", i, p.MaxSize())
			}
			b, err := p.Alloc(context.Background(), g, e.stream)
			if err != nil {
				wantErr(t, "Alloc from a full pool", err, cudart.ErrOutOfMemory)
				if !strings.Contains(err.Error(), "reserved") || !strings.Contains(err.Error(), "in use") {
					t.Errorf("full-pool error %q does not say how much is reserved and in use", err)
				}
				break
			}
			bufs = append(bufs, b)
		}
		if len(bufs) == 0 {
			t.Fatal("not even one granule fit")
		}
		s := mustStats(t, p)
		if s.LiveBuffers != len(bufs) || s.UsedCurrent != uint64(len(bufs))*g {
			t.Errorf("Stats of the full pool = %v; want %d granules", s, len(bufs))
		}
	})
}

func TestWaitingAllocGetsFreedMemory(t *testing.T) {
	onEachRuntime(t, func(t *testing.T, e testEnv) {
		p := mustNew(t, e.rt, WithMaxSize(8*mib), WithWaitForMemory())
		bufs := fill(t, p, e.stream)
		got := make(chan error, 1)
		go func() {
			b, err := p.Alloc(context.Background(), p.Granularity(), e.stream)
			if err == nil {
				err = b.Free(e.stream)
			}
			got <- err
		}()
		blockedWaiting(t, p, got)
		mustFree(t, bufs[0], e.stream)
		if err := <-got; err != nil {
			t.Fatalf("waiting Alloc after a Free: %v", err)
		}
		for _, b := range bufs[1:] {
			mustFree(t, b, e.stream)
		}
	})
}

// fill allocates granules until the pool is full.
func fill(t testing.TB, p *Pool, s cudart.Stream) []*Buffer {
	t.Helper()
	p.wait = false
	defer func() { p.wait = true }()
	var bufs []*Buffer
	for {
		b, err := p.Alloc(context.Background(), p.Granularity(), s)
		if errors.Is(err, cudart.ErrOutOfMemory) && len(bufs) > 0 {
			return bufs
		}
		if err != nil {
			t.Fatalf("filling the pool: %v", err)
		}
		bufs = append(bufs, b)
	}
}

func TestWaitingAllocCancelled(t *testing.T) {
	onEachRuntime(t, func(t *testing.T, e testEnv) {
		p := mustNew(t, e.rt, WithMaxSize(8*mib), WithWaitForMemory())
		bufs := fill(t, p, e.stream)
		ctx, cancel := context.WithCancel(context.Background())
		got := make(chan error, 1)
		go func() {
			_, err := p.Alloc(ctx, p.Granularity(), e.stream)
			got <- err
		}()
		blockedWaiting(t, p, got)
		cancel()
		wantErr(t, "cancelled waiting Alloc", <-got, context.Canceled, cudart.ErrOutOfMemory)
		_, err := p.Alloc(ctx, 1, e.stream)
		wantErr(t, "Alloc with a cancelled context", err, context.Canceled)
		if s := mustStats(t, p); s.LiveBuffers != len(bufs) {
			t.Errorf("cancelled Allocs changed the pool: %v", s)
		}
		for _, b := range bufs {
			mustFree(t, b, e.stream)
		}
	})
}

func TestWaitingAllocEndsAtClose(t *testing.T) {
	d := softDevice(t)
	p := mustNew(t, d, WithMaxSize(4*mib), WithWaitForMemory())
	// Larger than the pool: only Close can end the wait.
	got := make(chan error, 1)
	go func() {
		_, err := p.Alloc(context.Background(), 8*mib, 0)
		got <- err
	}()
	blockedWaiting(t, p, got)
	if _, err := p.Close(context.Background()); err != nil {
		t.Fatalf("Close: %v", err)
	}
	wantErr(t, "Alloc waiting when the pool closed", <-got, ErrClosed)
}

func TestConcurrentAllocFree(t *testing.T) {
	onEachRuntime(t, func(t *testing.T, e testEnv) {
		for _, ht := range []cudart.HandleType{cudart.HandleTypePosixFD, cudart.HandleTypeNone} {
			p := mustNew(t, e.rt, WithHandleType(ht))
			const workers, rounds = 8, 100
			var wg sync.WaitGroup
			for w := 0; w < workers; w++ {
				wg.Add(1)
				go func() {
					defer wg.Done()
					var held []*Buffer
					for i := 0; i < rounds; i++ {
						b, err := p.Alloc(context.Background(), uint64(1+(w*rounds+i)*4099%(3*mib)), e.stream)
						if err != nil {
							t.Errorf("Alloc: %v", err)
							return
						}
						held = append(held, b)
						if i%3 != 0 {
							continue
						}
						for _, b := range held {
							if err := p.Free(b, e.stream); err != nil {
								t.Errorf("Free: %v", err)
							}
						}
						held = held[:0]
					}
					for _, b := range held {
						if err := p.Free(b, e.stream); err != nil {
							t.Errorf("Free: %v", err)
						}
					}
				}()
			}
			wg.Wait()
			if s := mustStats(t, p); s.LiveBuffers != 0 || s.BytesReserved != 0 || s.BytesRequested != 0 {
				t.Errorf("%v pool after concurrent Alloc/Free: %v", ht, s)
			}
			if _, err := p.Close(context.Background()); err != nil {
				t.Errorf("Close: %v", err)
			}
		}
	})
}

func TestConcurrentDoubleFree(t *testing.T) {
	onEachRuntime(t, func(t *testing.T, e testEnv) {
		p := mustNew(t, e.rt)
		for round := 0; round < 20; round++ {
			b := mustAlloc(t, p, 1, e.stream)
			errs := make(chan error, 8)
			for i := 0; i < cap(errs); i++ {
				go func() { errs <- b.Free(e.stream) }()
			}
			ok := 0
			for i := 0; i < cap(errs); i++ {
				if err := <-errs; err == nil {
					ok++
				} else if !errors.Is(err, ErrFreed) {
					t.Fatalf("concurrent Free: %v; want nil or ErrFreed", err)
				}
			}
			if ok != 1 {
				t.Fatalf("%d concurrent Frees of one buffer succeeded; want 1", ok)
			}
		}
	})
}

func TestMisuseChangesNothing(t *testing.T) {
	onEachRuntime(t, func(t *testing.T, e testEnv) {
		p := mustNew(t, e.rt, WithName("mine"))
		other := mustNew(t, e.rt, WithName("other"))
		b := mustAlloc(t, p, 100, e.stream)
		theirs := mustAlloc(t, other, 100, e.stream)
		before := mustStats(t, p)

		wantErr(t, "Free of another pool's buffer", p.Free(theirs, e.stream), ErrForeignBuffer)
		wantErr(t, "Free of nil", p.Free(nil, e.stream), ErrForeignBuffer)
		var zero Buffer
		wantErr(t, "Pool.Free of a zero Buffer", p.Free(&zero, e.stream), ErrForeignBuffer)
		wantErr(t, "Free of a zero Buffer", zero.Free(e.stream), ErrForeignBuffer)
		_, err := zero.Lease()
		wantErr(t, "Lease of a zero Buffer", err, ErrForeignBuffer)
		_, err = zero.ExportRecord()
		wantErr(t, "ExportRecord of a zero Buffer", err, ErrForeignBuffer)
		wantErr(t, "End of a zero Lease", new(Lease).End(0), ErrLeaseEnded)
		_, err = p.Alloc(context.Background(), 0, e.stream)
		wantErr(t, "Alloc(0)", err, ErrZeroSize)
		_, err = p.Alloc(context.Background(), math.MaxUint64, e.stream)
		wantErr(t, "Alloc(2^64-1)", err, granularity.ErrOverflow)
		if after := mustStats(t, p); after.LiveBuffers != before.LiveBuffers || after.BytesReserved != before.BytesReserved {
			t.Fatalf("misuse changed the pool: %v, then %v", before, after)
		}
		mustFree(t, theirs, e.stream)

		mustFree(t, b, e.stream)
		freed := mustStats(t, p)
		wantErr(t, "second Free", b.Free(e.stream), ErrFreed)
		_, err = b.Lease()
		wantErr(t, "Lease of a freed buffer", err, ErrFreed)
		_, err = b.ExportRecord()
		wantErr(t, "ExportRecord of a freed buffer", err, ErrFreed)
		if after := mustStats(t, p); after.LiveBuffers != freed.LiveBuffers || after.SharedBuffers != 0 {
			t.Fatalf("use after free changed the pool: %v, then %v", freed, after)
		}
	})
}

func TestCloseWithoutForce(t *testing.T) {
	onEachRuntime(t, func(t *testing.T, e testEnv) {
		ctx := context.Background()
		p := mustNew(t, e.rt)
		b := mustAlloc(t, p, 10, e.stream)
		_, err := p.Close(ctx)
		wantErr(t, "Close with a live buffer", err, ErrBusy)
		// Still usable.
		c := mustAlloc(t, p, 10, e.stream)
		mustFree(t, c, e.stream)
		mustFree(t, b, e.stream)
		r, err := p.Close(ctx)
		if err != nil || !r.Destroyed || r.ReleasedBuffers != 0 {
			t.Fatalf("Close of an empty pool = %v, %v", r, err)
		}
		_, err = p.Close(ctx)
		wantErr(t, "second Close", err, ErrClosed)
		_, err = p.Alloc(ctx, 1, e.stream)
		wantErr(t, "Alloc after Close", err, ErrClosed)
		wantErr(t, "Free after Close", b.Free(e.stream), ErrClosed)
		_, err = p.Stats()
		wantErr(t, "Stats after Close", err, ErrClosed)
		wantErr(t, "ResetHighWatermarks after Close", p.ResetHighWatermarks(), ErrClosed)
		_, err = p.ExportHandle()
		wantErr(t, "ExportHandle after Close", err, ErrClosed)
	})
}

func TestCloseWithForce(t *testing.T) {
	onEachRuntime(t, func(t *testing.T, e testEnv) {
		p := mustNew(t, e.rt)
		a := mustAlloc(t, p, 10, e.stream)
		b := mustAlloc(t, p, 3*mib, e.stream)
		shared := mustAlloc(t, p, 1, e.stream)
		l, err := shared.Lease()
		if err != nil {
			t.Fatalf("Lease: %v", err)
		}
		if err := l.End(0); err != nil {
			t.Fatalf("End: %v", err)
		}
		// Leased and freed: the free waits for the lease, so Close abandons it.
		held := mustAlloc(t, p, 1, e.stream)
		hl, err := held.Lease()
		if err != nil {
			t.Fatalf("Lease: %v", err)
		}
		mustFree(t, held, e.stream)
		if _, err := p.ExportHandle(); err != nil {
			t.Fatalf("ExportHandle: %v", err)
		}

		r, err := p.Close(context.Background(), Force())
		if err != nil {
			t.Fatalf("Close(Force): %v", err)
		}
		g := p.Granularity()
		if r.ReleasedBuffers != 3 || r.ReleasedBytes != a.Reserved()+b.Reserved()+shared.Reserved() ||
			r.AbandonedBuffers != 1 || r.AbandonedBytes != g || !r.Destroyed || len(r.FailedFrees) != 0 {
			t.Fatalf("Close(Force) = %v; want 3 released, 1 abandoned, destroyed", r)
		}
		if !strings.Contains(r.String(), "released 3 buffers") {
			t.Errorf("report %q does not say what it released", r)
		}
		wantErr(t, "Free of a released buffer", a.Free(e.stream), ErrClosed)
		_, err = a.Lease()
		wantErr(t, "Lease after Close", err, ErrFreed, ErrClosed)
		if err := hl.End(0); err != nil {
			t.Fatalf("End after Close: %v", err)
		}
		wantErr(t, "second End after Close", hl.End(0), ErrLeaseEnded)
	})
}

func TestStatsMatchDriverAndWatermarksReset(t *testing.T) {
	onEachRuntime(t, func(t *testing.T, e testEnv) {
		p := mustNew(t, e.rt)
		g := p.Granularity()
		a := mustAlloc(t, p, 3*g, e.stream)
		b := mustAlloc(t, p, 1, e.stream)
		s := mustStats(t, p)
		if s.UsedCurrent != 4*g || s.UsedHigh != 4*g || s.BytesReserved != 4*g || s.BytesRequested != 3*g+1 || s.RoundingOverhead() != g-1 {
			t.Fatalf("Stats = %v; want 4 granules used and reserved, %d requested", s, 3*g+1)
		}
		mustFree(t, a, e.stream)
		if err := e.rt.StreamSynchronize(0, e.stream); err != nil {
			t.Fatal(err)
		}
		s = mustStats(t, p)
		if s.UsedCurrent != g || s.UsedHigh != 4*g {
			t.Fatalf("after a free: Stats = %v; want 1 granule used, high mark 4", s)
		}
		if err := p.ResetHighWatermarks(); err != nil {
			t.Fatalf("ResetHighWatermarks: %v", err)
		}
		s = mustStats(t, p)
		if s.UsedHigh != s.UsedCurrent || s.ReservedHigh != s.ReservedCurrent {
			t.Fatalf("after reset: Stats = %v; want high marks at the current figures", s)
		}
		mustFree(t, b, e.stream)
	})
}

func TestIDsAreProcessUnique(t *testing.T) {
	d := softDevice(t)
	p, q := mustNew(t, d), mustNew(t, d, WithHandleType(cudart.HandleTypeNone))
	a, b := mustAlloc(t, p, 1, 0), mustAlloc(t, q, 1, 0)
	if a.ID() == b.ID() {
		t.Fatalf("buffers of two pools share ID %d", a.ID())
	}
	mustFree(t, a, 0)
	mustFree(t, b, 0)
}

func TestConcurrentCloses(t *testing.T) {
	onEachRuntime(t, func(t *testing.T, e testEnv) {
		p := mustNew(t, e.rt)
		mustAlloc(t, p, 1, e.stream)
		mustLease(t, mustAlloc(t, p, 1, e.stream))
		if _, err := p.ExportHandle(); err != nil {
			t.Fatal(err)
		}
		reports := make(chan CloseReport, 4)
		errs := make(chan error, cap(reports))
		for i := 0; i < cap(reports); i++ {
			go func() {
				r, err := p.Close(context.Background(), Force())
				reports <- r
				errs <- err
			}()
		}
		closed := 0
		for i := 0; i < cap(reports); i++ {
			r, err := <-reports, <-errs
			switch {
			case err == nil:
				closed++
				if r.ReleasedBuffers != 1 || r.AbandonedBuffers != 1 || !r.Destroyed {
					t.Errorf("Close(Force) = %v; want 1 released, 1 abandoned", r)
				}
			case !errors.Is(err, ErrClosed):
				t.Errorf("concurrent Close(Force): %v", err)
			}
		}
		if closed != 1 {
			t.Fatalf("%d concurrent Closes succeeded; want 1", closed)
		}
	})
}
