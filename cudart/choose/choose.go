// Package choose owns the choice a cudapool program makes first: the real CUDA runtime
// (cudart.Load) when the machine has a GPU, else the software device, with one short
// line saying which and why, so that a program run without a GPU says so instead of
// failing or pretending.
//
// The software device is linked only into a program that asks for it, the way a
// database/sql driver is: importing package choose/softdevice registers it. Without
// that import choose offers the GPU only, and where there is none Runtime says why and
// that no software device is linked in (ErrNoSoftwareDevice).
package choose

import (
	"errors"
	"fmt"
	"os"
	"sync"

	"github.com/cudapool/cudapool/cudart"
)

// What Runtime may be asked to prefer: the words a -runtime flag takes.
const (
	// Auto picks the real runtime, and falls back to the software device when no CUDA
	// runtime loads or it sees no GPU, unless $CUDAPOOL_REQUIRE_GPU is 1. "" is Auto.
	Auto = "auto"
	// GPU insists on the real runtime and a visible GPU.
	GPU = "gpu"
	// Software picks the software device even where a GPU is present (it must be
	// linked in: package choose/softdevice).
	Software = "test"
)

// RequireGPUEnv, set to 1, forbids Auto to fall back to the software device: on a GPU
// host, a test that silently ran on the software device would prove nothing.
const RequireGPUEnv = "CUDAPOOL_REQUIRE_GPU"

var (
	// ErrUnknownPreference means Runtime was asked for something other than Auto, GPU,
	// Software or "".
	ErrUnknownPreference = errors.New("choose: unknown runtime preference")
	// ErrNoSoftwareDevice means the software device was asked for, or Auto found no GPU
	// to use, in a program that does not link the software device in.
	ErrNoSoftwareDevice = errors.New("no software device is linked in (import github.com/cudapool/cudapool/cudart/choose/softdevice)")
)

// SoftwareDevice is what a software device registers with RegisterSoftware.
type SoftwareDevice interface {
	// New returns a fresh software device.
	New() cudart.Runtime
	// Violations returns the rule violations rt has seen, joined, or nil; nil also for
	// a runtime that is not this software device.
	Violations(rt cudart.Runtime) error
}

var software struct {
	sync.Mutex
	dev SoftwareDevice
}

// RegisterSoftware makes dev the software device that Software and Auto's fallback
// use. It is called from the init of the package that provides the device
// (choose/softdevice); it panics if dev is nil or a device is already registered.
func RegisterSoftware(dev SoftwareDevice) {
	software.Lock()
	defer software.Unlock()
	if dev == nil {
		panic("choose: RegisterSoftware of a nil device")
	}
	if software.dev != nil {
		panic("choose: RegisterSoftware called twice")
	}
	software.dev = dev
}

func softwareDevice() SoftwareDevice {
	software.Lock()
	defer software.Unlock()
	return software.dev
}

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
// runtime is returned, not hidden. Software and the fallback need the software device
// linked in (package choose/softdevice), else they fail with ErrNoSoftwareDevice. On
// failure the Choice is empty and the error says why.
func Runtime(prefer string, opts ...cudart.LoadOption) (Choice, error) {
	soft := softwareDevice()
	switch prefer {
	case Software:
		if soft == nil {
			return Choice{}, fmt.Errorf("choose: the software device was asked for, but %w", ErrNoSoftwareDevice)
		}
		return Choice{Runtime: soft.New(), Why: "running on the cudarttest software device, as asked"}, nil
	case "", Auto, GPU:
	default:
		return Choice{}, fmt.Errorf("%w %q: want %q, %q or %q", ErrUnknownPreference, prefer, Auto, GPU, Software)
	}
	rt, n, err := loadGPU(opts)
	if err == nil {
		return Choice{Runtime: rt, OnGPU: true, Why: fmt.Sprintf("running on %d GPU(s) through %s", n, rt.Name())}, nil
	}
	var reason string
	switch {
	case errors.Is(err, cudart.ErrNoRuntime):
		reason = "no CUDA runtime loaded (set " + cudart.LibraryEnv + " to libcudart's path)"
	case errors.Is(err, cudart.ErrNoDevice):
		reason = "the CUDA runtime sees no GPU"
	default:
		return Choice{}, err
	}
	if prefer == GPU {
		return Choice{}, fmt.Errorf("choose: a GPU was asked for: %w", err)
	}
	if os.Getenv(RequireGPUEnv) == "1" {
		return Choice{}, fmt.Errorf("choose: %s=1 forbids the software device: %w", RequireGPUEnv, err)
	}
	if soft == nil {
		return Choice{}, fmt.Errorf("choose: %s, and %w: %w", reason, ErrNoSoftwareDevice, err)
	}
	return Choice{Runtime: soft.New(), Why: reason + "; running on the cudarttest software device", Fallback: err}, nil
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
	if soft := softwareDevice(); soft != nil {
		return soft.Violations(rt)
	}
	return nil
}
