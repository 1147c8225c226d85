//go:build cgo && linux

package cudart_test

import (
	"strings"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/cudapool/cudapool/cudart"
)

func loadError(t *testing.T, err error) *cudart.LoadError {
	t.Helper()
	var le *cudart.LoadError
	require.ErrorAs(t, err, &le)
	require.ErrorIs(t, err, cudart.ErrNoRuntime)
	return le
}

// wantTried checks that the error names each library in order, each with a reason.
func wantTried(t *testing.T, le *cudart.LoadError, libs ...string) {
	t.Helper()
	require.Len(t, le.Tried, len(libs), "want one entry for each of %q", libs)
	for i, lib := range libs {
		assert.True(t, strings.HasPrefix(le.Tried[i], lib+": ") && len(le.Tried[i]) > len(lib)+2,
			"entry %d is %q, want %q and why it failed", i, le.Tried[i], lib)
		assert.Contains(t, le.Error(), le.Tried[i])
	}
}

// With no option and no CUDAPOOL_CUDART, Load searches the default libraries: on a
// machine without CUDA it names each of them; on a GPU host it finds one.
func TestLoadDefaultSearch(t *testing.T) {
	t.Setenv(cudart.LibraryEnv, "")
	rt, err := cudart.Load()
	if err == nil {
		require.True(t, strings.HasPrefix(rt.Name(), "libcudart.so.1"), "loaded %q, not one of %q", rt.Name(), cudart.DefaultLibraries)
		t.Logf("this machine has a CUDA runtime: %s", rt.Name())
		return
	}
	le := loadError(t, err)
	wantTried(t, le, append(append([]string{}, cudart.DefaultLibraries...), cudart.DefaultDriverLibrary)...)
}

func TestLoadNamesMissingFiles(t *testing.T) {
	_, err := cudart.Load(cudart.WithLibrary("/nonexistent/libcudart.so.13"), cudart.WithDriverLibrary("/nonexistent/libcuda.so.1"))
	le := loadError(t, err)
	wantTried(t, le, "/nonexistent/libcudart.so.13", "/nonexistent/libcuda.so.1")
	assert.Contains(t, le.Tried[0], "No such file", "want the loader's reason")
}

func TestLoadEnvironmentReplacesSearchAndOptionWins(t *testing.T) {
	t.Setenv(cudart.LibraryEnv, "/nonexistent/from-env.so")
	_, err := cudart.Load(cudart.WithDriverLibrary("/nonexistent/driver.so"))
	wantTried(t, loadError(t, err), "/nonexistent/from-env.so", "/nonexistent/driver.so")

	fake := buildFake(t, nil, nil)
	rt := fake.load(t) // WithLibrary wins over the environment
	require.True(t, strings.HasPrefix(rt.Name(), fake.runtime+" "), "loaded %q, want %s", rt.Name(), fake.runtime)
}

func TestLoadNamesEveryMissingSymbol(t *testing.T) {
	fake := buildFake(t,
		[]string{"OMIT_cudaFreeAsync", "OMIT_cudaMemPoolExportPointer"},
		[]string{"OMIT_cuMemGetAllocationGranularity"})
	_, err := cudart.Load(cudart.WithLibrary(fake.runtime), cudart.WithDriverLibrary(fake.driver))
	le := loadError(t, err)
	wantTried(t, le, fake.runtime, fake.driver)
	want := ": missing symbols: cudaFreeAsync, cudaMemPoolExportPointer"
	assert.True(t, strings.HasSuffix(le.Tried[0], want), "runtime entry %q, want it to end %q", le.Tried[0], want)
	want = ": missing symbols: cuMemGetAllocationGranularity"
	assert.True(t, strings.HasSuffix(le.Tried[1], want), "driver entry %q, want it to end %q", le.Tried[1], want)
}

func TestLoadReturnsOneRuntimePerLibraries(t *testing.T) {
	fake := buildFake(t, nil, nil)
	require.Same(t, fake.load(t), fake.load(t), "a second Load of the same libraries returned another Runtime")
}

func TestLoadPrefersVersionedUUIDEntryPoint(t *testing.T) {
	for _, tc := range []struct {
		defs  []string
		first byte // the fake's v2 fills 0x80+, the first version 0x00+
	}{
		{nil, 0x80 + 16},
		{[]string{"OMIT_cuDeviceGetUuid_v2"}, 0x00 + 16},
	} {
		rt := buildFake(t, nil, tc.defs).load(t)
		u, err := rt.DeviceUUID(1)
		if assert.NoError(t, err, "with %q: DeviceUUID(1)", tc.defs) {
			assert.Equal(t, tc.first, u[0], "with %q: DeviceUUID(1) = %v, want bytes from %#x", tc.defs, u, tc.first)
			assert.Equal(t, tc.first+15, u[15], "with %q: DeviceUUID(1) = %v, want bytes from %#x", tc.defs, u, tc.first)
		}
	}
}

// cudaStreamGetDevice came with CUDA 12.8: a runtime without it still loads, and only
// StreamDevice fails, with ErrNotSupported.
func TestLoadWithoutOptionalStreamGetDevice(t *testing.T) {
	rt := buildFake(t, []string{"OMIT_cudaStreamGetDevice"}, nil).load(t)
	s, err := rt.StreamCreate(1, cudart.StreamNonBlocking)
	require.NoError(t, err)
	_, err = rt.StreamDevice(1, s)
	require.ErrorIs(t, err, cudart.ErrNotSupported)
	require.NoError(t, rt.StreamDestroy(1, s))
}

func TestStreamDevice(t *testing.T) {
	rt := buildFake(t, nil, nil).load(t)
	s, err := rt.StreamCreate(2, cudart.StreamNonBlocking)
	require.NoError(t, err)
	for dev := range 3 {
		got, err := rt.StreamDevice(dev, s)
		require.NoError(t, err)
		assert.Equal(t, 2, got, "a stream created on device 2, asked from device %d", dev)
		got, err = rt.StreamDevice(dev, 0)
		require.NoError(t, err)
		assert.Equal(t, dev, got, "the null stream, asked from device %d", dev)
	}
	require.NoError(t, rt.StreamDestroy(2, s))
}
