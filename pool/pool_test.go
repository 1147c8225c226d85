package pool

import (
	"context"
	"errors"
	"fmt"
	"math"
	"strings"
	"sync"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/cudapool/cudapool/cudart"
	"github.com/cudapool/cudapool/cudart/cudarttest"
	"github.com/cudapool/cudapool/internal/granularity"
	"github.com/cudapool/cudapool/internal/testwait"
)

func TestExportablePoolRoundsAndAligns(t *testing.T) {
	onEachRuntime(t, func(t *testing.T, e testEnv) {
		p := mustNew(t, e.rt, WithMaxSize(64*mib+1))
		g := p.Granularity()
		require.GreaterOrEqual(t, g, uint64(2), "want a real granularity")
		require.Equal(t, cudart.HandleTypePosixFD, p.HandleType())
		want, _ := granularity.RoundUp(64*mib+1, g)
		require.Equal(t, want, p.MaxSize(), "MaxSize(): want it rounded up")
		// Mixed sizes: the driver would pack the small ones below the granularity
		// (FACTS 1) if the pool did not round them.
		sizes := []uint64{1, 512, g - 1, g, g + 1, 3 * mib, 1}
		var bufs []*Buffer
		var requested, reserved uint64
		for _, n := range sizes {
			b := mustAlloc(t, p, n, e.stream)
			want, _ := granularity.RoundUp(n, g)
			assert.Equal(t, n, b.Size(), "Alloc(%d): Size", n)
			assert.Equal(t, want, b.Reserved(), "Alloc(%d): Reserved", n)
			assert.True(t, granularity.IsAligned(uint64(b.Ptr()), g), "Alloc(%d) = %#x: not aligned to %d", n, b.Ptr(), g)
			assert.Zero(t, b.Device(), "buffer %v: device", b)
			assert.Same(t, p, b.Pool(), "buffer %v: pool", b)
			assert.False(t, b.Shared(), "buffer %v: shared", b)
			bufs = append(bufs, b)
			requested += n
			reserved += want
		}
		for i, b := range bufs {
			for _, c := range bufs[i+1:] {
				assert.NotEqual(t, b.ID(), c.ID(), "two buffers with one ID")
				overlap := b.Ptr() < c.Ptr()+cudart.DevicePtr(c.Reserved()) && c.Ptr() < b.Ptr()+cudart.DevicePtr(b.Reserved())
				assert.False(t, overlap, "%v and %v overlap", b, c)
			}
		}
		s := mustStats(t, p)
		assert.Equal(t, len(sizes), s.LiveBuffers, "Stats = %v", s)
		assert.Equal(t, requested, s.BytesRequested, "Stats = %v", s)
		assert.Equal(t, reserved, s.BytesReserved, "Stats = %v", s)
		assert.Equal(t, reserved-requested, s.RoundingOverhead(), "Stats = %v", s)
		assert.Equal(t, reserved, s.UsedCurrent, "driver figures %v", s)
		assert.GreaterOrEqual(t, s.ReservedCurrent, reserved, "driver figures %v", s)
		assert.GreaterOrEqual(t, s.UsedHigh, s.UsedCurrent, "driver figures %v", s)
		assert.GreaterOrEqual(t, s.ReservedHigh, s.ReservedCurrent, "driver figures %v", s)
		for _, b := range bufs {
			mustFree(t, b, e.stream)
		}
		s = mustStats(t, p)
		assert.Zero(t, s.LiveBuffers+int(s.BytesRequested+s.BytesReserved), "Stats after freeing everything = %v", s)
	})
}

