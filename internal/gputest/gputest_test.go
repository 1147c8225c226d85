package gputest

import (
	"fmt"
	"runtime"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/cudapool/cudapool/cudart"
	"github.com/cudapool/cudapool/cudart/cudarttest"
	"github.com/cudapool/cudapool/internal/testwait"
)

// recorder is a testing.TB whose Skipf and Fatalf are recorded, not acted on: they end
// the probe's goroutine as the real ones end a test's.
type recorder struct {
	testing.TB
	skipped, failed string
}

func (r *recorder) Helper() {}

func (r *recorder) Skipf(format string, args ...any) {
	r.skipped = fmt.Sprintf(format, args...)
	runtime.Goexit()
}

func (r *recorder) Fatalf(format string, args ...any) {
	r.failed = fmt.Sprintf(format, args...)
	runtime.Goexit()
}

// probe runs Devices(n) against a recorder, with CUDAPOOL_REQUIRE_GPU set to required.
func probe(t *testing.T, n int, required string) (*recorder, cudart.Runtime) {
	t.Setenv(RequireEnv, required)
	r := &recorder{TB: t}
	var rt cudart.Runtime
	done := make(chan struct{})
	go func() {
		defer close(done)
		rt = Devices(r, n)
	}()
	testwait.Recv(t, done, "Devices to return")
	return r, rt
}

// On a machine without a GPU a test skips, naming why, unless CUDAPOOL_REQUIRE_GPU=1
// makes it fail; on a GPU host the runtime comes back. Asking for more devices than a
// GPU host has is "not run" there, CUDAPOOL_REQUIRE_GPU=1 or not (CUDAPOOL_REQUIRE_GPUS
// demands them: TestOneGPUHost).
func TestDevicesSkipsOrFailsWithoutEnoughGPUs(t *testing.T) {
	rt, loadErr := cudart.Load()
	if loadErr != nil {
		require.ErrorIs(t, loadErr, cudart.ErrNoRuntime, "Load")
	}
	devices := 0
	if loadErr == nil {
		devices, _ = rt.DeviceCount()
	}
	for _, tc := range []struct {
		n       int
		require string
	}{{1, ""}, {1, "1"}, {1 << 20, ""}, {1 << 20, "1"}} {
		r, got := probe(t, tc.n, tc.require)
		switch {
		case devices >= tc.n:
			assert.Equal(t, rt, got, "Devices(%d) with %d devices", tc.n, devices)
			assert.Empty(t, r.skipped, "Devices(%d) with %d devices skipped", tc.n, devices)
			assert.Empty(t, r.failed, "Devices(%d) with %d devices failed", tc.n, devices)
		case tc.require == "1" && devices == 0:
			assert.Contains(t, r.failed, RequireEnv+"=1", "Devices(%d) required", tc.n)
			assert.Empty(t, r.skipped, "Devices(%d) required skipped", tc.n)
		default:
			assert.NotEmpty(t, r.skipped, "Devices(%d) did not skip", tc.n)
			if devices > 0 {
				assert.Contains(t, r.skipped, "not run", "Devices(%d) with %d devices", tc.n, devices)
			}
			assert.Empty(t, r.failed, "Devices(%d) failed", tc.n)
		}
		if loadErr != nil {
			assert.Contains(t, r.skipped+r.failed, loadErr.Error(), "the reason does not carry Load's error")
		}
	}
}

// checkOn runs check(n) for host h against a recorder, with CUDAPOOL_REQUIRE_GPU and
// CUDAPOOL_REQUIRE_GPUS set as given.
func checkOn(t *testing.T, n int, h host, required, requiredGPUs string) *recorder {
	t.Setenv(RequireEnv, required)
	t.Setenv(RequireCountEnv, requiredGPUs)
	r := &recorder{TB: t}
	done := make(chan struct{})
	go func() {
		defer close(done)
		check(r, n, h)
	}()
	testwait.Recv(t, done, "check to return")
	return r
}

// On a host with one GPU, CUDAPOOL_REQUIRE_GPU=1 runs the one-GPU tests and reports a
// two-GPU test as not run, skipping it; CUDAPOOL_REQUIRE_GPUS=2 demands two and fails
// it. Without a GPU, either variable fails every GPU test.
func TestOneGPUHost(t *testing.T) {
	one := host{rt: cudarttest.New(cudarttest.WithDevices(1)), count: 1}
	none := host{loadErr: fmt.Errorf("dlopen libcudart.so.13: %w", cudart.ErrNoRuntime)}
	for _, c := range []struct {
		name                   string
		h                      host
		n                      int
		required, requiredGPUs string
		skip, fail             string
	}{
		{"one GPU, one needed", one, 1, "1", "", "", ""},
		{"one GPU, two needed", one, 2, "1", "", "not run (needs 2 GPUs)", ""},
		{"one GPU, two needed, two demanded", one, 2, "1", "2", "", RequireCountEnv + "=2"},
		{"one GPU, two demanded alone", one, 2, "", "2", "", RequireCountEnv + "=2"},
		{"one GPU, two needed, none required", one, 2, "", "", "not run (needs 2 GPUs)", ""},
		{"no GPU, required", none, 1, "1", "", "", RequireEnv + "=1"},
		{"no GPU, two demanded", none, 2, "", "2", "", RequireCountEnv + "=2"},
		{"no GPU, none required", none, 1, "", "", "no CUDA runtime", ""},
		{"a bad count", one, 1, "1", "two", "", RequireCountEnv},
	} {
		t.Run(c.name, func(t *testing.T) {
			r := checkOn(t, c.n, c.h, c.required, c.requiredGPUs)
			if c.skip == "" {
				assert.Empty(t, r.skipped, "skipped")
			} else {
				assert.Contains(t, r.skipped, c.skip, "the skip")
			}
			if c.fail == "" {
				assert.Empty(t, r.failed, "failed")
			} else {
				assert.Contains(t, r.failed, c.fail, "the failure")
			}
		})
	}
}
