package keep_test

import (
	"context"
	"fmt"
	"net"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"golang.org/x/sys/unix"

	"github.com/cudapool/cudapool/internal/session"
	"github.com/cudapool/cudapool/internal/testlog"
	"github.com/cudapool/cudapool/internal/testwait"
	"github.com/cudapool/cudapool/kv/internal/keep"
	"github.com/cudapool/cudapool/kv/internal/kvwire"
)

// keeper is a Server on a socket of its own, closed with the test.
type keeper struct {
	path string
	s    *keep.Server
	srv  *session.Server
	log  *testlog.Buffer
}

func serve(t *testing.T) *keeper {
	t.Helper()
	path := filepath.Join(t.TempDir(), keep.Socket)
	ln, err := net.ListenUnix("unix", &net.UnixAddr{Name: path, Net: "unix"})
	require.NoError(t, err)
	k := &keeper{path: path, log: &testlog.Buffer{}}
	k.s = keep.NewServer(k.log.Logger())
	k.srv = session.Serve(ln, k.log.Logger(), "keep test", session.Limits{}, k.s.Serve)
	t.Cleanup(k.stop)
	return k
}

// stop closes the socket, then the descriptors kept; a second stop does nothing.
func (k *keeper) stop() {
	k.srv.Close()
	k.s.Close()
}

func bound(t *testing.T) context.Context {
	ctx, cancel := context.WithTimeout(context.Background(), testwait.Bound)
	t.Cleanup(cancel)
	return ctx
}

func dial(t *testing.T, k *keeper) *keep.Client {
	t.Helper()
	c, err := keep.Dial(bound(t), k.path, keep.RoleServer)
	require.NoError(t, err)
	t.Cleanup(func() { assert.NoError(t, c.Close()) })
	return c
}

// memfd makes a memfd of size bytes holding text at its start.
func memfd(t *testing.T, size int, text string) int {
	t.Helper()
	fd, err := unix.MemfdCreate("keep-test", unix.MFD_CLOEXEC)
	require.NoError(t, err)
	require.NoError(t, unix.Ftruncate(fd, int64(size)))
	_, err = unix.Pwrite(fd, []byte(text), 0)
	require.NoError(t, err)
	return fd
}

// contents reads the first n bytes of fd, and closes it.
func contents(t *testing.T, fd, n int) string {
	t.Helper()
	defer unix.Close(fd)
	b := make([]byte, n)
	_, err := unix.Pread(fd, b, 0)
	require.NoError(t, err)
	return string(b)
}

// inode names the file behind fd.
func inode(t *testing.T, fd int) uint64 {
	var st unix.Stat_t
	require.NoError(t, unix.Fstat(fd, &st))
	return st.Ino
}

// openMemfds counts this process's open descriptors of the test's memfds.
func openMemfds(t *testing.T) int {
	es, err := os.ReadDir("/proc/self/fd")
	require.NoError(t, err)
	n := 0
	for _, e := range es {
		if l, err := os.Readlink(filepath.Join("/proc/self/fd", e.Name())); err == nil && strings.Contains(l, "memfd:keep-test") {
			n++
		}
	}
	return n
}

// Put keeps a descriptor under a name; Take gives a duplicate of it (the same file)
// and its size, as often as asked; List names what is kept; Drop lets it go, after
// which Take and Drop say nothing is kept.
func TestPutTakeListDrop(t *testing.T) {
	k := serve(t)
	c := dial(t, k)
	ctx := bound(t)
	assert.Equal(t, os.Getpid(), c.KeeperPID(), "Welcome names the keeper")

	a, b := memfd(t, 4096, "alpha"), memfd(t, 8192, "beta")
	ina := inode(t, a)
	require.NoError(t, c.Put(ctx, "kv/host/0", a, 4096))
	require.NoError(t, c.Put(ctx, "kv/chunk/0/0", b, 8192))
	unix.Close(a) // the keeper holds its own
	unix.Close(b)

	for range 2 {
		fd, size, err := c.Take(ctx, "kv/host/0")
		require.NoError(t, err)
		assert.Equal(t, uint64(4096), size)
		assert.Equal(t, ina, inode(t, fd), "Take gives the file Put gave")
		assert.Equal(t, "alpha", contents(t, fd, 5))
	}
	es, err := c.List(ctx, "")
	require.NoError(t, err)
	assert.Equal(t, []keep.Entry{{Name: "kv/chunk/0/0", Size: 8192}, {Name: "kv/host/0", Size: 4096}}, es)
	es, err = c.List(ctx, "kv/host/")
	require.NoError(t, err)
	assert.Equal(t, []keep.Entry{{Name: "kv/host/0", Size: 4096}}, es)

	require.NoError(t, c.Drop(ctx, "kv/host/0"))
	_, _, err = c.Take(ctx, "kv/host/0")
	assert.ErrorIs(t, err, keep.ErrNotKept)
	assert.ErrorIs(t, c.Drop(ctx, "kv/host/0"), keep.ErrNotKept)
	assert.Equal(t, []keep.Entry{{Name: "kv/chunk/0/0", Size: 8192}}, k.s.Kept())
}

