package gputest

import (
	"errors"
	"fmt"
	"runtime"
	"strings"
	"testing"

	"github.com/cudapool/cudapool/cudart"
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

// probe runs Devices(n) against a recorder, with CUDAPOOL_REQUIRE_GPU set to require.
func probe(t *testing.T, n int, require string) (*recorder, cudart.Runtime) {
	t.Setenv(RequireEnv, require)
	r := &recorder{TB: t}
	var rt cudart.Runtime
	done := make(chan struct{})
	go func() {
		defer close(done)
		rt = Devices(r, n)
	}()
	<-done
	return r, rt
}

// On a machine without a GPU a test skips, naming why, unless CUDAPOOL_REQUIRE_GPU=1
// makes it fail; on a GPU host the runtime comes back. Either way, asking for more
// devices than any host has skips or fails.
func TestDevicesSkipsOrFailsWithoutEnoughGPUs(t *testing.T) {
	rt, loadErr := cudart.Load()
	if loadErr != nil && !errors.Is(loadErr, cudart.ErrNoRuntime) {
		t.Fatalf("Load: %v", loadErr)
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
			if got != rt || r.skipped != "" || r.failed != "" {
				t.Errorf("Devices(%d) with %d devices: skipped %q, failed %q", tc.n, devices, r.skipped, r.failed)
			}
		case tc.require == "1":
			if r.failed == "" || !strings.Contains(r.failed, RequireEnv+"=1") || r.skipped != "" {
				t.Errorf("Devices(%d) required: failed %q, skipped %q", tc.n, r.failed, r.skipped)
			}
		default:
			if r.skipped == "" || r.failed != "" {
				t.Errorf("Devices(%d): skipped %q, failed %q", tc.n, r.skipped, r.failed)
			}
		}
		if loadErr != nil && !strings.Contains(r.skipped+r.failed, loadErr.Error()) {
			t.Errorf("the reason %q does not carry Load's error %q", r.skipped+r.failed, loadErr)
		}
	}
}
