package exporttest

import (
	"net"
	"os"
	"path/filepath"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/cudapool/cudapool/cudart"
	"github.com/cudapool/cudapool/export/internal/wire"
)

// OpenFDs counts this process's open descriptors.
func OpenFDs(t testing.TB) int {
	t.Helper()
	ents, err := os.ReadDir("/proc/self/fd")
	if err != nil {
		t.Skipf("cannot count descriptors: %v", err)
	}
	return len(ents)
}

// FakeExporterDone is fakeExporter, and a channel closed once it has hung up.
func FakeExporterDone(t testing.TB, serve func(c *wire.Conn)) (string, <-chan struct{}) {
	t.Helper()
	path := filepath.Join(ShortDir(t), "f.sock")
	l, err := net.Listen("unix", path)
	require.NoError(t, err)
	done := make(chan struct{})
	go func() {
		defer close(done)
		nc, err := l.Accept()
		if err != nil {
			return
		}
		defer func() { _ = nc.Close() }() // cleanup: what is tested is above
		serve(wire.NewConn(nc, false))
	}()
	t.Cleanup(func() { _ = l.Close(); <-done }) // cleanup: what is tested is above
	return path, done
}

// WarmEventArena makes the software device create the memfd behind its IPC events,
// which it keeps until it closes, so that counting descriptors sees only what export
// holds.
func WarmEventArena(t testing.TB, s *Side) {
	t.Helper()
	ev, err := s.Dev.EventCreate(s.Ord, cudart.EventIPC)
	require.NoError(t, err)
	require.NoError(t, s.Dev.EventDestroy(s.Ord, ev))
}