func TestLocalPoolDoesNotRound(t *testing.T) {
	onEachRuntime(t, func(t *testing.T, e testEnv) {
		p := mustNew(t, e.rt, WithHandleType(cudart.HandleTypeNone), WithMaxSize(3*mib+5), WithName("local"))
		require.Equal(t, uint64(1), p.Granularity())
		require.Equal(t, uint64(3*mib+5), p.MaxSize())
		require.Equal(t, "local", p.Name())
		b := mustAlloc(t, p, 1000, e.stream)
		assert.Equal(t, uint64(1000), b.Reserved())
		s := mustStats(t, p)
		assert.Zero(t, s.RoundingOverhead(), "Stats = %v", s)
		assert.Equal(t, uint64(1000), s.BytesReserved, "Stats = %v", s)
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
		require.NoError(t, err, "FromDefault")
		closeAtEnd(t, p)
		var a Allocator = p
		b, err := a.Alloc(context.Background(), 4096, e.stream)
		require.NoError(t, err, "Alloc")
		assert.Zero(t, a.Device())
		assert.Equal(t, uint64(4096), b.Reserved())
		assert.Equal(t, cudart.HandleTypeNone, p.HandleType())
		require.NoError(t, a.Free(b, e.stream), "Free")
		r, err := p.Close(context.Background())
		require.NoError(t, err, "Close")
		require.False(t, r.Destroyed, "Close = %v; want the default pool kept", r)
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
		{"name with a newline", 0, []Option{WithName("kv\nforged")}, ErrInvalidOption},
		{"name with an escape sequence", 0, []Option{WithName("\x1b]0;title\x07")}, ErrInvalidOption},
		{"name of invalid UTF-8", 0, []Option{WithName("kv\xff")}, ErrInvalidOption},
		{"name too long", 0, []Option{WithName(strings.Repeat("n", MaxNameLen+1))}, ErrInvalidOption},
	}
	for _, c := range cases {
		p, err := New(d, c.dev, c.opts...)
		if p != nil {
			closeAtEnd(t, p)
		}
		wantErr(t, c.name, err, c.target)
	}
	_, err := New(nil, 0)
	assert.ErrorIs(t, err, ErrInvalidOption, "New(nil)")
	_, err = New(d, 0, WithName("kv\x1b[2J"))
	assert.NotContains(t, err.Error(), "\x1b", "the error prints the name raw")
	p, err := New(d, 0, WithName(strings.Repeat("n", MaxNameLen)))
	require.NoError(t, err, "a name of MaxNameLen bytes")
	closeAtEnd(t, p)
}

func TestPeerAccess(t *testing.T) {
	d := softDevice(t)
	p := mustNew(t, d, WithPeerAccess(1, 1))
	f, err := d.MemPoolGetAccess(0, p.Handle(), cudart.DeviceLocation(1))
	require.NoError(t, err)
	require.Equal(t, cudart.AccessReadWrite, f, "device 1's access")
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
		fits := int(p.MaxSize() / g) // the pool keeps the bound itself, exactly
		for range fits {
			bufs = append(bufs, mustAlloc(t, p, g, e.stream))
		}
		_, err := p.Alloc(context.Background(), g, e.stream)
		wantErr(t, "Alloc from a full pool", err, cudart.ErrOutOfMemory)
		assert.Contains(t, err.Error(), "reserved", "the full-pool error says how much is reserved")
		assert.Contains(t, err.Error(), "in use", "the full-pool error says how much is in use")
		assert.Contains(t, err.Error(), fmt.Sprintf("%d live buffers", fits), "the full-pool error counts the live buffers")
		s := mustStats(t, p)
		assert.Equal(t, len(bufs), s.LiveBuffers, "Stats of the full pool = %v", s)
		assert.Equal(t, uint64(len(bufs))*g, s.UsedCurrent, "Stats of the full pool = %v", s)
	})
}

