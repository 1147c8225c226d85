// Package gputest owns how cudapool's tests get a real GPU: the real CUDA runtime,
// loaded once per test binary, and a skip (or, on a GPU host, a failure) when there
// is none or too few devices.
//
// Tests that need a GPU call Runtime or Devices first. Where no runtime loads or no
// device answers, the test is skipped with the reason, so CI without a GPU passes;
// with CUDAPOOL_REQUIRE_GPU=1 (set by scripts/gpu-check.sh on the GPU host) the same
// test fails instead, so a broken install cannot pass as skipped. A test that needs
// more GPUs than the host has is skipped as "not run (needs N GPUs)", so a one-GPU
// host passes; CUDAPOOL_REQUIRE_GPUS=N demands N GPUs and fails such a test instead.
package gputest

import (
	"errors"
	"fmt"
	"os"
	"strconv"
	"sync"
	"testing"

	"github.com/cudapool/cudapool/cudart"
)

// RequireEnv names the variable that turns every skip for want of a GPU into a
// failure when it is "1".
const RequireEnv = "CUDAPOOL_REQUIRE_GPU"

// RequireCountEnv names the variable that demands that many GPUs.
const RequireCountEnv = "CUDAPOOL_REQUIRE_GPUS"

var (
	once     sync.Once
	loaded   cudart.Runtime
	loadErr  error
	count    int
	countErr error
)

// Required reports whether CUDAPOOL_REQUIRE_GPU=1, that is whether a host without a
// GPU fails the GPU tests rather than skips them.
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
	check(t, n, host{loaded, loadErr, count, countErr})
	return loaded
}

// host is what loading the runtime found.
type host struct {
	rt       cudart.Runtime
	loadErr  error
	count    int
	countErr error
}

// check skips or fails t unless h has n devices.
func check(t testing.TB, n int, h host) {
	t.Helper()
	demanded, err := RequiredDevices()
	if err != nil {
		t.Fatalf("gputest: %v", err)
	}
	var why string
	have := 0
	switch {
	case h.loadErr != nil && !errors.Is(h.loadErr, cudart.ErrNoRuntime):
		t.Fatalf("gputest: loading the CUDA runtime: %v", h.loadErr)
	case h.loadErr != nil:
		why = fmt.Sprintf("no CUDA runtime: %v", h.loadErr)
	case h.countErr != nil:
		why = fmt.Sprintf("%s counts no devices: %v", h.rt.Name(), h.countErr)
	case h.count >= n:
		return
	case h.count > 0:
		have = h.count
		why = fmt.Sprintf("not run (needs %d GPUs): %s has %d", n, h.rt.Name(), h.count)
	default:
		why = fmt.Sprintf("%s has no CUDA devices", h.rt.Name())
	}
	// The host fails if it has fewer GPUs than demanded and than the test needs.
	switch {
	case have >= min(n, demanded):
		t.Skipf("gputest: %s", why)
	case os.Getenv(RequireCountEnv) != "":
		t.Fatalf("gputest: %s (and %s=%d)", why, RequireCountEnv, demanded)
	default:
		t.Fatalf("gputest: %s (and %s=1)", why, RequireEnv)
	}
}

// RequiredDevices is how many GPUs a missing one fails a test for: the count in
// CUDAPOOL_REQUIRE_GPUS, else 1 with CUDAPOOL_REQUIRE_GPU=1, else 0. A test that needs
// more than that on a host with fewer is skipped, as not run. It fails for a count
// that is not a positive number.
func RequiredDevices() (int, error) {
	v := os.Getenv(RequireCountEnv)
	if v == "" {
		if Required() {
			return 1, nil
		}
		return 0, nil
	}
	n, err := strconv.Atoi(v)
	if err != nil || n < 1 {
		return 0, fmt.Errorf("%s=%q: want a positive number of GPUs", RequireCountEnv, v)
	}
	return n, nil
}
