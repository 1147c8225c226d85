package main

import (
	"encoding/binary"
	"encoding/json"
	"net"
	"path/filepath"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"golang.org/x/sys/unix"

	"github.com/cudapool/cudapool/internal/testwait"
	"github.com/cudapool/cudapool/internal/unixfd"
	"github.com/cudapool/cudapool/kv"
)

// hostTierInode is the inode of the memfd dir/host.sock hands out for device 0: the
// same inode is the same memory.
func hostTierInode(t *testing.T, dir string) uint64 {
	t.Helper()
	c, err := net.DialUnix("unix", nil, &net.UnixAddr{Name: filepath.Join(dir, kv.HostSocket), Net: "unix"})
	require.NoError(t, err)
	defer c.Close()
	require.NoError(t, c.SetDeadline(time.Now().Add(testwait.Bound)))
	_, err = c.Write(binary.LittleEndian.AppendUint32(nil, 0))
	require.NoError(t, err)
	buf := make([]byte, 4096)
	n, fds, err := unixfd.Recv(c, buf, 1)
	require.NoError(t, err)
	var info kv.HostTierInfo
	require.NoError(t, json.Unmarshal(buf[:n], &info))
	require.Empty(t, info.Error)
	require.Len(t, fds, 1)
	defer unix.Close(fds[0])
	var st unix.Stat_t
	require.NoError(t, unix.Fstat(fds[0], &st))
	return st.Ino
}

// The keeper holds the host tier's memfd: kvpoold SIGKILLed and started again serves
// the same memory, and says so in its first line; with another -host-bytes it makes
// a new tier, and says why the old one is dropped.
func TestRestartKeepsTheHostTiersMemory(t *testing.T) {
	dir := shortDir(t)
	args := append(restartArgs(dir, 16), "-host-bytes", "8MiB")
	first, line := daemon(t, args...)
	assert.Contains(t, line, "new cache in keeper pid")
	assert.NotContains(t, line, "host tier memory")
	ino := hostTierInode(t, dir)

	sigkill(t, first)
	second, line := daemon(t, args...)
	assert.Contains(t, line, "cache adopted from keeper pid")
	assert.Contains(t, line, "host tier memory of 1 devices kept (0 host pages restored)")
	assert.Equal(t, ino, hostTierInode(t, dir), "the restarted kvpoold serves the keeper's memfd")

	sigkill(t, second)
	_, line = daemon(t, append(restartArgs(dir, 16), "-host-bytes", "16MiB")...)
	assert.Contains(t, line, "cache adopted from keeper pid")
	assert.NotContains(t, line, "host tier memory of")
	assert.Contains(t, line, "device 0's host tier was of ")
	assert.Contains(t, line, "its pages are dropped")
	assert.NotEqual(t, ino, hostTierInode(t, dir), "another size is another memfd")
}
