package discover_test

import (
	"context"
	"fmt"
	"io/fs"
	"net"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/cudapool/cudapool/cudart/cudarttest"
	"github.com/cudapool/cudapool/export/discover"
	"github.com/cudapool/cudapool/export/internal/exporttest"
	"github.com/cudapool/cudapool/export/producer"
)

func TestAnnounceAndDiscover(t *testing.T) {
	d := cudarttest.New()
	defer d.Close()
	dir := filepath.Join(exporttest.ShortDir(t), "ann")
	path := filepath.Join(exporttest.ShortDir(t), "x.sock")
	ex, err := producer.Listen(path, d, producer.WithAnnounceDir(dir), producer.WithName("unit"), producer.WithLogger(exporttest.DiscardLogger))
	require.NoError(t, err)
	info, err := os.Stat(dir)
	require.NoError(t, err, "announce dir: %v %v, want mode 0700", info.Mode(), err)
	require.EqualValues(t, 0o700, info.Mode().Perm(), "announce dir: %v %v, want mode 0700", info.Mode(), err)
	// Leftovers of exporters that died: one whose process is gone, one whose process
	// lives (our parent, standing in) but whose socket nobody serves, and junk.
	deadSock := filepath.Join(dir, "dead.sock")
	l, err := net.ListenUnix("unix", &net.UnixAddr{Name: deadSock, Net: "unix"})
	require.NoError(t, err)
	l.SetUnlinkOnClose(false)
	l.Close()
	for _, a := range []discover.Announcement{
		{PID: exporttest.ImpossiblePID(t), Socket: path, Name: "gone"},
		{PID: os.Getppid(), Socket: deadSock, Name: "stale"},
	} {
		_, err := discover.Announce(dir, a)
		require.NoError(t, err)
	}
	os.WriteFile(filepath.Join(dir, "junk.json"), []byte("{"), 0o600)

	found, err := discover.Discover(dir)
	require.NoError(t, err)
	byName := map[string]discover.Announcement{}
	for _, a := range found {
		byName[a.Name] = a
	}
	require.Len(t, found, 4, "Discover found %d, want 4: %+v", len(found), found)
	for _, a := range found {
		assert.False(t, a.PID != 0 && a.Path != filepath.Join(dir, fmt.Sprint(a.PID)+".json") || a.PID == 0 && a.Path != filepath.Join(dir, "junk.json"), "announcement %+v: Path %q is not its file", a, a.Path)
	}
	a := byName["unit"]
	require.False(t, !a.Live || a.PID != os.Getpid() || a.Socket != path, "own announcement %+v, want live with our pid and socket", a)
	a = byName["gone"]
	require.False(t, a.Live || !strings.Contains(a.Dead, "is gone"), "announcement of a dead pid: %+v", a)
	a = byName["stale"]
	require.False(t, a.Live || !strings.Contains(a.Dead, "refuses connections"), "announcement with a dead socket: %+v", a)
	a = byName[""]
	require.False(t, a.Live || a.PID != 0 || !strings.Contains(a.Dead, "unreadable"), "junk announcement: %+v", a)

	require.NoError(t, ex.Close(context.Background()))
	_, err = os.Stat(filepath.Join(dir, fmt.Sprint(os.Getpid())+".json"))
	require.ErrorIs(t, err, fs.ErrNotExist, "announcement left after Close")
}

func TestEnsureDirRefusesSharedDirectories(t *testing.T) {
	base := exporttest.ShortDir(t)
	open := filepath.Join(base, "open")
	require.NoError(t, os.Mkdir(open, 0o700))
	os.Chmod(open, 0o777)
	require.ErrorIs(t, discover.EnsureDir(open), discover.ErrBadDir, "discover.EnsureDir(world-writable), want ErrBadDir")
	link := filepath.Join(base, "link")
	os.Symlink(base, link)
	require.ErrorIs(t, discover.EnsureDir(link), discover.ErrBadDir, "discover.EnsureDir(symlink), want ErrBadDir")
	require.NoError(t, discover.EnsureDir(filepath.Join(base, "new", "deep")))
}

func TestDefaultDir(t *testing.T) {
	t.Setenv(discover.DirEnv, "/x/y")
	got := discover.DefaultDir()
	require.EqualValues(t, "/x/y", got, "DefaultDir with %s = %q", discover.DirEnv, got)
	t.Setenv(discover.DirEnv, "")
	t.Setenv("XDG_RUNTIME_DIR", "/run/user/7")
	got = discover.DefaultDir()
	require.EqualValues(t, "/run/user/7/cudapool", got, "DefaultDir with XDG_RUNTIME_DIR = %q", got)
	t.Setenv("XDG_RUNTIME_DIR", "")
	got, want := discover.DefaultDir(), filepath.Join(os.TempDir(), fmt.Sprint("cudapool-", os.Getuid()))
	require.EqualValues(t, want, got, "DefaultDir = %q, want %q", got, want)
}
