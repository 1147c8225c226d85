//go:build linux

package cudarttest

import (
	"fmt"
	"runtime"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"golang.org/x/sys/unix"

	"github.com/cudapool/cudapool/cudart"
)

// Work runs when its stream reaches it: an event recorded behind a stall is not
// complete, a stream waiting on it holds its later work back, and each completes once
// the stall is resumed.
func TestEventsCompleteWhenTheirStreamReachesThem(t *testing.T) {
	d := newFx(t)
	st, err := d.StreamCreate(0, cudart.StreamNonBlocking)
	require.NoError(t, err)
	e, err := d.EventCreate(0, cudart.EventDisableTiming)
	require.NoError(t, err)
	done, err := d.EventQuery(0, e)
	require.NoError(t, err)
	require.True(t, done, "an event never recorded is complete")

	p := d.pool(ipcProps(0))
	ptr := d.alloc(p, 512)
	require.NoError(t, d.sync())
	resume := d.stall()
	d.write(ptr, []byte("late"))
	require.NoError(t, d.EventRecord(0, e, 0))
	done, err = d.EventQuery(0, e)
	require.NoError(t, err)
	require.False(t, done, "an event recorded behind a stall is complete")
	require.NoError(t, d.StreamWaitEvent(0, st, e))
	buf := make([]byte, 4)
	copied := make(chan error, 1)
	go func() { copied <- d.MemcpyDtoHAsync(0, buf, ptr, st) }()
	select {
	case err := <-copied:
		require.Failf(t, "a copy ran on a stream waiting for a stalled event", "it returned %v", err)
	case <-time.After(20 * time.Millisecond):
	}
	resume()
	require.NoError(t, recvWithin(t, copied, "the copy after the wait"))
	require.Equal(t, "late", string(buf), "the waiting stream ran before the work it waited for")
	require.NoError(t, d.EventSynchronize(0, e))
	done, err = d.EventQuery(0, e)
	require.NoError(t, err)
	require.True(t, done)
	require.NoError(t, d.Err())
}

// recvWithin receives one value from ch within a minute, or fails the test.
func recvWithin[T any](t *testing.T, ch <-chan T, what string) T {
	t.Helper()
	select {
	case v := <-ch:
		return v
	case <-time.After(time.Minute):
		require.FailNow(t, "gave up waiting for "+what)
	}
	panic("unreachable")
}

// Within one Device, a read on one stream of what another stream wrote needs an event
// between them, as across Devices.
func TestStreamsOfOneDeviceAreOrderedOnlyByEvents(t *testing.T) {
	d := newFx(t)
	st, err := d.StreamCreate(0, cudart.StreamNonBlocking)
	require.NoError(t, err)
	p := d.pool(ipcProps(0))
	ptr := d.alloc(p, 512)
	require.NoError(t, d.sync())
	resume := d.stall()
	d.write(ptr, []byte("w"))
	copied := make(chan error, 1)
	out := make([]byte, 1)
	go func() { copied <- d.MemcpyDtoHAsync(0, out, ptr, st) }()
	require.NoError(t, recvWithin(t, copied, "a read on a stream that waited for nothing"))
	resume()
	err = d.sync()
	require.ErrorIs(t, err, ErrViolation, "a write run after another stream's read of the memory, unordered")
	wantViolation(t, err, ViolationUnorderedWrite)

	// A free on one stream of memory another stream reads, unordered.
	resumeSt, err := d.Stall(0, st)
	require.NoError(t, err)
	require.NoError(t, d.MemcpyDtoDAsync(0, ptr+256, ptr, 8, st))
	require.NoError(t, d.FreeAsync(0, ptr, 0))
	require.NoError(t, d.sync())
	resumeSt()
	err = d.StreamSynchronize(0, st)
	wantViolation(t, err, ViolationUseAfterRelease)
}

// A free is checked when it runs against the accesses that ran before it on other
// streams: one that ran after the free was queued is not ordered before it.
func TestFreeNotOrderedAfterAnotherStreamsReadIsReported(t *testing.T) {
	d := newFx(t)
	st, err := d.StreamCreate(0, cudart.StreamNonBlocking)
	require.NoError(t, err)
	p := d.pool(ipcProps(0))
	ptr, dst := d.alloc(p, 512), d.alloc(p, 512)
	require.NoError(t, d.sync())
	resume := d.stall()
	resumeSt, err := d.Stall(0, st)
	require.NoError(t, err)
	require.NoError(t, d.MemcpyDtoDAsync(0, dst, ptr, 8, st))
	require.NoError(t, d.FreeAsync(0, ptr, 0))
	resumeSt()
	require.NoError(t, d.StreamSynchronize(0, st)) // the read ran, after the free was queued
	resume()
	wantViolation(t, d.sync(), ViolationUnorderedFree)
}

