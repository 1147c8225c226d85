// Package rtselect owns the choice every cudapool "main job" makes first: the real CUDA
// runtime when the machine has one, else the cudarttest software device, and a sentence
// saying which and why, so that a program run on a machine without a GPU says so instead
// of failing or pretending.
package rtselect

import (
	"errors"
	"fmt"
	"os"

	"github.com/cudapool/cudapool/cudart"
	"github.com/cudapool/cudapool/cudart/cudarttest"
)

// What Open may be asked to prefer.
const (
	// Auto picks the real runtime and falls back to the software device when no CUDA
	// runtime loads or no GPU is visible, unless $CUDAPOOL_REQUIRE_GPU is 1.
	Auto = "auto"
	// GPU insists on the real runtime and a visible GPU.
	GPU = "gpu"
	// Test picks the software device even where a GPU is present.
	Test = "test"
)

// RequireGPUEnv, set to 1, forbids Auto to fall back to the software device: on a GPU
// host, a test that silently ran on the software device would prove nothing.
const RequireGPUEnv = "CUDAPOOL_REQUIRE_GPU"

// ErrUnknownPreference means Open was asked for something other than Auto, GPU, Test or "".
var ErrUnknownPreference = errors.New("rtselect: unknown runtime preference")

// Open returns the runtime to use for prefer (Auto, GPU or Test; "" means Auto). onGPU
// says whether it is the real runtime, and why is one sentence for the program's first
// line of output: which runtime, and for the software device why no GPU is used.
//
// Auto falls back to the software device when cudart.Load fails with
// cudart.ErrNoRuntime or the runtime sees no CUDA device; any other failure of the real
// runtime is returned, not hidden. On failure rt is nil and err says why.
func Open(prefer string) (rt cudart.Runtime, onGPU bool, why string, err error) {
	switch prefer {
	case Test:
		return cudarttest.New(), false, "running on the cudarttest software device, as asked", nil
	case "", Auto, GPU:
	default:
		return nil, false, "", fmt.Errorf("%w %q: want %q, %q or %q", ErrUnknownPreference, prefer, Auto, GPU, Test)
	}
	rt, n, err := loadGPU()
	if err == nil {
		return rt, true, fmt.Sprintf("running on %d GPU(s) through %s", n, rt.Name()), nil
	}
	if !errors.Is(err, cudart.ErrNoRuntime) && !errors.Is(err, cudart.ErrNoDevice) {
		return nil, false, "", err
	}
	if prefer == GPU {
		return nil, false, "", fmt.Errorf("rtselect: a GPU was asked for: %w", err)
	}
	if os.Getenv(RequireGPUEnv) == "1" {
		return nil, false, "", fmt.Errorf("rtselect: %s=1 forbids the software device: %w", RequireGPUEnv, err)
	}
	return cudarttest.New(), false, fmt.Sprintf("no GPU, running on the cudarttest software device (%v)", err), nil
}

// loadGPU loads the real runtime and counts its devices; no device at all is reported as
// cudart.ErrNoDevice, the way the runtime itself reports a machine without one.
func loadGPU() (cudart.Runtime, int, error) {
	rt, err := cudart.Load()
	if err != nil {
		return nil, 0, err
	}
	n, err := rt.DeviceCount()
	if err != nil {
		return nil, 0, err
	}
	if n == 0 {
		return nil, 0, cudart.NewError("cudaGetDeviceCount", cudart.ErrNoDevice)
	}
	return rt, n, nil
}

// Err returns the rule violations the software device has seen (exporter freed while
// imported, use after release, unordered read, access denied), joined, or nil. The real
// runtime cannot see those, so for it Err is always nil: the software device is where a
// program proves it follows the rules.
func Err(rt cudart.Runtime) error {
	if d, ok := rt.(*cudarttest.Device); ok {
		return d.Err()
	}
	return nil
}
