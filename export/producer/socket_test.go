package producer

import (
	"context"
	"fmt"
	"io/fs"
	"net"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/cudapool/cudapool/cudart/cudarttest"
	"github.com/cudapool/cudapool/export/discover"
)

func TestListenCreatesPrivateSocketWhateverTheUmask(t *testing.T) {
	old := syscall.Umask(0)
	defer syscall.Umask(old)
	dir := shortDir(t)
	path := filepath.Join(dir, "x.sock")
	d := cudarttest.New()
	defer d.Close()
	ex, err := Listen(path, d, WithoutAnnounce(), WithLogger(discardLogger))
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
	require.ErrorIs(t, ex.Close(context.Background()), ErrClosed, "second Close, want ErrClosed")
}

func TestListenHandlesExistingPaths(t *testing.T) {
	d := cudarttest.New()
	defer d.Close()
	dir := shortDir(t)
	listen := func(path string) (*Exporter, error) {
		return Listen(path, d, WithoutAnnounce(), WithLogger(discardLogger))
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
	require.ErrorIs(t, err, ErrAddressInUse, "Listen on a live socket, want ErrAddressInUse")
	require.NoError(t, ex.Close(context.Background()))

	// A file that is not a socket is left alone.
	regular := filepath.Join(dir, "file")
	require.NoError(t, os.WriteFile(regular, []byte("keep me"), 0o600))
	_, err = listen(regular)
	require.ErrorIs(t, err, ErrNotSocket, "Listen on a regular file, want ErrNotSocket")
	b, err := os.ReadFile(regular)
	require.False(t, err != nil || string(b) != "keep me", "regular file changed: %q %v", b, err)
	ents, _ := os.ReadDir(dir)
	require.EqualValues(t, 1, len(ents), "%d files left in the directory, want only the regular file", len(ents))
}

func TestCloseLeavesASuccessorsSocketAlone(t *testing.T) {
	d := cudarttest.New()
	defer d.Close()
	path := filepath.Join(shortDir(t), "x.sock")
	ex, err := Listen(path, d, WithoutAnnounce(), WithLogger(discardLogger))
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

func TestAnnounceAndDiscover(t *testing.T) {
	d := cudarttest.New()
	defer d.Close()
	dir := filepath.Join(shortDir(t), "ann")
	path := filepath.Join(shortDir(t), "x.sock")
	ex, err := Listen(path, d, WithAnnounce(dir), WithName("unit"), WithLogger(discardLogger))
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
		{PID: impossiblePID(t), Socket: path, Name: "gone"},
		{PID: os.Getppid(), Socket: deadSock, Name: "stale"},
	} {
		_, err := announce(dir, a)
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

// impossiblePID is a pid no process can have: the kernel's pid_max itself.
func impossiblePID(t testing.TB) int {
	b, err := os.ReadFile("/proc/sys/kernel/pid_max")
	if err != nil {
		t.Skipf("no pid_max: %v", err)
	}
	n, err := strconv.Atoi(strings.TrimSpace(string(b)))
	require.NoError(t, err)
	return n
}

func TestEnsureDirRefusesSharedDirectories(t *testing.T) {
	base := shortDir(t)
	open := filepath.Join(base, "open")
	require.NoError(t, os.Mkdir(open, 0o700))
	os.Chmod(open, 0o777)
	require.ErrorIs(t, ensureDir(open), discover.ErrBadDir, "ensureDir(world-writable), want ErrBadDir")
	link := filepath.Join(base, "link")
	os.Symlink(base, link)
	require.ErrorIs(t, ensureDir(link), discover.ErrBadDir, "ensureDir(symlink), want ErrBadDir")
	require.NoError(t, ensureDir(filepath.Join(base, "new", "deep")))
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