// Every violation names the seed of the Device that saw it; WithSeed and the
// environment set it.
func TestSeedIsSettableAndNamed(t *testing.T) {
	d := newFx(t, WithSeed(42))
	require.EqualValues(t, 42, d.Seed())
	p := d.pool(ipcProps(0))
	ptr := d.alloc(p, 512)
	require.NoError(t, d.FreeAsync(0, ptr, 0))
	err := d.FreeAsync(0, ptr, 0)
	wantViolation(t, err, ViolationUseAfterRelease)
	assert.Contains(t, err.Error(), "seed 42")

	t.Setenv(SeedEnv, "7")
	require.EqualValues(t, 7, newFx(t).Seed())
	require.EqualValues(t, 9, newFx(t, WithSeed(9)).Seed(), "WithSeed wins over the environment")
	t.Setenv(SeedEnv, "not a number")
	newFx(t) // ignored: a random seed
}

// ForTest logs the seed of a test that failed, and nothing for one that passed.
func TestForTestLogsTheSeedOnFailure(t *testing.T) {
	for _, failed := range []bool{false, true} {
		rec := &recordingTB{failed: failed}
		d := ForTest(rec, WithSeed(1234))
		rec.cleanup()
		_, err := d.DeviceCount()
		require.ErrorIs(t, err, ErrClosed, "ForTest's Device is closed at the test's end")
		if failed {
			require.Len(t, rec.logs, 1)
			assert.Contains(t, rec.logs[0], fmt.Sprintf("%s=1234", SeedEnv))
		} else {
			assert.Empty(t, rec.logs)
		}
	}
}

type recordingTB struct {
	failed   bool
	cleanups []func()
	logs     []string
}

func (r *recordingTB) Helper()          {}
func (r *recordingTB) Cleanup(f func()) { r.cleanups = append(r.cleanups, f) }
func (r *recordingTB) Failed() bool     { return r.failed }
func (r *recordingTB) Logf(format string, args ...any) {
	r.logs = append(r.logs, fmt.Sprintf(format, args...))
}
func (r *recordingTB) cleanup() {
	for _, f := range r.cleanups {
		f()
	}
}

var _ TB = (*recordingTB)(nil)

// An immediate Device runs every call's work before the call returns: its events are
// complete once recorded, its violations come back from the call that made them, and
// it cannot stall.
func TestImmediateMode(t *testing.T) {
	exp, imp := newFx(t, WithImmediate()), newFx(t, WithImmediate())
	_, err := exp.Stall(0, 0)
	require.ErrorIs(t, err, cudart.ErrInvalidValue)
	e, err := exp.EventCreate(0, cudart.EventDisableTiming)
	require.NoError(t, err)
	require.NoError(t, exp.EventRecord(0, e, 0))
	done, err := exp.EventQuery(0, e)
	require.NoError(t, err)
	require.True(t, done, "an immediate Device's event is complete once recorded")

	p, fd := exp.exported()
	defer func() { _ = unix.Close(fd) }() // test cleanup
	ptr := exp.alloc(p, 512)
	imp.importPtr(imp.importPool(fd), exp.exportPtr(ptr))
	wantViolation(t, exp.FreeAsync(0, ptr, 0), ViolationExporterFreedWhileImported)
}

// Close stops the Device's worker, drops the work still queued and fails the calls
// waiting for it; no goroutine is left behind.
func TestCloseStopsTheWorker(t *testing.T) {
	before := runtime.NumGoroutine()
	d := New()
	resume, err := d.Stall(0, 0)
	require.NoError(t, err)
	defer resume()
	p, err := d.MemPoolCreate(ipcProps(0))
	require.NoError(t, err)
	ptr, err := d.MallocFromPoolAsync(0, 512, p, 0)
	require.NoError(t, err)
	synced := make(chan error, 1)
	go func() { synced <- d.StreamSynchronize(0, 0) }()
	time.Sleep(10 * time.Millisecond) // let it block on the stall (a race either way ends in ErrClosed)
	require.NoError(t, d.Close())
	require.ErrorIs(t, recvWithin(t, synced, "the blocked StreamSynchronize"), ErrClosed)
	require.ErrorIs(t, d.MemcpyDtoHAsync(0, make([]byte, 1), ptr, 0), ErrClosed)
	deadline := time.Now().Add(time.Minute)
	for runtime.NumGoroutine() > before {
		require.False(t, time.Now().After(deadline), "goroutines: %d before the Device, %d after Close", before, runtime.NumGoroutine())
		time.Sleep(time.Millisecond)
	}
}

// Synchronize waits for every stream's work and returns the violations no call has
// returned yet, once.
func TestSynchronizeWaitsForEveryStream(t *testing.T) {
	d := newFx(t)
	st, err := d.StreamCreate(0, cudart.StreamNonBlocking)
	require.NoError(t, err)
	p := d.pool(ipcProps(0))
	ptr := d.alloc(p, 512)
	require.NoError(t, d.sync())
	resume := d.stall()
	require.NoError(t, d.MemsetAsync(0, ptr, 'a', 512, 0))
	require.NoError(t, d.FreeAsync(0, ptr, st)) // not ordered after the set
	require.NoError(t, d.StreamSynchronize(0, st))
	resume()
	err = d.Synchronize()
	wantViolation(t, err, ViolationUseAfterRelease)
	require.NoError(t, d.Synchronize(), "violations are returned once")
	require.Len(t, d.Violations(), 1, "and kept")
}
