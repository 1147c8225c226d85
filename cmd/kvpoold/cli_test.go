package main

import (
	"bytes"
	"context"
	"flag"
	"fmt"
	"go/parser"
	"go/token"
	"os"
	"path/filepath"
	"regexp"
	"slices"
	"strings"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/cudapool/cudapool/cudart"
	"github.com/cudapool/cudapool/cudart/choose"
	"github.com/cudapool/cudapool/internal/testwait"
)

// refused runs kvpoold with args (and a -dir of the test's own unless args give one),
// bounded: a command line taken as good serves until the context ends. It returns
// the exit status and stderr, and checks nothing went to stdout.
func refused(t *testing.T, args ...string) (int, string) {
	t.Helper()
	if !slices.Contains(args, "-dir") {
		args = append(args, "-dir", shortDir(t))
	}
	var out, errOut bytes.Buffer
	ctx, cancel := context.WithTimeout(context.Background(), testwait.Bound)
	defer cancel()
	code := run(ctx, args, &out, &errOut)
	assert.Empty(t, out.String(), "%q printed on stdout", args)
	return code, errOut.String()
}

// A -layout sets every dimension: a dimension flag beside it is refused, naming both,
// even one that agrees with the layout; -dtype takes the four spellings of -h only.
func TestConflictingFlagsAreRefused(t *testing.T) {
	base := []string{"-runtime", "test", "-pages", "8"}
	for _, c := range []struct {
		args []string
		want string
	}{
		{[]string{"-layout", "llama-0.85b", "-dtype", "fp16", "-tokens-per-page", "32"}, "-layout llama-0.85b and -dtype exclude each other"},
		{[]string{"-layout", "llama-0.85b", "-tokens-per-page", "32"}, "-layout llama-0.85b and -tokens-per-page exclude each other"},
		{[]string{"-layout", "llama-0.85b", "-dtype", "bf16"}, "-layout llama-0.85b and -dtype exclude each other"},
		{[]string{"-layout", "llama-0.85b", "-head-dim", "64"}, "-layout llama-0.85b and -head-dim exclude each other"},
		{[]string{"-layout", "llama-0.85b", "-dtype", "bfloat16"}, "-layout llama-0.85b and -dtype exclude each other"},
		{[]string{"-layers", "2", "-kv-heads", "2", "-head-dim", "8", "-dtype", "bfloat16"}, `-dtype "bfloat16": want one of bf16, fp16, fp32, fp8e4m3`},
		{[]string{"-layers", "2", "-kv-heads", "2", "-head-dim", "8", "-dtype", "half"}, `-dtype "half": want one of bf16, fp16, fp32, fp8e4m3`},
	} {
		code, errOut := refused(t, append(slices.Clone(base), c.args...)...)
		assert.Equal(t, exitUsage, code, "%q: %s", c.args, errOut)
		assert.Contains(t, errOut, c.want, "%q", c.args)
	}
	for _, dt := range []string{"bf16", "FP16", "fp32", "fp8e4m3"} {
		f, _, ok := parse([]string{"-layers", "2", "-kv-heads", "2", "-head-dim", "8", "-dtype", dt}, &bytes.Buffer{}, &bytes.Buffer{})
		require.True(t, ok)
		g, err := f.geometry()
		require.NoError(t, err, "-dtype %s", dt)
		assert.True(t, strings.EqualFold(dt, g.DType.String()), "-dtype %s made %v", dt, g.DType)
	}
}

// What a command line asks that cannot be served is a bad command line, status 2, with
// a message that says what is wrong with which flag (and no "does not fit the
// geometry" where the geometry is not the matter).
func TestBadValuesExit2(t *testing.T) {
	file := filepath.Join(t.TempDir(), "a-file")
	require.NoError(t, os.WriteFile(file, nil, 0o600))
	base := []string{"-layout", "llama-0.85b"}
	for _, c := range []struct {
		args []string
		want string
	}{
		{[]string{"-runtime", "cpu", "-pages", "8"}, `-runtime "cpu": want auto, gpu or test`},
		{[]string{"-runtime", "test", "-pages", "8", "-devices", "3"}, "-devices: device 3: the runtime has 2 device(s), 0 to 1"},
		{[]string{"-runtime", "test", "-pages", "8", "-devices", "0,0"}, "-devices: device 0 is listed twice"},
		{[]string{"-runtime", "test", "-pages", "8", "-host-bytes", "1EiB"}, "kv: not enough host memory: host tiers of 1.0 EiB on each of 1 devices are larger than the host's available memory"},
		{[]string{"-runtime", "test", "-pages", "8", "-dir", file}, "-dir " + file + " is not a directory"},
		{[]string{"-runtime", "test", "-bytes", "-5GiB"}, "-bytes -5GiB: a size cannot be negative"},
		{[]string{"-runtime", "test", "-bytes", "lots"}, `-bytes "lots" is not a size: want a number of bytes with an optional unit`},
		{[]string{"-runtime", "test", "-pages", "8", "-host-bytes", "-1"}, "-host-bytes -1: a size cannot be negative"},
		{[]string{"-runtime", "test", "-pages", "8", "-chunk-bytes", "big"}, `-chunk-bytes "big" is not a size`},
		{[]string{"-runtime", "test", "-pages", "8", "-min-free", "lots"}, `-min-free "lots" is not a size`},
		{[]string{"-runtime", "test", "-pages", "8", "-handle", "ipc"}, `-handle "ipc": want posix-fd or fabric`},
	} {
		code, errOut := refused(t, append(slices.Clone(base), c.args...)...)
		assert.Equal(t, exitUsage, code, "%q: %s", c.args, errOut)
		assert.Contains(t, errOut, c.want, "%q", c.args)
		assert.NotContains(t, errOut, "does not fit the geometry", "%q", c.args)
		assert.NotContains(t, errOut, "strconv", "%q", c.args)
	}
}

