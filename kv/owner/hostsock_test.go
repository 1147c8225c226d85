package owner_test

import (
	"encoding/binary"
	"fmt"
	"io"
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
	"github.com/cudapool/cudapool/internal/testlog"
	"github.com/cudapool/cudapool/internal/testwait"
	"github.com/cudapool/cudapool/internal/unixfd"
	"github.com/cudapool/cudapool/kv"
	keepwire "github.com/cudapool/cudapool/kv/internal/keep"
	"github.com/cudapool/cudapool/kv/owner"
)

// askRaw sends req on dir/host.sock and returns the first frame of the answer and the
// descriptors that came with it (an error where the owner closed without one).
func askRaw(t *testing.T, dir string, req []byte) (keepwire.Header, any, []int, error) {
	c, err := net.DialUnix("unix", nil, &net.UnixAddr{Name: filepath.Join(dir, kv.HostSocket), Net: "unix"})
	require.NoError(t, err)
	defer c.Close()
	require.NoError(t, c.SetDeadline(time.Now().Add(testwait.Bound)))
	_, err = c.Write(req)
	require.NoError(t, err)
	require.NoError(t, c.CloseWrite())
	buf := make([]byte, 4096)
	n, fds, err := unixfd.Recv(c, buf, 1)
	if err != nil {
		return keepwire.Header{}, nil, fds, err
	}
	if n == 0 {
		return keepwire.Header{}, nil, fds, io.EOF
	}
	h, m, _, err := keepwire.DecodeFrame(buf[:n])
	return h, m, fds, err
}

// hello is a HostHello frame of version v for device d.
func hello(t *testing.T, v, d uint32) []byte {
	b, err := keepwire.Append(nil, keepwire.TypeHostHello, 5, keepwire.HostHello{Version: v, PID: 1, Device: d})
	require.NoError(t, err)
	return b
}

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
	_, fd, err := keepwire.AskHostTier(bound(t), filepath.Join(dir, kv.HostSocket), 0)
	assert.Equal(t, -1, fd, "the memfd went to a process the policy refuses")
	require.ErrorIs(t, err, keepwire.ErrRefused)
	assert.ErrorContains(t, err, fmt.Sprintf("uid %d gid %d is not allowed", os.Getuid(), os.Getgid()))
}

// The host tier's socket answers a device it serves with the tier's memfd, one it does
// not with a reason and no descriptor, another version with a refusal naming both, and
// a connection that says too little, or speaks the unframed version 1, with nothing;
// none of them stops it serving the next.
func TestHostSocketAnswers(t *testing.T) {
	g := kv.Geometry{Layers: 2, KVHeads: 2, HeadDim: 8, TokensPerPage: 4, DType: kv.DTypeFP32, Pages: 16}
	dir := filepath.Join(t.TempDir(), "kv")
	var log testlog.Buffer
	o, err := owner.Listen(dir, cudarttest.ForTest(t), g, owner.WithHostBytes(4*owner.HostPageBytes(g)), owner.WithLogger(log.Logger()))
	require.NoError(t, err)
	defer func() { assert.NoError(t, o.Close(t.Context())) }()

	_, _, fds, err := askRaw(t, dir, []byte{1, 2}) // too short: no answer
	assert.Error(t, err)
	assert.Empty(t, fds)
	_, _, fds, err = askRaw(t, dir, binary.LittleEndian.AppendUint32(nil, 0)) // version 1: no answer
	assert.Error(t, err)
	assert.Empty(t, fds)
	assert.Contains(t, log.String(), "a replica of the unframed version 1 sends 4 bytes")

	h, m, fds, err := askRaw(t, dir, hello(t, 1, 0))
	require.NoError(t, err)
	assert.Empty(t, fds)
	assert.Equal(t, keepwire.TypeHostRefused, h.Type)
	assert.Equal(t, keepwire.Problem{Code: keepwire.CodeRefused, Text: "host tier socket version 1; this owner speaks 2"}, m)

	_, fd, err := keepwire.AskHostTier(bound(t), filepath.Join(dir, kv.HostSocket), 7)
	assert.Equal(t, -1, fd)
	require.ErrorIs(t, err, keepwire.ErrNoTier)
	assert.ErrorContains(t, err, "device 7 has no host tier here")

	info, fd, err := keepwire.AskHostTier(bound(t), filepath.Join(dir, kv.HostSocket), 0)
	require.NoError(t, err)
	defer unix.Close(fd)
	assert.Equal(t, keepwire.HostTier{Device: 0, Bytes: 4 * owner.HostPageBytes(g), Pages: 4, PageBytes: owner.HostPageBytes(g)}, info)
	seals, err := unix.FcntlInt(uintptr(fd), unix.F_GET_SEALS, 0)
	require.NoError(t, err)
	assert.NotZero(t, seals&unix.F_SEAL_SHRINK, "the memfd can shrink under a replica's mapping")
}
