// Package choose owns the choice a cudapool program makes first: the real CUDA runtime
// (cudart.Load) when the machine has a GPU, else the cudarttest software device, with
// one short line saying which and why, so that a program run without a GPU says so
// instead of failing or pretending.
//
// It is a package of its own, beside cudart, because cudart cannot hold it: cudarttest
// implements cudart.Runtime and so imports cudart, and cudart importing cudarttest back
// would be a cycle. Nor is it in cudarttest, whose job is the software device alone.
package choose

import (
	"errors"
	"fmt"
	"os"

	"github.com/cudapool/cudapool/cudart"
	"github.com/cudapool/cudapool/cudart/cudarttest"
)

// What Runtime may be asked to prefer: the words a -runtime flag takes.
const (
	// Auto picks the real runtime, and falls back to the software device when no CUDA
	// runtime loads or it sees no GPU, unless $CUDAPOOL_REQUIRE_GPU is 1. "" is Auto.
	Auto = "auto"
	// GPU insists on the real runtime and a visible GPU.
	GPU = "gpu"
	// Software picks the software device even where a GPU is present.
	Software = "test"
)

// RequireGPUEnv, set to 1, forbids Auto to fall back to the software device: on a GPU
// host, a test that silently ran on the software device would prove nothing.
const RequireGPUEnv = "CUDAPOOL_REQUIRE_GPU"

// ErrUnknownPreference means Runtime was asked for something other than Auto, GPU,
// Software or "".
var ErrUnknownPreference = errors.New("choose: unknown runtime preference")

// Choice is the runtime a program runs on, and why.
type Choice struct {
	Runtime cudart.Runtime
	// OnGPU is set for the real runtime.
	OnGPU bool
	// Why is one short line for the program's first output: which runtime, and for a
	// fallback to the software device, why no GPU is used.
	Why string
	// Fallback is the error that made Auto fall back to the software device, in full
	// (every library the loader tried); nil when it did not fall back.
	Fallback error
}

// Runtime returns the runtime for prefer, loading the real one with opts.
//
// Auto falls back to the software device when cudart.Load fails with
// cudart.ErrNoRuntime or the runtime sees no device; any other failure of the real
// runtime is returned, not hidden. On failure the Choice is empty and the error says
// why.
func Runtime(prefer string, opts ...cudart.LoadOption) (Choice, error) {
	switch prefer {
	case Software:
		return Choice{Runtime: cudarttest.New(), Why: "running on the cudarttest software device, as asked"}, nil
	case "", Auto, GPU:
	default:
		return Choice{}, fmt.Errorf("%w %q: want %q, %q or %q", ErrUnknownPreference, prefer, Auto, GPU, Software)
	}
	rt, n, err := loadGPU(opts)
	if err == nil {
		return Choice{Runtime: rt, OnGPU: true, Why: fmt.Sprintf("running on %d GPU(s) through %s", n, rt.Name())}, nil
	}
	var why string
	switch {
	case errors.Is(err, cudart.ErrNoRuntime):
		why = "no CUDA runtime loaded (set " + cudart.LibraryEnv + " to libcudart's path); running on the cudarttest software device"
	case errors.Is(err, cudart.ErrNoDevice):
		why = "the CUDA runtime sees no GPU; running on the cudarttest software device"
	default:
		return Choice{}, err
	}
	if prefer == GPU {
		return Choice{}, fmt.Errorf("choose: a GPU was asked for: %w", err)
	}
	if os.Getenv(RequireGPUEnv) == "1" {
		return Choice{}, fmt.Errorf("choose: %s=1 forbids the software device: %w", RequireGPUEnv, err)
	}
	return Choice{Runtime: cudarttest.New(), Why: why, Fallback: err}, nil
}

// loadGPU loads the real runtime and counts its devices; no device at all is reported as
// cudart.ErrNoDevice, the way the runtime itself reports a machine without one.
func loadGPU(opts []cudart.LoadOption) (cudart.Runtime, int, error) {
	rt, err := cudart.Load(opts...)
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

// Violations returns the rule violations the software device has seen (exporter freed
// while imported, use after release, unordered read, access denied), joined, or nil.
// The real runtime cannot see those, so for it Violations is always nil: the software
// device is where a program proves it follows the rules.
func Violations(rt cudart.Runtime) error {
	if d, ok := rt.(*cudarttest.Device); ok {
		return d.Err()
	}
	return nil
}