// kvpoold -h (and kvpoold keeper -h) prints the usage on stdout, every flag and the
// -dtype spellings with it, and exits 0.
func TestHelp(t *testing.T) {
	for _, h := range []string{"-h", "-help", "--help"} {
		var out, errOut bytes.Buffer
		code := run(context.Background(), []string{h}, &out, &errOut)
		assert.Equal(t, exitOK, code, h)
		assert.Empty(t, errOut.String(), h)
		assert.True(t, strings.HasPrefix(out.String(), "usage: kvpoold "), "%s: %s", h, &out)
		assert.Contains(t, out.String(), "one of bf16, fp16, fp32, fp8e4m3 (these spellings only, in any case)", h)
		for _, name := range flagNames() {
			assert.Regexp(t, "\n  -"+name+"[ \n]", out.String(), "%s shows -%s", h, name)
		}
	}
	var kout, kerr bytes.Buffer
	assert.Equal(t, exitOK, run(context.Background(), []string{"keeper", "-h"}, &kout, &kerr), "kvpoold keeper -h")
	assert.True(t, strings.HasPrefix(kout.String(), "usage: kvpoold "), "kvpoold keeper -h: %s", &kout)
	assert.Empty(t, kerr.String())

	code, errOut := refused(t, "-nope")
	assert.Equal(t, exitUsage, code)
	assert.Contains(t, errOut, "flag provided but not defined: -nope")
	assert.Contains(t, errOut, "kvpoold -h prints the usage")
}

// A kvpoold built without the software device tells a command-line user how to build
// one with it, not which Go package to import; -runtime test is then a bad command
// line (2), and auto on a host without a GPU a failure (1).
func TestWithoutTheSoftwareDevice(t *testing.T) {
	saved := pickRuntime
	t.Cleanup(func() { pickRuntime = saved })
	// What choose.Runtime returns in a program without choose/softdevice
	// (choose's own tests check it does).
	pickRuntime = func(prefer string, _ ...cudart.LoadOption) (choose.Choice, error) {
		if prefer == choose.Software {
			return choose.Choice{}, fmt.Errorf("choose: the software device was asked for, but %w", choose.ErrNoSoftwareDevice)
		}
		loader := fmt.Errorf("cudart: %w", cudart.ErrNoRuntime)
		return choose.Choice{}, fmt.Errorf("choose: no CUDA runtime loaded, and %w: %w", choose.ErrNoSoftwareDevice, loader)
	}
	for _, c := range []struct {
		runtime string
		code    int
		want    string
	}{
		{"test", exitUsage, "kvpoold: -runtime test: this kvpoold is built without the software device; build one with it (go build -tags cudapool_softdevice ./cmd/kvpoold)"},
		{"auto", exitFailed, "kvpoold: no CUDA runtime loaded (set " + cudart.LibraryEnv + " to libcudart's path), and this kvpoold is built without the software device"},
	} {
		code, errOut := refused(t, "-runtime", c.runtime, "-layout", "llama-0.85b", "-pages", "8")
		assert.Equal(t, c.code, code, "-runtime %s: %s", c.runtime, errOut)
		assert.Contains(t, errOut, c.want)
		assert.NotContains(t, errOut, "import", "a command-line user is told to import a Go package")
	}
}

// flagNames are kvpoold's flags.
func flagNames() []string {
	var names []string
	newFlagSet(&flags{}).VisitAll(func(f *flag.Flag) { names = append(names, f.Name) })
	return names
}

var flagInSynopsis = regexp.MustCompile(`(?:^|[\s\[|(])-([a-z][a-z-]*)`)

// synopsisFlags are the flags named in the lines of text from the one that starts with
// first to the first blank line.
func synopsisFlags(t *testing.T, text, first string) []string {
	t.Helper()
	i := strings.Index(text, first)
	require.GreaterOrEqual(t, i, 0, "no line starts with %q", first)
	block, _, _ := strings.Cut(text[i:], "\n\n")
	var names []string
	for _, m := range flagInSynopsis.FindAllStringSubmatch(block, -1) {
		if !slices.Contains(names, m[1]) {
			names = append(names, m[1])
		}
	}
	slices.Sort(names)
	return names
}

// The command's doc and -h's synopsis name every flag, and only flags there are: a
// flag added or removed without them fails here.
func TestSynopsisNamesEveryFlag(t *testing.T) {
	want := flagNames()
	slices.Sort(want)
	f, err := parser.ParseFile(token.NewFileSet(), "main.go", nil, parser.ParseComments|parser.PackageClauseOnly)
	require.NoError(t, err)
	require.NotNil(t, f.Doc)
	assert.Equal(t, want, synopsisFlags(t, f.Doc.Text(), "\tkvpoold [-dir"), "the flags of the command's doc synopsis (main.go)")
	assert.Equal(t, want, synopsisFlags(t, synopsis, "usage: kvpoold"), "the flags of -h's synopsis")
}
