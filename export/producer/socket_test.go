package producer_test

import (
	"context"
	"io/fs"
	"net"
	"os"
	"path/filepath"
	"syscall"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/cudapool/cudapool/cudart/cudarttest"
	"github.com/cudapool/cudapool/export"
	"github.com/cudapool/cudapool/export/internal/exporttest"
	"github.com/cudapool/cudapool/export/producer"
)

func TestListenCreatesPrivateSocketWhateverTheUmask(t *testing.T) {
	old := syscall.Umask(0)
	defer syscall.Umask(old)
	dir := exporttest.ShortDir(t)
	path := filepath.Join(dir, "x.sock")
	d := cudarttest.New()
	defer d.Close()
	ex, err := producer.Listen(path, d, producer.WithoutAnnounce(), producer.WithLogger(exporttest.DiscardLogger))
	require.NoError(t, err)
	info, err := os.Lstat(path)
	require.NoError(t, err)
	require.EqualValues(t, fs.ModeSocket, info.Mode().Type(), "socket mode %v, want a socket with 0600", info.Mode())
	require.EqualValues(t, 0o600, info.Mode().Perm(), "socket mode %v, want a socket with 0600", info.Mode())
	ents, _ := os.ReadDir(dir)
	require.EqualValues(t, 1, len(ents), "%d files in the socket's directory, want only the socket", len(ents))
	require.NoError(t, ex.Close(context.Background()))
	_, err = os.Lstat(path)
	require.ErrorIs(t, err, fs.ErrNotExist, "socket left behind after Close")
	require.ErrorIs(t, ex.Close(context.Background()), export.ErrClosed, "second Close, want export.ErrClosed")
}

func TestListenHandlesExistingPaths(t *testing.T) {
	d := cudarttest.New()
	defer d.Close()
	dir := exporttest.ShortDir(t)
	listen := func(path string) (*producer.Exporter, error) {
		return producer.Listen(path, d, producer.WithoutAnnounce(), producer.WithLogger(exporttest.DiscardLogger))
	}

	// A stale socket (bound, then its listener gone without unlinking) is replaced.
	stale := filepath.Join(dir, "stale.sock")
	l, err := net.ListenUnix("unix", &net.UnixAddr{Name: stale, Net: "unix"})
	require.NoError(t, err)
	l.SetUnlinkOnClose(false)
	l.Close()
	ex, err := listen(stale)
	require.NoError(t, err, "stale socket not replaced: %v", err)

	// A live exporter's socket is not taken over.
	_, err = listen(stale)
	require.ErrorIs(t, err, producer.ErrAddressInUse, "Listen on a live socket, want ErrAddressInUse")
	require.NoError(t, ex.Close(context.Background()))

	// A file that is not a socket is left alone.
	regular := filepath.Join(dir, "file")
	require.NoError(t, os.WriteFile(regular, []byte("keep me"), 0o600))
	_, err = listen(regular)
	require.ErrorIs(t, err, export.ErrNotSocket, "Listen on a regular file, want export.ErrNotSocket")
	b, err := os.ReadFile(regular)
	require.False(t, err != nil || string(b) != "keep me", "regular file changed: %q %v", b, err)
	ents, _ := os.ReadDir(dir)
	require.EqualValues(t, 1, len(ents), "%d files left in the directory, want only the regular file", len(ents))
}

func TestCloseLeavesASuccessorsSocketAlone(t *testing.T) {
	d := cudarttest.New()
	defer d.Close()
	path := filepath.Join(exporttest.ShortDir(t), "x.sock")
	ex, err := producer.Listen(path, d, producer.WithoutAnnounce(), producer.WithLogger(exporttest.DiscardLogger))
	require.NoError(t, err)
	// Someone replaced the socket file (an operator, or a successor after a stale
	// check gone wrong): Close must not remove theirs.
	os.Remove(path)
	l, err := net.Listen("unix", path)
	require.NoError(t, err)
	defer l.Close()
	ex.Close(context.Background())
	_, err = os.Lstat(path)
	require.NoError(t, err, "Close removed a socket it did not create")
}
