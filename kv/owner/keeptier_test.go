package owner_test

import (
	"os"
	"path/filepath"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"golang.org/x/sys/unix"

	"github.com/cudapool/cudapool/cudart/cudarttest"
	"github.com/cudapool/cudapool/internal/testlog"
	"github.com/cudapool/cudapool/internal/testwait"
	"github.com/cudapool/cudapool/kv"
	keepwire "github.com/cudapool/cudapool/kv/internal/keep"
	"github.com/cudapool/cudapool/kv/owner"
)

// keptTier is what the keeper of dir keeps under device 0's host tier's name: its
// size and inode.
func keptTier(t *testing.T, dir string) (uint64, uint64) {
	t.Helper()
	c, err := keepwire.Dial(bound(t), filepath.Join(dir, owner.KeepSocket), keepwire.RoleServer)
	require.NoError(t, err)
	defer c.Close()
	fd, size, err := c.Take(bound(t), "kv/host/0")
	require.NoError(t, err)
	defer unix.Close(fd)
	var st unix.Stat_t
	require.NoError(t, unix.Fstat(fd, &st))
	return size, st.Ino
}

// The keeper holds the host tier's memfd on keep.sock: a restarted page server takes
// it back (the same memory); one of another host size replaces it and says why.
func TestKeeperHoldsTheHostTier(t *testing.T) {
	pb := owner.HostPageBytes(small)
	k := keep(t, owner.WithHostBytes(8*pb))
	size, ino := keptTier(t, k.dir)
	assert.Equal(t, 8*pb, size)
	assert.Zero(t, k.o.Recovery().HostTiersKept)

	rec := k.restart()
	assert.Equal(t, 1, rec.HostTiersKept, "%v", rec)
	size2, ino2 := keptTier(t, k.dir)
	assert.Equal(t, [2]uint64{size, ino}, [2]uint64{size2, ino2}, "the restarted page server took back the kept memfd")

	k.opts = append(k.opts, owner.WithHostBytes(16*pb))
	rec = k.restart()
	assert.Zero(t, rec.HostTiersKept)
	assert.Contains(t, rec.Dropped, "device 0's host tier was of 8192 bytes, now 16384: its pages are dropped")
	size3, ino3 := keptTier(t, k.dir)
	assert.Equal(t, 16*pb, size3)
	assert.NotEqual(t, ino, ino3, "another size is another memfd")
}

// A page server whose keeper stops (or dies) sees KeeperGone and says that the
// host tiers' memory went with it.
func TestPageServerSeesTheKeeperGo(t *testing.T) {
	dir, err := os.MkdirTemp("", "kvr")
	require.NoError(t, err)
	t.Cleanup(func() { os.RemoveAll(dir) })
	kp, err := owner.Keep(dir, cudarttest.ForTest(t), small)
	require.NoError(t, err)
	var log testlog.Buffer
	o, err := owner.Listen(dir, cudarttest.ForTest(t), small, owner.WithKeeper(nil),
		owner.WithHostBytes(4*owner.HostPageBytes(small)), owner.WithLogger(log.Logger()))
	require.NoError(t, err)
	assert.Equal(t, 1, kp.Clients(), "the page server holds a connection to the keeper")
	select {
	case <-o.KeeperGone():
		t.Fatal("KeeperGone before the keeper went")
	default:
	}
	closed := make(chan error, 1)
	go func() { closed <- kp.Close(bound(t)) }() // its descriptors go first; then it waits for the page server to unmap the slabs
	testwait.Recv(t, o.KeeperGone(), "KeeperGone once the keeper stopped")
	assert.Contains(t, log.String(), "the keeper is gone, and with it the chunks and the host tiers' memory it kept")
	require.NoError(t, o.Close(bound(t)))
	require.NoError(t, testwait.Recv(t, closed, "the keeper's close"))
}

// KeepFiles holds descriptors with no runtime at all, and one keeper alone serves a
// directory.
func TestKeepFilesNeedsNoRuntime(t *testing.T) {
	dir := filepath.Join(t.TempDir(), "kv")
	k, err := owner.KeepFiles(dir)
	require.NoError(t, err)
	_, err = owner.KeepFiles(dir)
	assert.ErrorContains(t, err, "a keeper already serves")
	c, err := keepwire.Dial(bound(t), filepath.Join(dir, owner.KeepSocket), keepwire.RoleServer)
	require.NoError(t, err)
	fd, err := unix.MemfdCreate("t", unix.MFD_CLOEXEC)
	require.NoError(t, err)
	defer unix.Close(fd)
	require.NoError(t, c.Put(bound(t), "kv/chunk/0/0", fd, 2<<20))
	assert.Equal(t, 1, k.Clients())
	require.NoError(t, k.Close(bound(t)))
	testwait.Recv(t, c.Done(), "the client's Done once the keeper stopped")
	assert.ErrorIs(t, k.Close(bound(t)), kv.ErrClosed)
}
