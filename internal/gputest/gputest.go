// Package gputest owns how cudapool's tests get a real GPU: the real CUDA runtime,
// loaded once per test binary, and a skip (or, on a GPU host, a failure) when there
// is none or too few devices.
//
// Tests that need a GPU call Runtime or Devices first. Where no runtime loads or no
// device answers, the test is skipped with the reason, so CI without a GPU passes;
// with CUDAPOOL_REQUIRE_GPU=1 (set by scripts/gpu-check.sh on the GPU host) the same
// test fails instead, so a broken install cannot pass as skipped.
package gputest

import (
	"errors"
	"os"
	"sync"
	"testing"

	"github.com/cudapool/cudapool/cudart"
)

// RequireEnv names the variable that turns every skip for want of a GPU into a
// failure when it is "1".
const RequireEnv = "CUDAPOOL_REQUIRE_GPU"

var (
	once     sync.Once
	loaded   cudart.Runtime
	loadErr  error
	count    int
	countErr error
)

// Required reports whether CUDAPOOL_REQUIRE_GPU=1, that is whether a missing GPU is a
// failure rather than a skip.
func Required() bool { return os.Getenv(RequireEnv) == "1" }

// Runtime returns the real CUDA runtime with at least one device. Otherwise it skips
// the test, saying why, or fails it when Required; an error of Load that is not
// ErrNoRuntime always fails it.
func Runtime(t testing.TB) cudart.Runtime {
	t.Helper()
	return Devices(t, 1)
}

// Devices returns the real CUDA runtime when it has at least n devices, and skips or
// fails the test as Runtime does otherwise.
func Devices(t testing.TB, n int) cudart.Runtime {
	t.Helper()
	once.Do(func() {
		loaded, loadErr = cudart.Load()
		if loadErr == nil {
			count, countErr = loaded.DeviceCount()
		}
	})
	switch {
	case loadErr != nil && !errors.Is(loadErr, cudart.ErrNoRuntime):
		t.Fatalf("gputest: loading the CUDA runtime: %v", loadErr)
	case loadErr != nil:
		unavailable(t, "no CUDA runtime: %v", loadErr)
	case countErr != nil:
		unavailable(t, "%s counts no devices: %v", loaded.Name(), countErr)
	case count < n:
		unavailable(t, "%s has %d CUDA devices, the test needs %d", loaded.Name(), count, n)
	}
	return loaded
}

func unavailable(t testing.TB, format string, args ...any) {
	t.Helper()
	if Required() {
		t.Fatalf("gputest: "+format+" (and "+RequireEnv+"=1)", args...)
	}
	t.Skipf("gputest: "+format, args...)
}