func TestWaitingAllocGetsFreedMemory(t *testing.T) {
	onEachRuntime(t, func(t *testing.T, e testEnv) {
		p := mustNew(t, e.rt, WithMaxSize(8*mib), WaitForMemory())
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
		require.NoError(t, testwait.Recv(t, got, "the waiting Alloc to return"), "waiting Alloc after a Free")
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
		require.NoError(t, err, "filling the pool")
		bufs = append(bufs, b)
	}
}

func TestWaitingAllocCancelled(t *testing.T) {
	onEachRuntime(t, func(t *testing.T, e testEnv) {
		p := mustNew(t, e.rt, WithMaxSize(8*mib), WaitForMemory())
		bufs := fill(t, p, e.stream)
		ctx, cancel := context.WithCancel(context.Background())
		got := make(chan error, 1)
		go func() {
			_, err := p.Alloc(ctx, p.Granularity(), e.stream)
			got <- err
		}()
		blockedWaiting(t, p, got)
		cancel()
		wantErr(t, "cancelled waiting Alloc", testwait.Recv(t, got, "the cancelled Alloc to return"), context.Canceled, cudart.ErrOutOfMemory)
		_, err := p.Alloc(ctx, 1, e.stream)
		wantErr(t, "Alloc with a cancelled context", err, context.Canceled)
		assert.Equal(t, len(bufs), mustStats(t, p).LiveBuffers, "cancelled Allocs changed the pool")
		for _, b := range bufs {
			mustFree(t, b, e.stream)
		}
	})
}

func TestWaitingAllocEndsAtClose(t *testing.T) {
	d := softDevice(t)
	p := mustNew(t, d, WithMaxSize(4*mib), WaitForMemory())
	fill(t, p, 0) // Close(Force) releases them
	got := make(chan error, 1)
	go func() {
		_, err := p.Alloc(context.Background(), p.Granularity(), 0)
		got <- err
	}()
	blockedWaiting(t, p, got)
	_, err := p.Close(context.Background(), Force())
	require.NoError(t, err, "Close")
	wantErr(t, "Alloc waiting when the pool closed", testwait.Recv(t, got, "the waiting Alloc to return"), ErrClosed)
}

// A request that can never fit (larger than the pool's max size, or than the device's
// memory) fails at once, also with WaitForMemory: no Free could ever end the wait.
func TestAllocThatNeverFitsFailsAtOnce(t *testing.T) {
	d := softDevice(t, cudarttest.WithMemory(64*mib))
	for _, c := range []struct {
		name string
		opts []Option
		size uint64
		says string
	}{
		{"larger than max size", []Option{WithMaxSize(4 * mib)}, 8 * mib, "larger than the pool's max size 4.0 MiB"},
		{"larger than the device", nil, 128 * mib, "larger than the device's 64 MiB"},
	} {
		t.Run(c.name, func(t *testing.T) {
			for _, wait := range []bool{false, true} {
				opts := c.opts
				if wait {
					opts = append(opts[:len(opts):len(opts)], WaitForMemory())
				}
				p := mustNew(t, d, opts...)
				got := make(chan error, 1)
				go func() {
					_, err := p.Alloc(context.Background(), c.size, 0)
					got <- err
				}()
				err := testwait.Recv(t, got, "an Alloc that can never fit to fail")
				wantErr(t, "Alloc that can never fit", err, cudart.ErrOutOfMemory)
				assert.Contains(t, err.Error(), c.says, "the error says why it can never fit")
				assert.Zero(t, mustStats(t, p).LiveBuffers, "a failed Alloc allocated")
			}
		})
	}
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
						if !assert.NoError(t, err, "Alloc") {
							return
						}
						held = append(held, b)
						if i%3 != 0 {
							continue
						}
						for _, b := range held {
							assert.NoError(t, p.Free(b, e.stream), "Free")
						}
						held = held[:0]
					}
					for _, b := range held {
						assert.NoError(t, p.Free(b, e.stream), "Free")
					}
				}()
			}
			wg.Wait()
			s := mustStats(t, p)
			assert.Zero(t, s.LiveBuffers+int(s.BytesReserved+s.BytesRequested), "%v pool after concurrent Alloc/Free: %v", ht, s)
			_, err := p.Close(context.Background())
			assert.NoError(t, err, "Close")
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
				if err := testwait.Recv(t, errs, "a concurrent Free to return"); err == nil {
					ok++
				} else {
					require.ErrorIs(t, err, ErrFreed, "concurrent Free: want nil or ErrFreed")
				}
			}
			require.Equal(t, 1, ok, "concurrent Frees of one buffer that succeeded")
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
		after := mustStats(t, p)
		require.Equal(t, before.LiveBuffers, after.LiveBuffers, "misuse changed the pool: %v, then %v", before, after)
		require.Equal(t, before.BytesReserved, after.BytesReserved, "misuse changed the pool: %v, then %v", before, after)
		mustFree(t, theirs, e.stream)

		mustFree(t, b, e.stream)
		freed := mustStats(t, p)
		wantErr(t, "second Free", b.Free(e.stream), ErrFreed)
		_, err = b.Lease()
		wantErr(t, "Lease of a freed buffer", err, ErrFreed)
		_, err = b.ExportRecord()
		wantErr(t, "ExportRecord of a freed buffer", err, ErrFreed)
		after = mustStats(t, p)
		require.Equal(t, freed.LiveBuffers, after.LiveBuffers, "use after free changed the pool: %v, then %v", freed, after)
		require.Zero(t, after.SharedBuffers, "use after free changed the pool: %v, then %v", freed, after)
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
		require.NoError(t, err, "Close of an empty pool")
		require.True(t, r.Destroyed, "Close of an empty pool = %v", r)
		require.Zero(t, r.ReleasedBuffers, "Close of an empty pool = %v", r)
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
		require.NoError(t, err, "Lease")
		require.NoError(t, l.End(0), "End")
		// Leased and freed: the free waits for the lease, so Close abandons it.
		held := mustAlloc(t, p, 1, e.stream)
		hl, err := held.Lease()
		require.NoError(t, err, "Lease")
		mustFree(t, held, e.stream)
		// Leased and not freed: an importer may still read it, so Close abandons it.
		ll := mustLease(t, mustAlloc(t, p, 1, e.stream))
		_, err = p.ExportHandle()
		require.NoError(t, err, "ExportHandle")
		// Close(Force) frees on the release stream, which does not wait for the
		// caller's streams: their work must be done.
		require.NoError(t, e.rt.StreamSynchronize(0, e.stream))

		r, err := p.Close(context.Background(), Force())
		require.NoError(t, err, "Close(Force)")
		g := p.Granularity()
		require.Equal(t, 3, r.ReleasedBuffers, "Close(Force) = %v", r)
		require.Equal(t, a.Reserved()+b.Reserved()+shared.Reserved(), r.ReleasedBytes, "Close(Force) = %v", r)
		require.Equal(t, 2, r.AbandonedBuffers, "Close(Force) = %v", r)
		require.Equal(t, 2*g, r.AbandonedBytes, "Close(Force) = %v", r)
		require.True(t, r.Destroyed, "Close(Force) = %v", r)
		require.Empty(t, r.FailedFrees, "Close(Force) = %v", r)
		assert.Contains(t, r.String(), "released 3 buffers", "the report says what it released")
		wantErr(t, "Free of a released buffer", a.Free(e.stream), ErrClosed)
		_, err = a.Lease()
		wantErr(t, "Lease after Close", err, ErrFreed, ErrClosed)
		require.NoError(t, hl.End(0), "End after Close")
		wantErr(t, "second End after Close", hl.End(0), ErrLeaseEnded)
		require.NoError(t, ll.End(0), "End after Close of a lease on a buffer never freed")
	})
}

