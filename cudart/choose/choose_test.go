package choose_test

import (
	"fmt"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/cudapool/cudapool/cudart"
	"github.com/cudapool/cudapool/cudart/choose"
	"github.com/cudapool/cudapool/cudart/cudarttest"
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

func TestSoftware(t *testing.T) {
	c, err := choose.Runtime(choose.Software)
	require.NoError(t, err)
	assert.IsType(t, &cudarttest.Device{}, c.Runtime)
	assert.False(t, c.OnGPU)
	assert.Contains(t, c.Why, "software device")
	assert.NoError(t, c.Fallback)
}

func TestUnknown(t *testing.T) {
	c, err := choose.Runtime("tpu")
	require.ErrorIs(t, err, choose.ErrUnknownPreference)
	assert.Nil(t, c.Runtime)
}

func TestAuto(t *testing.T) {
	t.Setenv(choose.RequireGPUEnv, "")
	gpu, loadErr := hasGPU(t)
	for _, prefer := range []string{"", choose.Auto} {
		c, err := choose.Runtime(prefer)
		require.NoError(t, err, "Runtime(%q)", prefer)
		assert.Equal(t, gpu, c.OnGPU, "Runtime(%q): OnGPU, and whether the machine has a GPU", prefer)
		if gpu {
			continue
		}
		assert.IsType(t, &cudarttest.Device{}, c.Runtime, "Runtime(%q) without a GPU", prefer)
		// One short line, naming the variable that points the loader at a runtime; the
		// loader's own words are in Fallback.
		assert.Contains(t, c.Why, "software device")
		assert.Contains(t, c.Why, cudart.LibraryEnv)
		assert.LessOrEqual(t, len(c.Why), 120, "Why is one short line: %q", c.Why)
		require.Error(t, c.Fallback)
		assert.Equal(t, loadErr.Error(), c.Fallback.Error())
	}
}

func TestAutoWithoutDevice(t *testing.T) {
	t.Setenv(choose.RequireGPUEnv, "")
	// A runtime library that is not there is what a machine without CUDA has.
	c, err := choose.Runtime(choose.Auto, cudart.WithLibrary("/nonexistent/libcudart.so"))
	require.NoError(t, err)
	assert.False(t, c.OnGPU)
	assert.ErrorIs(t, c.Fallback, cudart.ErrNoRuntime)
	assert.Contains(t, c.Why, cudart.LibraryEnv)
}

func TestNoFallbackWhereGPUIsAskedFor(t *testing.T) {
	missing := cudart.WithLibrary("/nonexistent/libcudart.so")
	t.Run("gpu asked for", func(t *testing.T) {
		t.Setenv(choose.RequireGPUEnv, "")
		c, err := choose.Runtime(choose.GPU, missing)
		require.ErrorIs(t, err, cudart.ErrNoRuntime)
		assert.Nil(t, c.Runtime)
	})
	t.Run("gpu required", func(t *testing.T) {
		t.Setenv(choose.RequireGPUEnv, "1")
		c, err := choose.Runtime(choose.Auto, missing)
		require.ErrorContains(t, err, choose.RequireGPUEnv)
		assert.Nil(t, c.Runtime)
	})
}

func TestViolations(t *testing.T) {
	c, err := choose.Runtime(choose.Software)
	require.NoError(t, err)
	rt := c.Runtime
	require.NoError(t, choose.Violations(rt), "a fresh software device")
	// A double free is the simplest broken rule to provoke.
	p, err := rt.MemPoolCreate(cudart.PoolProps{HandleTypes: cudart.HandleTypePosixFD, Location: cudart.DeviceLocation(0)})
	require.NoError(t, err)
	ptr, err := rt.MallocFromPoolAsync(0, 512, p, 0)
	require.NoError(t, err)
	require.NoError(t, rt.FreeAsync(0, ptr, 0))
	require.Error(t, rt.FreeAsync(0, ptr, 0), "the software device accepted a double free")
	assert.ErrorIs(t, choose.Violations(rt), cudarttest.ErrViolation)
	assert.NoError(t, choose.Violations(nil))
}

func ExampleRuntime() {
	c, err := choose.Runtime(choose.Software) // choose.Auto in a program: a GPU where there is one
	if err != nil {
		fmt.Println(err)
		return
	}
	n, _ := c.Runtime.DeviceCount()
	fmt.Println(c.Why)
	fmt.Println("GPU:", c.OnGPU, "devices:", n)
	// Output:
	// running on the cudarttest software device, as asked
	// GPU: false devices: 2
}
