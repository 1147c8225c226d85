package choose_test

import (
	"context"
	"fmt"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/cudapool/cudapool/cudart"
	"github.com/cudapool/cudapool/cudart/choose"
	_ "github.com/cudapool/cudapool/cudart/choose/softdevice"
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

// TestLinkedOnlyWhereAskedFor checks, with the go command, that the production
// binaries (poolstat, and libcudapool built without its test tag) do not depend on the
// software device, and that libcudapool's test mode and the examples do.
func TestLinkedOnlyWhereAskedFor(t *testing.T) {
	goCmd, err := exec.LookPath("go")
	if err != nil {
		t.Skip("no go command")
	}
	deps := func(t *testing.T, args ...string) []string {
		t.Helper()
		ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
		defer cancel()
		cmd := exec.CommandContext(ctx, goCmd, append([]string{"list", "-deps", "-f", "{{.ImportPath}}"}, args...)...)
		cmd.Dir = filepath.Join("..", "..")
		out, err := cmd.Output()
		require.NoError(t, err, "go list %v", args)
		return strings.Fields(string(out))
	}
	const soft = "github.com/cudapool/cudapool/cudart/cudarttest"
	for _, pkg := range []string{"./cmd/poolstat", "./capi", "./metrics", "./cudart/choose"} {
		assert.NotContains(t, deps(t, pkg), soft, "%s links the software device", pkg)
	}
	assert.Contains(t, deps(t, "-tags", "cudapool_softdevice", "./capi"), soft, "libcudapool's test mode")
	assert.Contains(t, deps(t, "./examples/kvshare"), soft, "the examples' -runtime test")
}