func TestStatsMatchDriverAndWatermarksReset(t *testing.T) {
	onEachRuntime(t, func(t *testing.T, e testEnv) {
		p := mustNew(t, e.rt)
		g := p.Granularity()
		a := mustAlloc(t, p, 3*g, e.stream)
		b := mustAlloc(t, p, 1, e.stream)
		s := mustStats(t, p)
		require.Equal(t, [5]uint64{4 * g, 4 * g, 4 * g, 3*g + 1, g - 1},
			[5]uint64{s.UsedCurrent, s.UsedHigh, s.BytesReserved, s.BytesRequested, s.RoundingOverhead()},
			"used, used high, reserved, requested, rounding overhead in %v", s)
		mustFree(t, a, e.stream)
		require.NoError(t, e.rt.StreamSynchronize(0, e.stream))
		s = mustStats(t, p)
		require.Equal(t, g, s.UsedCurrent, "after a free: Stats = %v", s)
		require.Equal(t, 4*g, s.UsedHigh, "after a free: Stats = %v", s)
		require.NoError(t, p.ResetHighWatermarks(), "ResetHighWatermarks")
		s = mustStats(t, p)
		require.Equal(t, s.UsedCurrent, s.UsedHigh, "after reset: Stats = %v", s)
		require.Equal(t, s.ReservedCurrent, s.ReservedHigh, "after reset: Stats = %v", s)
		mustFree(t, b, e.stream)
	})
}

