//go:build cgo

package main

import (
	"context"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// TestCInterface builds libcudapool as its users do and runs testdata/abi.c against it:
// every bad input the C interface can be given (NULL pointers, made-up, freed and
// foreign handles, pointers no pool gave, names too long, sizes of zero, use after
// close, a forked child) must come back as the status it names, with a message. It
// needs the go command and a C compiler (the GPU host has neither, and skips it).
func TestCInterface(t *testing.T) {
	runC(t, "testdata/abi.c", buildC(t, "testdata/abi.c"))
}

// buildC builds the C program src against the library, skipping the test where there
// is no C compiler, and returns the executable's path.
func buildC(t *testing.T, src string) string {
	t.Helper()
	cc, err := exec.LookPath("cc")
	if err != nil {
		t.Skip("no C compiler")
	}
	lib := library(t)
	dir := filepath.Dir(lib)
	prog := filepath.Join(t.TempDir(), strings.TrimSuffix(filepath.Base(src), ".c"))
	run(t, cc, "-Wall", "-Wextra", "-Werror", "-I.", src, "-L"+dir, "-lcudapool", "-Wl,-rpath,"+dir, "-o", prog)
	return prog
}

// runC runs prog, built from src by buildC, with env added to the test's, in a
// CUDAPOOL_DIR of its own, and fails unless it exits 0 and reports no failed check;
// it returns what it printed.
func runC(t *testing.T, src, prog string, env ...string) string {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	cmd := exec.CommandContext(ctx, prog)
	cmd.Env = append(append(os.Environ(), "CUDAPOOL_DIR="+t.TempDir()), env...)
	out, err := cmd.CombinedOutput()
	require.NoError(t, ctx.Err(), "%s ran past its bound:\n%s", src, out)
	require.NoError(t, err, "%s:\n%s", src, out)
	require.Contains(t, string(out), ", 0 failed")
	return string(out)
}

// TestCHandleTypes checks that the handle types of cudapool.h are distinct: each case of
// testdata/handles.c, which passes one kind of handle (or a bare integer) where another
// is wanted, must fail to compile, and the file without a case must compile, as C and
// (where there is a C++ compiler) as C++. It needs only a C compiler.
func TestCHandleTypes(t *testing.T) {
	cc, err := exec.LookPath("cc")
	if err != nil {
		t.Skip("no C compiler")
	}
	obj := filepath.Join(t.TempDir(), "handles.o")
	compile := func(c int) ([]byte, error) {
		ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
		defer cancel()
		return exec.CommandContext(ctx, cc, "-std=c11", "-Wall", "-Werror", "-I.", fmt.Sprintf("-DCASE=%d", c), "-c", "testdata/handles.c", "-o", obj).CombinedOutput()
	}
	out, err := compile(0)
	require.NoError(t, err, "testdata/handles.c must compile without a case:\n%s", out)
	for c := 1; c <= 8; c++ {
		out, err := compile(c)
		require.Error(t, err, "case %d compiled: a handle of the wrong kind was taken", c)
		assert.Contains(t, string(out), "incompatible", "case %d failed for another reason:\n%s", c, out)
	}
	// The header is C++'s too (extern "C", the inline _default functions).
	if cxx, err := exec.LookPath("c++"); err == nil {
		ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
		defer cancel()
		out, err := exec.CommandContext(ctx, cxx, "-std=c++11", "-Wall", "-Werror", "-I.", "-DCASE=0", "-x", "c++", "-c", "testdata/handles.c", "-o", obj).CombinedOutput()
		require.NoError(t, err, "testdata/handles.c as C++:\n%s", out)
	}
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
	cmd.Env = append(os.Environ(), "CUDAPOOL_LIB="+lib, "CUDAPOOL_DIR="+t.TempDir(), "CUDAPOOL_KVPOOLD="+kvpoold(t))
	out, err := cmd.CombinedOutput()
	require.NoError(t, ctx.Err(), "python/tests ran past their bound:\n%s", out)
	require.NoError(t, err, "python/tests:\n%s", out)
	require.Regexp(t, `(?m)^OK\b`, string(out), "python/tests:\n%s", out)
	t.Logf("python/tests:\n%s", out)
}

// softDeviceTag builds libcudapool with the software device linked in (softdevice.go).
const softDeviceTag = "cudapool_softdevice"

// TestKVCInterface runs testdata/kv.c, built against the library as TestCInterface
// builds abi.c, against a kvpoold it starts on the software device: a replica in C
// dials, allocs, writes a page, seals, matches, reads it back and releases, and every
// stale lease and bad input comes back as the status it names.
func TestKVCInterface(t *testing.T) {
	prog := buildC(t, "testdata/kv.c")
	runC(t, "testdata/kv.c", prog, "CUDAPOOL_KV_DIR="+startKVPoold(t, 32))
}

// startKVPoold starts a kvpoold of pages pages (llama-0.85b) on the software device,
// serving a new directory, which it returns; the test's cleanup stops it.
func startKVPoold(t *testing.T, pages int) string {
	t.Helper()
	tmp := t.TempDir()
	serve := filepath.Join(tmp, "kv")
	log, err := os.Create(filepath.Join(tmp, "kvpoold.log"))
	require.NoError(t, err)
	defer log.Close() // the child has its own copy
	cmd := exec.Command(kvpoold(t), "-dir", serve, "-layout", "llama-0.85b", "-pages", strconv.Itoa(pages), "-runtime", "test")
	cmd.Stdout, cmd.Stderr = log, log
	cmd.Env = append(os.Environ(), "CUDAPOOL_DIR="+t.TempDir()) // its announcements outlive a kill
	require.NoError(t, cmd.Start())
	exited := make(chan error, 1)
	go func() { exited <- cmd.Wait() }()
	t.Cleanup(func() {
		_ = cmd.Process.Signal(syscall.SIGTERM)
		select {
		case <-exited:
		case <-time.After(time.Minute):
			_ = cmd.Process.Kill()
			<-exited
		}
		if t.Failed() {
			out, _ := os.ReadFile(log.Name())
			t.Logf("kvpoold:\n%s", out)
		}
	})
	return serve
}

var built struct {
	once sync.Once
	lib  string
	err  error
	out  []byte
}

var builtKVPoold struct {
	once sync.Once
	path string
	err  error
	out  []byte
}

// kvpoold builds cmd/kvpoold once per test binary, beside the library, and returns
// its path (for the C and Python tests of the KV pages calls).
func kvpoold(t *testing.T) string {
	t.Helper()
	lib := library(t)
	builtKVPoold.once.Do(func() {
		builtKVPoold.path = filepath.Join(filepath.Dir(lib), "kvpoold")
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
		defer cancel()
		builtKVPoold.out, builtKVPoold.err = exec.CommandContext(ctx, "go", "build", "-tags", softDeviceTag, "-o", builtKVPoold.path, "../cmd/kvpoold").CombinedOutput()
	})
	require.NoError(t, builtKVPoold.err, "go build ../cmd/kvpoold:\n%s", builtKVPoold.out)
	return builtKVPoold.path
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
