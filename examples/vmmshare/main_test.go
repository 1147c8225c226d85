package main

import (
	"bytes"
	"context"
	"os"
	"testing"

	"github.com/stretchr/testify/require"
)

// TestMain lets the launcher test re-execute this binary as "producer" and "consumer",
// the way vmmshare re-executes itself.
func TestMain(m *testing.M) {
	if len(os.Args) > 1 && (os.Args[1] == "producer" || os.Args[1] == "consumer") {
		os.Exit(run(context.Background(), os.Args[1:], os.Stdin, os.Stdout, os.Stderr))
	}
	os.Exit(m.Run())
}

// The example runs end to end on the software device: two processes, three chunks
// mapped as one range in each, every byte checked and one copy across each boundary.
func TestVMMShareOnSoftwareDevice(t *testing.T) {
	var out, errOut bytes.Buffer
	code := run(context.Background(), []string{"-runtime", "test", "-chunks", "3", "-chunk-granules", "1"}, nil, &out, &errOut)
	require.Equal(t, 0, code, "stdout:\n%s\nstderr:\n%s", out.String(), errOut.String())
	require.Contains(t, out.String(), "software device")
	require.Contains(t, out.String(), "one copy across each of 2 chunk boundaries")
	require.Contains(t, out.String(), "vmmshare: PASS")
}

// A bad command line is refused with status 2.
func TestVMMShareUsage(t *testing.T) {
	var out, errOut bytes.Buffer
	require.Equal(t, 2, run(context.Background(), []string{"-chunks", "0"}, nil, &out, &errOut))
	require.Equal(t, 2, run(context.Background(), []string{"extra"}, nil, &out, &errOut))
}
