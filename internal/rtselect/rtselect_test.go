package rtselect_test

import (
	"errors"
	"fmt"
	"strings"
	"testing"

	"github.com/cudapool/cudapool/cudart"
	"github.com/cudapool/cudapool/cudart/cudarttest"
	"github.com/cudapool/cudapool/internal/rtselect"
)

// hasGPU reports whether this machine has a working CUDA runtime and a device, the
// condition under which Auto must pick the real runtime.
func hasGPU(t *testing.T) (bool, error) {
	t.Helper()
	rt, err := cudart.Load()
	if err != nil {
		return false, err
	}
	n, err := rt.DeviceCount()
	return err == nil && n > 0, err
}

func TestOpenTest(t *testing.T) {
	rt, onGPU, why, err := rtselect.Open(rtselect.Test)
	if err != nil {
		t.Fatal(err)
	}
	if _, ok := rt.(*cudarttest.Device); !ok || onGPU {
		t.Errorf("Open(Test) = %T, onGPU %v; want the software device", rt, onGPU)
	}
	if !strings.Contains(why, "software device") {
		t.Errorf("why = %q, want it to name the software device", why)
	}
}

func TestOpenUnknown(t *testing.T) {
	rt, _, _, err := rtselect.Open("tpu")
	if !errors.Is(err, rtselect.ErrUnknownPreference) || rt != nil {
		t.Errorf("Open(\"tpu\") = %v, %v; want nil, ErrUnknownPreference", rt, err)
	}
}

func TestOpenAuto(t *testing.T) {
	t.Setenv(rtselect.RequireGPUEnv, "")
	gpu, loadErr := hasGPU(t)
	for _, prefer := range []string{"", rtselect.Auto} {
		rt, onGPU, why, err := rtselect.Open(prefer)
		if err != nil {
			t.Fatalf("Open(%q): %v", prefer, err)
		}
		if onGPU != gpu {
			t.Errorf("Open(%q): onGPU %v, but the machine has a GPU: %v", prefer, onGPU, gpu)
		}
		if gpu {
			continue
		}
		if _, ok := rt.(*cudarttest.Device); !ok {
			t.Errorf("Open(%q) without a GPU = %T, want the software device", prefer, rt)
		}
		// The sentence must say why no GPU is used: the loader's own words.
		if !strings.Contains(why, "software device") || !strings.Contains(why, loadErr.Error()) {
			t.Errorf("Open(%q): why = %q, want the software device and %q", prefer, why, loadErr)
		}
	}
}

func TestNoFallbackWithoutGPU(t *testing.T) {
	if gpu, _ := hasGPU(t); gpu {
		t.Skip("this machine has a GPU: there is nothing to fall back from")
	}
	t.Run("gpu asked for", func(t *testing.T) {
		t.Setenv(rtselect.RequireGPUEnv, "")
		rt, _, _, err := rtselect.Open(rtselect.GPU)
		if !errors.Is(err, cudart.ErrNoRuntime) && !errors.Is(err, cudart.ErrNoDevice) || rt != nil {
			t.Errorf("Open(GPU) = %v, %v; want nil and why there is no GPU", rt, err)
		}
	})
	t.Run("gpu required", func(t *testing.T) {
		t.Setenv(rtselect.RequireGPUEnv, "1")
		rt, _, _, err := rtselect.Open(rtselect.Auto)
		if err == nil || !strings.Contains(err.Error(), rtselect.RequireGPUEnv) || rt != nil {
			t.Errorf("Open(Auto) with %s=1 = %v, %v; want nil and an error naming it", rtselect.RequireGPUEnv, rt, err)
		}
	})
}

func TestErr(t *testing.T) {
	rt, _, _, err := rtselect.Open(rtselect.Test)
	if err != nil {
		t.Fatal(err)
	}
	if err := rtselect.Err(rt); err != nil {
		t.Fatalf("a fresh software device reports %v", err)
	}
	// A double free is the simplest broken rule to provoke.
	p, err := rt.MemPoolCreate(cudart.PoolProps{HandleTypes: cudart.HandleTypePosixFD, Location: cudart.DeviceLocation(0)})
	if err != nil {
		t.Fatal(err)
	}
	ptr, err := rt.MallocFromPoolAsync(0, 512, p, 0)
	if err != nil {
		t.Fatal(err)
	}
	if err := rt.FreeAsync(0, ptr, 0); err != nil {
		t.Fatal(err)
	}
	if err := rt.FreeAsync(0, ptr, 0); err == nil {
		t.Fatal("the software device accepted a double free")
	}
	if err := rtselect.Err(rt); !errors.Is(err, cudarttest.ErrViolation) {
		t.Errorf("after a double free Err = %v, want a violation", err)
	}
	if err := rtselect.Err(nil); err != nil {
		t.Errorf("Err(nil) = %v, want nil", err)
	}
}

func ExampleOpen() {
	rt, onGPU, why, err := rtselect.Open(rtselect.Test)
	if err != nil {
		fmt.Println(err)
		return
	}
	n, _ := rt.DeviceCount()
	fmt.Println(why)
	fmt.Println("GPU:", onGPU, "devices:", n)
	// Output:
	// running on the cudarttest software device, as asked
	// GPU: false devices: 2
}
