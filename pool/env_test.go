package pool

import (
	"context"
	"errors"
	"runtime"
	"testing"

	"github.com/cudapool/cudapool/cudart"
	"github.com/cudapool/cudapool/cudart/cudarttest"
	"github.com/cudapool/cudapool/internal/gputest"
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
	d := cudarttest.New(opts...)
	t.Cleanup(func() {
		if err := d.Err(); err != nil {
			t.Errorf("software device saw rule violations: %v", err)
		}
		d.Close()
	})
	return d
}

func newTestEnv(t testing.TB, rt cudart.Runtime, soft *cudarttest.Device) testEnv {
	s, err := rt.StreamCreate(0, cudart.StreamNonBlocking)
	if err != nil {
		t.Fatalf("StreamCreate: %v", err)
	}
	t.Cleanup(func() {
		if err := rt.StreamSynchronize(0, s); err != nil {
			t.Errorf("StreamSynchronize: %v", err)
		}
		if err := rt.StreamDestroy(0, s); err != nil {
			t.Errorf("StreamDestroy: %v", err)
		}
	})
	return testEnv{rt: rt, soft: soft, stream: s}
}

// mustNew makes a pool that the test closes (forcing it, so that a failed test does
// not leak device memory); the test fails if the pool still held buffers.
func mustNew(t testing.TB, rt cudart.Runtime, opts ...Option) *Pool {
	t.Helper()
	p, err := New(rt, 0, opts...)
	if err != nil {
		t.Fatalf("New: %v", err)
	}
	closeAtEnd(t, p)
	return p
}

func closeAtEnd(t testing.TB, p *Pool) {
	t.Cleanup(func() {
		if r, err := p.Close(context.Background(), Force()); err != nil && !errors.Is(err, ErrClosed) {
			t.Errorf("Close(Force): %v", err)
		} else if err == nil && (r.ReleasedBuffers != 0 || r.AbandonedBuffers != 0) && !t.Failed() {
			t.Errorf("test left buffers in pool %q: %v", p.Name(), r)
		}
	})
}

func mustAlloc(t testing.TB, p *Pool, size uint64, s cudart.Stream) *Buffer {
	t.Helper()
	b, err := p.Alloc(context.Background(), size, s)
	if err != nil {
		t.Fatalf("Alloc(%d): %v", size, err)
	}
	return b
}

func mustFree(t testing.TB, b *Buffer, s cudart.Stream) {
	t.Helper()
	if err := b.Free(s); err != nil {
		t.Fatalf("Free: %v", err)
	}
}

func mustStats(t testing.TB, p *Pool) Stats {
	t.Helper()
	s, err := p.Stats()
	if err != nil {
		t.Fatalf("Stats: %v", err)
	}
	return s
}

// blockedWaiting waits until an Alloc of p is blocked waiting for memory. got
// receives that Alloc's outcome: if it comes first, the Alloc did not wait and the
// test fails. The test timeout guards against an Alloc that never gets there.
func blockedWaiting(t testing.TB, p *Pool, got <-chan error) {
	t.Helper()
	for {
		select {
		case err := <-got:
			t.Fatalf("Alloc returned %v instead of waiting for memory", err)
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
	if err == nil {
		t.Fatalf("%s: no error; want %v", what, targets)
	}
	for _, target := range targets {
		if !errors.Is(err, target) {
			t.Fatalf("%s: error %q does not wrap %v", what, err, target)
		}
	}
}
