package export

import (
	"context"
	"errors"
	"fmt"
	"io/fs"
	"net"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"testing"

	"github.com/cudapool/cudapool/cudart/cudarttest"
)

func TestListenCreatesPrivateSocketWhateverTheUmask(t *testing.T) {
	old := syscall.Umask(0)
	defer syscall.Umask(old)
	dir := shortDir(t)
	path := filepath.Join(dir, "x.sock")
	d := cudarttest.New()
	defer d.Close()
	ex, err := Listen(path, d, WithoutAnnounce(), WithLogger(discardLogger))
	if err != nil {
		t.Fatal(err)
	}
	info, err := os.Lstat(path)
	if err != nil {
		t.Fatal(err)
	}
	if info.Mode().Type() != fs.ModeSocket || info.Mode().Perm() != 0o600 {
		t.Fatalf("socket mode %v, want a socket with 0600", info.Mode())
	}
	if ents, _ := os.ReadDir(dir); len(ents) != 1 {
		t.Fatalf("%d files in the socket's directory, want only the socket", len(ents))
	}
	if err := ex.Close(context.Background()); err != nil {
		t.Fatal(err)
	}
	if _, err := os.Lstat(path); !errors.Is(err, fs.ErrNotExist) {
		t.Fatalf("socket left behind after Close: %v", err)
	}
	if err := ex.Close(context.Background()); !errors.Is(err, ErrClosed) {
		t.Fatalf("second Close = %v, want ErrClosed", err)
	}
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
	if err != nil {
		t.Fatal(err)
	}
	l.SetUnlinkOnClose(false)
	l.Close()
	ex, err := listen(stale)
	if err != nil {
		t.Fatalf("stale socket not replaced: %v", err)
	}

	// A live exporter's socket is not taken over.
	if _, err := listen(stale); !errors.Is(err, ErrAddressInUse) {
		t.Fatalf("Listen on a live socket = %v, want ErrAddressInUse", err)
	}
	if err := ex.Close(context.Background()); err != nil {
		t.Fatal(err)
	}

	// A file that is not a socket is left alone.
	regular := filepath.Join(dir, "file")
	if err := os.WriteFile(regular, []byte("keep me"), 0o600); err != nil {
		t.Fatal(err)
	}
	if _, err := listen(regular); !errors.Is(err, ErrNotSocket) {
		t.Fatalf("Listen on a regular file = %v, want ErrNotSocket", err)
	}
	if b, err := os.ReadFile(regular); err != nil || string(b) != "keep me" {
		t.Fatalf("regular file changed: %q %v", b, err)
	}
	if ents, _ := os.ReadDir(dir); len(ents) != 1 {
		t.Fatalf("%d files left in the directory, want only the regular file", len(ents))
	}
}

func TestCloseLeavesASuccessorsSocketAlone(t *testing.T) {
	d := cudarttest.New()
	defer d.Close()
	path := filepath.Join(shortDir(t), "x.sock")
	ex, err := Listen(path, d, WithoutAnnounce(), WithLogger(discardLogger))
	if err != nil {
		t.Fatal(err)
	}
	// Someone replaced the socket file (an operator, or a successor after a stale
	// check gone wrong): Close must not remove theirs.
	os.Remove(path)
	l, err := net.Listen("unix", path)
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	ex.Close(context.Background())
	if _, err := os.Lstat(path); err != nil {
		t.Fatalf("Close removed a socket it did not create: %v", err)
	}
}

