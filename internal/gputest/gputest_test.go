package gputest

import (
	"fmt"
	"runtime"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/cudapool/cudapool/cudart"
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
// makes it fail; on a GPU host the runtime comes back. Either way, asking for more
// devices than any host has skips or fails.
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
		case tc.require == "1":
			assert.Contains(t, r.failed, RequireEnv+"=1", "Devices(%d) required", tc.n)
			assert.Empty(t, r.skipped, "Devices(%d) required skipped", tc.n)
		default:
			assert.NotEmpty(t, r.skipped, "Devices(%d) did not skip", tc.n)
			assert.Empty(t, r.failed, "Devices(%d) failed", tc.n)
		}
		if loadErr != nil {
			assert.Contains(t, r.skipped+r.failed, loadErr.Error(), "the reason does not carry Load's error")
		}
	}
}
