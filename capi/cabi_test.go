package main

import (
	"context"
	"os"
	"os/exec"
	"path/filepath"
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
	goCmd, err := exec.LookPath("go")
	if err != nil {
		t.Skip("no go command to build the library with")
	}
	cc, err := exec.LookPath("cc")
	if err != nil {
		t.Skip("no C compiler")
	}
	dir := t.TempDir()
	lib := filepath.Join(dir, "libcudapool.so")
	run(t, goCmd, "build", "-buildmode=c-shared", "-o", lib, ".")
	abi := filepath.Join(dir, "abi")
	run(t, cc, "-Wall", "-Wextra", "-Werror", "-I.", "testdata/abi.c", "-L"+dir, "-lcudapool", "-Wl,-rpath,"+dir, "-o", abi)

	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	cmd := exec.CommandContext(ctx, abi)
	cmd.Env = append(os.Environ(), "CUDAPOOL_DIR="+dir)
	out, err := cmd.CombinedOutput()
	require.NoError(t, ctx.Err(), "testdata/abi.c ran past its bound:\n%s", out)
	require.NoError(t, err, "testdata/abi.c:\n%s", out)
	require.Contains(t, string(out), ", 0 failed")
}

func run(t *testing.T, name string, args ...string) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
	defer cancel()
	out, err := exec.CommandContext(ctx, name, args...).CombinedOutput()
	require.NoError(t, err, "%s %v:\n%s", name, args, out)
}