// A Put under a name kept already replaces the descriptor, and the keeper closes the
// old one; the keeper's descriptors are closed when it stops, not before.
func TestPutReplacesAndStopCloses(t *testing.T) {
	k := serve(t)
	c := dial(t, k)
	ctx := bound(t)
	before := openMemfds(t)
	a := memfd(t, 4096, "old")
	require.NoError(t, c.Put(ctx, "kv/host/0", a, 4096))
	unix.Close(a)
	assert.Equal(t, before+1, openMemfds(t), "the keeper holds one descriptor")
	b := memfd(t, 8192, "new")
	require.NoError(t, c.Put(ctx, "kv/host/0", b, 8192))
	unix.Close(b)
	assert.Equal(t, before+1, openMemfds(t), "the replaced descriptor is closed")
	fd, size, err := c.Take(ctx, "kv/host/0")
	require.NoError(t, err)
	assert.Equal(t, uint64(8192), size)
	assert.Equal(t, "new", contents(t, fd, 3))

	done := c.Done()
	k.stop()
	testwait.Recv(t, done, "the client's Done once the keeper stopped")
	assert.ErrorIs(t, c.Err(), keep.ErrGone)
	assert.Equal(t, before, openMemfds(t), "the stopped keeper closed what it kept")
	_, _, err = c.Take(ctx, "kv/host/0")
	assert.ErrorIs(t, err, keep.ErrGone)
}

// A List longer than one frame comes in several, whole and in order.
func TestListSpansFrames(t *testing.T) {
	k := serve(t)
	c := dial(t, k)
	ctx := bound(t)
	fd := memfd(t, 4096, "")
	defer unix.Close(fd)
	var want []keep.Entry
	for i := range keep.MaxKept {
		name := fmt.Sprintf("%s/%05d", strings.Repeat("n", keep.MaxName-6), i)
		want = append(want, keep.Entry{Name: name, Size: uint64(i)})
		require.NoError(t, c.Put(ctx, name, fd, uint64(i)))
	}
	require.Greater(t, keep.MaxKept*(2+keep.MaxName+8), kvwire.MaxFrame, "the list needs more than one frame")
	got, err := c.List(ctx, "")
	require.NoError(t, err)
	assert.Equal(t, want, got)
	err = c.Put(ctx, "one/more", fd, 1)
	assert.ErrorIs(t, err, keep.ErrLimit, "a name past MaxKept")
	require.NoError(t, c.Put(ctx, want[0].Name, fd, 7), "a name kept already is replaced, past the cap or not")
}

// Bad names are refused on both sides, and the connection serves on.
func TestBadNames(t *testing.T) {
	k := serve(t)
	c := dial(t, k)
	ctx := bound(t)
	fd := memfd(t, 4096, "")
	defer unix.Close(fd)
	for _, name := range []string{"", "a\x1b[2Jb", "kv\u202egnp", strings.Repeat("x", keep.MaxName+1)} {
		assert.ErrorIs(t, c.Put(ctx, name, fd, 1), keep.ErrName, "%q", name)
		_, _, err := c.Take(ctx, name)
		assert.ErrorIs(t, err, keep.ErrName, "%q", name)
	}
	assert.Empty(t, k.s.Kept())
}

// The keeper answers only its own user: another uid is refused, naming both, and
// nothing is handed to it.
func TestAnotherUserIsRefused(t *testing.T) {
	k := serve(t)
	other := uint32(os.Getuid()) + 4242
	keep.SetUIDOf(k.s, func(uint32) uint32 { return other })
	_, err := keep.Dial(bound(t), k.path, keep.RoleServer)
	require.ErrorIs(t, err, keep.ErrRefused)
	assert.ErrorContains(t, err, fmt.Sprintf("uid %d is not the keeper's (%d)", other, os.Getuid()))
	assert.Zero(t, k.s.Clients())
}
