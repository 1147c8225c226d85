package pool

import (
	"context"
	"errors"
	"runtime"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/cudapool/cudapool/cudart"
	"github.com/cudapool/cudapool/cudart/cudarttest"
	"github.com/cudapool/cudapool/internal/gputest"
	"github.com/cudapool/cudapool/internal/testwait"
)

const mib = 1 << 20

// testEnv is a runtime a behaviour test runs on, with a stream of its own.
type testEnv struct {
	rt     cudart.Runtime
	soft   *cudarttest.Device // nil on the real runtime
	stream cudart.Stream
}

// onEachRuntime runs body on a fresh software device, checked for rule violations at
// the end, and then on the real runtime (internal/gputest: skipped without a GPU,
// failed instead where CUDAPOOL_REQUIRE_GPU=1).
func onEachRuntime(t *testing.T, body func(t *testing.T, e testEnv)) {
	t.Helper()
	t.Run("cudarttest", func(t *testing.T) {
		d := softDevice(t)
		body(t, newTestEnv(t, d, d))
	})
	t.Run("gpu", func(t *testing.T) {
		rt := gputest.Runtime(t)
		body(t, newTestEnv(t, rt, nil))
	})
}

// softDevice is a software device that the test checks for violations and closes.
func softDevice(t testing.TB, opts ...cudarttest.Option) *cudarttest.Device {
	d := cudarttest.ForTest(t, opts...) // logs the seed if the test fails
	t.Cleanup(func() { assert.NoError(t, d.Err(), "software device saw rule violations") })
	return d
}

func newTestEnv(t testing.TB, rt cudart.Runtime, soft *cudarttest.Device) testEnv {
	s, err := rt.StreamCreate(0, cudart.StreamNonBlocking)
	require.NoError(t, err, "StreamCreate")
	t.Cleanup(func() {
		assert.NoError(t, rt.StreamSynchronize(0, s), "StreamSynchronize")
		assert.NoError(t, rt.StreamDestroy(0, s), "StreamDestroy")
	})
	return testEnv{rt: rt, soft: soft, stream: s}
}

// mustNew makes a pool that the test closes (forcing it, so that a failed test does
// not leak device memory); the test fails if the pool still held buffers.
func mustNew(t testing.TB, rt cudart.Runtime, opts ...Option) *Pool {
	t.Helper()
	p, err := New(rt, 0, opts...)
	require.NoError(t, err, "New")
	closeAtEnd(t, p)
	return p
}

func closeAtEnd(t testing.TB, p *Pool) {
	t.Cleanup(func() {
		r, err := p.Close(context.Background(), Force())
		if errors.Is(err, ErrClosed) {
			return
		}
		if assert.NoError(t, err, "Close(Force)") && !t.Failed() {
			assert.Zero(t, r.ReleasedBuffers+r.AbandonedBuffers, "test left buffers in pool %q: %v", p.Name(), r)
		}
	})
}

func mustAlloc(t testing.TB, p *Pool, size uint64, s cudart.Stream) *Buffer {
	t.Helper()
	b, err := p.Alloc(context.Background(), size, s)
	require.NoError(t, err, "Alloc(%d)", size)
	return b
}

func mustFree(t testing.TB, b *Buffer, s cudart.Stream) {
	t.Helper()
	require.NoError(t, b.Free(s), "Free")
}

func mustStats(t testing.TB, p *Pool) Stats {
	t.Helper()
	s, err := p.Stats()
	require.NoError(t, err, "Stats")
	return s
}

// blockedWaiting waits until an Alloc of p is blocked waiting for memory. got
// receives that Alloc's outcome: if it comes first, the Alloc did not wait and the
// test fails. The test timeout guards against an Alloc that never gets there.
func blockedWaiting(t testing.TB, p *Pool, got <-chan error) {
	t.Helper()
	deadline := time.Now().Add(testwait.Bound)
	for {
		require.False(t, time.Now().After(deadline), "no Alloc waited for memory within %v", testwait.Bound)
		select {
		case err := <-got:
			require.FailNow(t, "Alloc did not wait for memory", "it returned %v", err)
		default:
		}
		p.mu.Lock()
		blocked := p.wake != nil
		p.mu.Unlock()
		if blocked {
			return
		}
		runtime.Gosched()
	}
}

func wantErr(t testing.TB, what string, err error, targets ...error) {
	t.Helper()
	require.Error(t, err, "%s: want %v", what, targets)
	for _, target := range targets {
		require.ErrorIs(t, err, target, what)
	}
}
