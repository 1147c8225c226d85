//go:build cgo && linux

package cudart_test

import (
	"errors"
	"strings"
	"testing"

	"github.com/cudapool/cudapool/cudart"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

func loadError(t *testing.T, err error) *cudart.LoadError {
	t.Helper()
	var le *cudart.LoadError
	if !errors.As(err, &le) || !errors.Is(err, cudart.ErrNoRuntime) {
		t.Fatalf("want a *LoadError wrapping ErrNoRuntime, got %v", err)
	}
	return le
}

// wantTried checks that the error names each library in order, each with a reason.
func wantTried(t *testing.T, le *cudart.LoadError, libs ...string) {
	t.Helper()
	if len(le.Tried) != len(libs) {
		t.Fatalf("tried %q, want one entry for each of %q", le.Tried, libs)
	}
	for i, lib := range libs {
		if !strings.HasPrefix(le.Tried[i], lib+": ") || len(le.Tried[i]) <= len(lib)+2 {
			t.Errorf("entry %d is %q, want %q and why it failed", i, le.Tried[i], lib)
		}
		if !strings.Contains(le.Error(), le.Tried[i]) {
			t.Errorf("error %q does not name %q", le.Error(), le.Tried[i])
		}
	}
}

// With no option and no CUDAPOOL_CUDART, Load searches the default libraries: on a
// machine without CUDA it names each of them; on a GPU host it finds one.
func TestLoadDefaultSearch(t *testing.T) {
	t.Setenv(cudart.LibraryEnv, "")
	rt, err := cudart.Load()
	if err == nil {
		if !strings.HasPrefix(rt.Name(), "libcudart.so.1") {
			t.Fatalf("loaded %q, not one of %q", rt.Name(), cudart.DefaultLibraries)
		}
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
	if !strings.Contains(le.Tried[0], "No such file") {
		t.Errorf("want the loader's reason, got %q", le.Tried[0])
	}
}

func TestLoadEnvironmentReplacesSearchAndOptionWins(t *testing.T) {
	t.Setenv(cudart.LibraryEnv, "/nonexistent/from-env.so")
	_, err := cudart.Load(cudart.WithDriverLibrary("/nonexistent/driver.so"))
	wantTried(t, loadError(t, err), "/nonexistent/from-env.so", "/nonexistent/driver.so")

	fake := buildFake(t, nil, nil)
	rt := fake.load(t) // WithLibrary wins over the environment
	if !strings.HasPrefix(rt.Name(), fake.runtime+" ") {
		t.Fatalf("loaded %q, want %s", rt.Name(), fake.runtime)
	}
}

func TestLoadNamesEveryMissingSymbol(t *testing.T) {
	fake := buildFake(t,
		[]string{"OMIT_cudaFreeAsync", "OMIT_cudaMemPoolExportPointer"},
		[]string{"OMIT_cuMemGetAllocationGranularity"})
	_, err := cudart.Load(cudart.WithLibrary(fake.runtime), cudart.WithDriverLibrary(fake.driver))
	le := loadError(t, err)
	wantTried(t, le, fake.runtime, fake.driver)
	if want := ": missing symbols: cudaFreeAsync, cudaMemPoolExportPointer"; !strings.HasSuffix(le.Tried[0], want) {
		t.Errorf("runtime entry %q, want it to end %q", le.Tried[0], want)
	}
	if want := ": missing symbols: cuMemGetAllocationGranularity"; !strings.HasSuffix(le.Tried[1], want) {
		t.Errorf("driver entry %q, want it to end %q", le.Tried[1], want)
	}
}

func TestLoadReturnsOneRuntimePerLibraries(t *testing.T) {
	fake := buildFake(t, nil, nil)
	if a, b := fake.load(t), fake.load(t); a != b {
		t.Fatal("a second Load of the same libraries returned another Runtime")
	}
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
		if err != nil || u[0] != tc.first || u[15] != tc.first+15 {
			t.Errorf("with %q: DeviceUUID(1) = %v, %v; want bytes from %#x", tc.defs, u, err, tc.first)
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
