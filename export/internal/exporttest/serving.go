package exporttest

import (
	"os"
	"testing"

	"github.com/stretchr/testify/require"
	"golang.org/x/sys/unix"

	"github.com/cudapool/cudapool/export/internal/wire"
)

// ExhaustFDs fills this process's descriptor table, leaving free slots, and returns
// the function that gives the rest back.
func ExhaustFDs(t *testing.T, free int) func() {
	t.Helper()
	var held []int
	for {
		fd, err := unix.Open("/dev/null", unix.O_RDONLY|unix.O_CLOEXEC, 0)
		if err != nil {
			require.ErrorIs(t, err, unix.EMFILE)
			break
		}
		held = append(held, fd)
	}
	for range free {
		_ = unix.Close(held[len(held)-1]) // cleanup: what is tested is above
		held = held[:len(held)-1]
	}
	released := false
	release := func() {
		if !released {
			wire.CloseFDs(held)
			released = true
		}
	}
	t.Cleanup(release)
	return release
}

// LowerFDLimit caps this process's descriptors near what it has open, so that a test
// can exhaust them quickly, and restores the limit when the test ends.
func LowerFDLimit(t *testing.T, spare uint64) {
	t.Helper()
	var old unix.Rlimit
	require.NoError(t, unix.Getrlimit(unix.RLIMIT_NOFILE, &old))
	entries, err := os.ReadDir("/proc/self/fd")
	require.NoError(t, err)
	lim := old
	lim.Cur = uint64(len(entries)) + spare
	require.NoError(t, unix.Setrlimit(unix.RLIMIT_NOFILE, &lim))
	t.Cleanup(func() { _ = unix.Setrlimit(unix.RLIMIT_NOFILE, &old) }) // cleanup: what is tested is above
}
