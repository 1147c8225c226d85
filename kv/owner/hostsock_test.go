package owner_test

import (
	"encoding/binary"
	"encoding/json"
	"fmt"
	"net"
	"os"
	"path/filepath"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"golang.org/x/sys/unix"

	"github.com/cudapool/cudapool/cudart/cudarttest"
	"github.com/cudapool/cudapool/export"
	"github.com/cudapool/cudapool/internal/testwait"
	"github.com/cudapool/cudapool/internal/unixfd"
	"github.com/cudapool/cudapool/kv"
	"github.com/cudapool/cudapool/kv/owner"
)

// askHostTier sends req on dir/host.sock and returns the answer and the descriptors
// that came with it.
func askHostTier(t *testing.T, dir string, req []byte) (kv.HostTierInfo, []int, error) {
	c, err := net.DialUnix("unix", nil, &net.UnixAddr{Name: filepath.Join(dir, kv.HostSocket), Net: "unix"})
	require.NoError(t, err)
	defer c.Close()
	require.NoError(t, c.SetDeadline(time.Now().Add(testwait.Bound)))
	_, err = c.Write(req)
	require.NoError(t, err)
	require.NoError(t, c.CloseWrite())
	buf := make([]byte, 4096)
	n, fds, err := unixfd.Recv(c, buf, 1)
	var info kv.HostTierInfo
	if err == nil {
		err = json.Unmarshal(buf[:n], &info)
	}
	return info, fds, err
}

func dev(d uint32) []byte { return binary.LittleEndian.AppendUint32(nil, d) }

// The host tier's socket follows the owner's policy: a process it refuses gets the
// reason and no memfd. (The tests run as root: this policy refuses root by listing
// another uid alone.)
func TestHostSocketFollowsThePolicy(t *testing.T) {
	g := kv.Geometry{Layers: 2, KVHeads: 2, HeadDim: 8, TokensPerPage: 4, DType: kv.DTypeFP32, Pages: 16}
	dir := filepath.Join(t.TempDir(), "kv")
	other := uint32(os.Getuid()) + 4242
	o, err := owner.Listen(dir, cudarttest.ForTest(t), g, owner.WithHostBytes(4*owner.HostPageBytes(g)),
		owner.WithPolicy(export.Policy{AllowUIDs: []uint32{other}}))
	require.NoError(t, err)
	defer func() { assert.NoError(t, o.Close(t.Context())) }()
	info, fds, err := askHostTier(t, dir, dev(0))
	for _, fd := range fds {
		unix.Close(fd)
	}
	require.NoError(t, err)
	assert.Empty(t, fds, "the memfd went to a process the policy refuses")
	assert.Contains(t, info.Error, fmt.Sprintf("uid %d gid %d is not allowed", os.Getuid(), os.Getgid()))
	assert.Zero(t, info.Bytes)
}

// The keeper's tier socket refuses another user's process: it neither hands it a
// host tier's memory nor takes one from it. (The tests run as root, which it admits:
// the peer's uid is replaced through a seam.)
func TestKeeperTierSocketRefusesAnotherUser(t *testing.T) {
	dir := filepath.Join(t.TempDir(), "kv")
	k, err := owner.Keep(dir, cudarttest.ForTest(t), small)
	require.NoError(t, err)
	defer func() { assert.NoError(t, k.Close(t.Context())) }()
	other := uint32(os.Getuid()) + 4242
	owner.SetTierPeerUID(k, other)
	c, err := net.DialUnix("unix", nil, &net.UnixAddr{Name: filepath.Join(dir, owner.TierSocket), Net: "unix"})
	require.NoError(t, err)
	defer c.Close()
	require.NoError(t, c.SetDeadline(time.Now().Add(testwait.Bound)))
	require.NoError(t, unixfd.Send(c, []byte(`{"device":0,"bytes":4096}`)))
	buf := make([]byte, 512)
	n, fds, err := unixfd.Recv(c, buf, 1)
	require.NoError(t, err)
	for _, fd := range fds {
		unix.Close(fd)
	}
	assert.Empty(t, fds)
	assert.Contains(t, string(buf[:n]), fmt.Sprintf("uid %d is not the keeper's", other), "the keeper answered another user's page server")
}

// The host tier's socket answers a device it serves with the tier's memfd, one it
// does not with a reason and no descriptor, and a connection that says nothing, or
// too little, with nothing; none of them stops it serving the next.
func TestHostSocketAnswers(t *testing.T) {
	g := kv.Geometry{Layers: 2, KVHeads: 2, HeadDim: 8, TokensPerPage: 4, DType: kv.DTypeFP32, Pages: 16}
	dir := filepath.Join(t.TempDir(), "kv")
	o, err := owner.Listen(dir, cudarttest.ForTest(t), g, owner.WithHostBytes(4*owner.HostPageBytes(g)))
	require.NoError(t, err)
	defer func() { assert.NoError(t, o.Close(t.Context())) }()
	ask := func(req []byte) (kv.HostTierInfo, []int, error) { return askHostTier(t, dir, req) }

	_, fds, err := ask([]byte{1, 2}) // too short: no answer
	assert.Error(t, err)
	assert.Empty(t, fds)
	info, fds, err := ask(dev(7))
	require.NoError(t, err)
	assert.Empty(t, fds)
	assert.Equal(t, kv.HostTierInfo{Device: 7, Error: "device 7 has no host tier here"}, info)
	info, fds, err = ask(dev(0))
	require.NoError(t, err)
	require.Len(t, fds, 1)
	defer unix.Close(fds[0])
	assert.Equal(t, kv.HostTierInfo{Device: 0, Bytes: 4 * owner.HostPageBytes(g), Pages: 4, PageBytes: owner.HostPageBytes(g)}, info)
	seals, err := unix.FcntlInt(uintptr(fds[0]), unix.F_GET_SEALS, 0)
	require.NoError(t, err)
	assert.NotZero(t, seals&unix.F_SEAL_SHRINK, "the memfd can shrink under a replica's mapping")
}