func TestAnnounceAndDiscover(t *testing.T) {
	d := cudarttest.New()
	defer d.Close()
	dir := filepath.Join(shortDir(t), "ann")
	path := filepath.Join(shortDir(t), "x.sock")
	ex, err := Listen(path, d, WithAnnounce(dir), WithName("unit"), WithLogger(discardLogger))
	if err != nil {
		t.Fatal(err)
	}
	if info, err := os.Stat(dir); err != nil || info.Mode().Perm() != 0o700 {
		t.Fatalf("announce dir: %v %v, want mode 0700", info.Mode(), err)
	}
	// Leftovers of exporters that died: one whose process is gone, one whose process
	// lives (our parent, standing in) but whose socket nobody serves, and junk.
	deadSock := filepath.Join(dir, "dead.sock")
	l, err := net.ListenUnix("unix", &net.UnixAddr{Name: deadSock, Net: "unix"})
	if err != nil {
		t.Fatal(err)
	}
	l.SetUnlinkOnClose(false)
	l.Close()
	for _, a := range []Announcement{
		{PID: impossiblePID(t), Socket: path, Name: "gone"},
		{PID: os.Getppid(), Socket: deadSock, Name: "stale"},
	} {
		if _, err := announce(dir, a); err != nil {
			t.Fatal(err)
		}
	}
	os.WriteFile(filepath.Join(dir, "junk.json"), []byte("{"), 0o600)

	found, err := Discover(dir)
	if err != nil {
		t.Fatal(err)
	}
	byName := map[string]Announcement{}
	for _, a := range found {
		byName[a.Name] = a
	}
	if len(found) != 4 {
		t.Fatalf("Discover found %d, want 4: %+v", len(found), found)
	}
	for _, a := range found {
		if a.PID != 0 && a.Path != filepath.Join(dir, fmt.Sprint(a.PID)+".json") || a.PID == 0 && a.Path != filepath.Join(dir, "junk.json") {
			t.Errorf("announcement %+v: Path %q is not its file", a, a.Path)
		}
	}
	if a := byName["unit"]; !a.Live || a.PID != os.Getpid() || a.Socket != path {
		t.Fatalf("own announcement %+v, want live with our pid and socket", a)
	}
	if a := byName["gone"]; a.Live || !strings.Contains(a.Dead, "is gone") {
		t.Fatalf("announcement of a dead pid: %+v", a)
	}
	if a := byName["stale"]; a.Live || !strings.Contains(a.Dead, "refuses connections") {
		t.Fatalf("announcement with a dead socket: %+v", a)
	}
	if a := byName[""]; a.Live || a.PID != 0 || !strings.Contains(a.Dead, "unreadable") {
		t.Fatalf("junk announcement: %+v", a)
	}

	if err := ex.Close(context.Background()); err != nil {
		t.Fatal(err)
	}
	if _, err := os.Stat(filepath.Join(dir, fmt.Sprint(os.Getpid())+".json")); !errors.Is(err, fs.ErrNotExist) {
		t.Fatalf("announcement left after Close: %v", err)
	}
}

// impossiblePID is a pid no process can have: the kernel's pid_max itself.
func impossiblePID(t testing.TB) int {
	b, err := os.ReadFile("/proc/sys/kernel/pid_max")
	if err != nil {
		t.Skipf("no pid_max: %v", err)
	}
	n, err := strconv.Atoi(strings.TrimSpace(string(b)))
	if err != nil {
		t.Fatal(err)
	}
	return n
}

func TestEnsureDirRefusesSharedDirectories(t *testing.T) {
	base := shortDir(t)
	open := filepath.Join(base, "open")
	if err := os.Mkdir(open, 0o700); err != nil {
		t.Fatal(err)
	}
	os.Chmod(open, 0o777)
	if err := ensureDir(open); !errors.Is(err, ErrBadDir) {
		t.Fatalf("ensureDir(world-writable) = %v, want ErrBadDir", err)
	}
	link := filepath.Join(base, "link")
	os.Symlink(base, link)
	if err := ensureDir(link); !errors.Is(err, ErrBadDir) {
		t.Fatalf("ensureDir(symlink) = %v, want ErrBadDir", err)
	}
	if err := ensureDir(filepath.Join(base, "new", "deep")); err != nil {
		t.Fatal(err)
	}
}

func TestDefaultDir(t *testing.T) {
	t.Setenv(DirEnv, "/x/y")
	if got := DefaultDir(); got != "/x/y" {
		t.Fatalf("DefaultDir with %s = %q", DirEnv, got)
	}
	t.Setenv(DirEnv, "")
	t.Setenv("XDG_RUNTIME_DIR", "/run/user/7")
	if got := DefaultDir(); got != "/run/user/7/cudapool" {
		t.Fatalf("DefaultDir with XDG_RUNTIME_DIR = %q", got)
	}
	t.Setenv("XDG_RUNTIME_DIR", "")
	if got, want := DefaultDir(), filepath.Join(os.TempDir(), fmt.Sprint("cudapool-", os.Getuid())); got != want {
		t.Fatalf("DefaultDir = %q, want %q", got, want)
	}
}