func TestIDsAreProcessUnique(t *testing.T) {
	d := softDevice(t)
	p, q := mustNew(t, d), mustNew(t, d, WithHandleType(cudart.HandleTypeNone))
	a, b := mustAlloc(t, p, 1, 0), mustAlloc(t, q, 1, 0)
	require.NotEqual(t, a.ID(), b.ID(), "buffers of two pools share an ID")
	mustFree(t, a, 0)
	mustFree(t, b, 0)
}

// Each pool numbers its buffers from a block of IDs; one that used up its block takes
// a new one, and no ID is given twice or is 0.
func TestIDsStayUniqueAcrossBlocks(t *testing.T) {
	p, err := New(&nullRuntime{}, 0)
	require.NoError(t, err)
	q, err := New(&nullRuntime{}, 0)
	require.NoError(t, err)
	seen := map[uint64]bool{NewBuffer(p, 1, 1).ID(): true}
	for round := range 3 {
		p.mu.Lock()
		p.ids.next = p.ids.end - 2 // two left, then a new block
		p.mu.Unlock()
		for _, pool := range []*Pool{p, q, p, p, q} {
			b, err := pool.Alloc(context.Background(), 1, 0)
			require.NoError(t, err)
			require.NotZero(t, b.ID(), "round %d", round)
			require.False(t, seen[b.ID()], "round %d: ID %d given twice", round, b.ID())
			seen[b.ID()] = true
			require.NoError(t, pool.Free(b, 0))
		}
	}
}

func TestConcurrentCloses(t *testing.T) {
	onEachRuntime(t, func(t *testing.T, e testEnv) {
		p := mustNew(t, e.rt)
		mustAlloc(t, p, 1, e.stream)
		mustLease(t, mustAlloc(t, p, 1, e.stream))
		_, err := p.ExportHandle()
		require.NoError(t, err)
		require.NoError(t, e.rt.StreamSynchronize(0, e.stream)) // Close frees on another stream
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
			r, err := testwait.Recv(t, reports, "a concurrent Close to report"), testwait.Recv(t, errs, "a concurrent Close to return")
			switch {
			case err == nil:
				closed++
				assert.Equal(t, 1, r.ReleasedBuffers, "Close(Force) = %v", r)
				assert.Equal(t, 1, r.AbandonedBuffers, "Close(Force) = %v", r)
				assert.True(t, r.Destroyed, "Close(Force) = %v", r)
			default:
				assert.ErrorIs(t, err, ErrClosed, "concurrent Close(Force)")
			}
		}
		require.Equal(t, 1, closed, "concurrent Closes that succeeded")
	})
}

// A nil option is no option: New and Close ignore it rather than crash.
func TestNilOptionsAreIgnored(t *testing.T) {
	d := cudarttest.ForTest(t)
	p, err := New(d, 0, nil, WithName("nil-options"))
	require.NoError(t, err)
	assert.Equal(t, "nil-options", p.Name())
	_, err = p.Close(context.Background(), nil)
	require.NoError(t, err)
}
