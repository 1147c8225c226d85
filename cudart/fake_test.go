//go:build cgo && linux

package cudart_test

import (
	"embed"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"

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
		if err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(filepath.Join(dir, name), src, 0o644); err != nil {
			t.Fatal(err)
		}
	}
	compile := func(src, out string, defs []string) string {
		args := []string{"-shared", "-fPIC", "-O1", "-Wall", "-Werror", "-o", out, src, "-lpthread"}
		for _, d := range defs {
			args = append(args, "-D"+d)
		}
		cmd := exec.Command(cc, args...)
		cmd.Dir = dir
		if msg, err := cmd.CombinedOutput(); err != nil {
			t.Fatalf("%s %s: %v\n%s", cc, strings.Join(args, " "), err, msg)
		}
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
	if err != nil {
		t.Fatalf("loading the fake libraries: %v", err)
	}
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
	if !errors.As(err, &e) {
		t.Fatalf("want a *cudart.Error of %s with code %d, got %v", op, code, err)
	}
	if e.Op != op || e.Code != code || !errors.Is(err, code) {
		t.Fatalf("want %s failing with code %d, got %v", op, code, err)
	}
	name, text := fmt.Sprintf("fakeErrorName%d", code), fmt.Sprintf("fake error text %d", code)
	if strings.HasPrefix(op, "cu") && !strings.HasPrefix(op, "cuda") {
		name, text = fmt.Sprintf("FAKE_CU_NAME_%d", code), fmt.Sprintf("fake driver text %d", code)
	}
	if e.Name != name || e.Text != text {
		t.Fatalf("want the library's name %q and text %q for %v", name, text, err)
	}
}
