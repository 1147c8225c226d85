//go:build cgo

package main

import (
	"context"
	"os"
	"os/exec"
	"path/filepath"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
)

// TestCInterface builds libcudapool as its users do and runs testdata/abi.c against it:
// every bad input the C interface can be given (NULL pointers, made-up, freed and
// foreign handles, pointers no pool gave, names too long, sizes of zero, use after
// close, a forked child) must come back as the status it names, with a message. It
// needs the go command and a C compiler (the GPU host has neither, and skips it).
func TestCInterface(t *testing.T) {
	cc, err := exec.LookPath("cc")
	if err != nil {
		t.Skip("no C compiler")
	}
	lib := library(t)
	dir := filepath.Dir(lib)
	abi := filepath.Join(t.TempDir(), "abi")
	run(t, cc, "-Wall", "-Wextra", "-Werror", "-I.", "testdata/abi.c", "-L"+dir, "-lcudapool", "-Wl,-rpath,"+dir, "-o", abi)

	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	cmd := exec.CommandContext(ctx, abi)
	cmd.Env = append(os.Environ(), "CUDAPOOL_DIR="+t.TempDir())
	out, err := cmd.CombinedOutput()
	require.NoError(t, ctx.Err(), "testdata/abi.c ran past its bound:\n%s", out)
	require.NoError(t, err, "testdata/abi.c:\n%s", out)
	require.Contains(t, string(out), ", 0 failed")
}

func run(t *testing.T, name string, args ...string) {
	t.Helper()
	// Inside .ci/run's go test -timeout, as in TestPythonPackage.
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	out, err := exec.CommandContext(ctx, name, args...).CombinedOutput()
	require.NoError(t, err, "%s %v:\n%s", name, args, out)
}

// TestPythonPackage runs the Python package's tests (python/tests, with the standard
// library's unittest) against the library built as its users build it, so that the
// README's one test command covers the Python side too. It needs python3, and skips
// without it; .ci/run installs it. On the GPU host, scripts/gpu-examples.sh runs the
// same tests with pytest and CUDAPOOL_REQUIRE_GPU=1 instead.
func TestPythonPackage(t *testing.T) {
	py, err := exec.LookPath("python3")
	if err != nil {
		t.Skip("no python3 to run python/tests with")
	}
	lib := library(t)
	// Well inside .ci/run's go test -timeout (5 minutes for the whole package), so a
	// hung Python test fails here, with its output, rather than killing the binary.
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	cmd := exec.CommandContext(ctx, py, "-m", "unittest", "discover", "-s", "tests", "-t", "tests")
	cmd.Dir = filepath.Join("..", "python")
	cmd.Env = append(os.Environ(), "CUDAPOOL_LIB="+lib, "CUDAPOOL_DIR="+t.TempDir())
	out, err := cmd.CombinedOutput()
	require.NoError(t, ctx.Err(), "python/tests ran past their bound:\n%s", out)
	require.NoError(t, err, "python/tests:\n%s", out)
	require.Regexp(t, `(?m)^OK\b`, string(out), "python/tests:\n%s", out)
	t.Logf("python/tests:\n%s", out)
}

// softDeviceTag builds libcudapool with the software device linked in (softdevice.go).
const softDeviceTag = "cudapool_softdevice"

var built struct {
	once sync.Once
	lib  string
	err  error
	out  []byte
}

// library builds libcudapool once per test binary, with the command the README gives
// plus its test mode's tag (softdevice.go), so that the C and Python tests run on the
// software device where there is no GPU, and returns its path. Tests that need it skip where there is no go command (the GPU
// host runs test binaries without Go).
func library(t *testing.T) string {
	t.Helper()
	goCmd, err := exec.LookPath("go")
	if err != nil {
		t.Skip("no go command to build the library with")
	}
	built.once.Do(func() {
		dir, err := os.MkdirTemp("", "libcudapool-")
		if err != nil {
			built.err = err
			return
		}
		built.lib = filepath.Join(dir, "libcudapool.so")
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
		defer cancel()
		built.out, built.err = exec.CommandContext(ctx, goCmd, "build", "-buildmode=c-shared", "-tags", softDeviceTag, "-o", built.lib, ".").CombinedOutput()
	})
	require.NoError(t, built.err, "go build -buildmode=c-shared:\n%s", built.out)
	return built.lib
}
