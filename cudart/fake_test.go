//go:build cgo && linux

package cudart_test

import (
	"embed"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/cudapool/cudapool/cudart"
)

// The fake CUDA runtime and driver (testdata) are compiled by each test that uses
// them into its own directory, so that each test gets libraries of its own, with
// fresh state, and the binding's marshalling of every call is checked on a CPU.

//go:embed testdata/fake.h testdata/fakecudart.c testdata/fakecuda.c
var fakeSources embed.FS

type fakeLibs struct{ runtime, driver string }

// buildFake compiles the fake libraries, passing runtimeDefs and driverDefs (such as
// "OMIT_cudaFreeAsync") as -D flags. It skips the test when there is no C compiler.
func buildFake(t testing.TB, runtimeDefs, driverDefs []string) fakeLibs {
	t.Helper()
	cc := os.Getenv("CC")
	if cc == "" {
		cc = "gcc"
	}
	if _, err := exec.LookPath(cc); err != nil {
		t.Skipf("no C compiler to build the fake CUDA libraries: %v", err)
	}
	dir := t.TempDir()
	for _, name := range []string{"fake.h", "fakecudart.c", "fakecuda.c"} {
		src, err := fakeSources.ReadFile("testdata/" + name)
		require.NoError(t, err)
		require.NoError(t, os.WriteFile(filepath.Join(dir, name), src, 0o644))
	}
	compile := func(src, out string, defs []string) string {
		args := []string{"-shared", "-fPIC", "-O1", "-Wall", "-Werror", "-o", out, src, "-lpthread"}
		for _, d := range defs {
			args = append(args, "-D"+d)
		}
		cmd := exec.Command(cc, args...)
		cmd.Dir = dir
		msg, err := cmd.CombinedOutput()
		require.NoError(t, err, "%s %s\n%s", cc, strings.Join(args, " "), msg)
		return filepath.Join(dir, out)
	}
	return fakeLibs{
		runtime: compile("fakecudart.c", "libfakecudart.so", runtimeDefs),
		driver:  compile("fakecuda.c", "libfakecuda.so", driverDefs),
	}
}

func (f fakeLibs) load(t testing.TB) cudart.Runtime {
	t.Helper()
	rt, err := cudart.Load(cudart.WithLibrary(f.runtime), cudart.WithDriverLibrary(f.driver))
	require.NoError(t, err, "loading the fake libraries")
	return rt
}

func loadFake(t *testing.T) cudart.Runtime {
	t.Helper()
	return buildFake(t, nil, nil).load(t)
}

// The fake's device 3 fails every call with poisonCode(the C function's name).
const poisonedDevice = 3

func poisonCode(fn string) cudart.Code {
	h := uint32(2166136261)
	for i := 0; i < len(fn); i++ {
		h = (h ^ uint32(fn[i])) * 16777619
	}
	return cudart.Code(10000 + h%50000)
}

// wantError checks that err is a *cudart.Error of op with code, named by the fake.
func wantError(t *testing.T, err error, op string, code cudart.Code) {
	t.Helper()
	var e *cudart.Error
	require.ErrorAs(t, err, &e, "want a *cudart.Error of %s with code %d", op, code)
	require.Equal(t, op, e.Op, "want %s failing with code %d, got %v", op, code, err)
	require.Equal(t, code, e.Code, "want %s failing with code %d, got %v", op, code, err)
	require.ErrorIs(t, err, code)
	name, text := fmt.Sprintf("fakeErrorName%d", code), fmt.Sprintf("fake error text %d", code)
	if strings.HasPrefix(op, "cu") && !strings.HasPrefix(op, "cuda") {
		name, text = fmt.Sprintf("FAKE_CU_NAME_%d", code), fmt.Sprintf("fake driver text %d", code)
	}
	require.Equal(t, name, e.Name, "the library's name for %v", err)
	require.Equal(t, text, e.Text, "the library's text for %v", err)
}
