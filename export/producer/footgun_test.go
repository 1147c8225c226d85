package producer

import (
	"context"
	"os"
	"path/filepath"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/cudapool/cudapool/cudart"
	"github.com/cudapool/cudapool/export/consumer"
	"github.com/cudapool/cudapool/export/internal/wire"
)

func TestListenWithoutRuntimeIsAnError(t *testing.T) {
	path := filepath.Join(shortDir(t), "x.sock")
	var ex *Exporter
	var err error
	require.NotPanics(t, func() { ex, err = Listen(path, nil, WithoutAnnounce()) })
	require.Error(t, err)
	assert.Nil(t, ex)
	assert.Contains(t, err.Error(), "runtime")
	_, statErr := os.Lstat(path)
	assert.ErrorIs(t, statErr, os.ErrNotExist, "nothing is left behind")
}

// A socket path longer than the kernel's limit cannot be connected to: Listen
// refuses it instead of creating a socket nobody can reach.
func TestListenRefusesOverlongSocketPath(t *testing.T) {
	dir := shortDir(t)
	long := filepath.Join(dir, strings.Repeat("d", 60), strings.Repeat("s", 60)+".sock")
	require.NoError(t, os.MkdirAll(filepath.Dir(long), 0o700))
	require.Greater(t, len(long), 108)
	_, err := Listen(long, newSide(t, 0).dev, WithoutAnnounce())
	require.ErrorIs(t, err, ErrSocketPath)
	assert.Contains(t, err.Error(), "108")
	_, statErr := os.Lstat(long)
	assert.ErrorIs(t, statErr, os.ErrNotExist)
}

// Errors name the socket path the caller gave, never the temporary name the socket
// is bound under first.
func TestListenErrorsNameTheRealPath(t *testing.T) {
	path := filepath.Join(shortDir(t), "missing-dir", "x.sock")
	_, err := Listen(path, newSide(t, 0).dev, WithoutAnnounce())
	require.Error(t, err)
	assert.Contains(t, err.Error(), path)
	assert.NotContains(t, err.Error(), ".cudapool-")
}

// Dialing a path that is a regular file says so, not that the exporter is gone.
func TestDialRegularFileSaysItIsNotASocket(t *testing.T) {
	path := filepath.Join(shortDir(t), "plain")
	require.NoError(t, os.WriteFile(path, []byte("not a socket"), 0o600))
	s := newSide(t, 0)
	_, err := consumer.Dial(testCtx(t), path, s.dev, 0)
	require.ErrorIs(t, err, ErrNotSocket)
	assert.NotErrorIs(t, err, wire.ErrExporterGone)
	assert.Contains(t, err.Error(), path)
}

// The socket's mode and group follow the Policy when asked: without the option it
// stays 0600 (Policy alone would admit peers that cannot connect).
func TestSocketModeFollowsPolicy(t *testing.T) {
	dev := newSide(t, 0).dev
	mode := func(opts ...ListenOption) os.FileMode {
		path := filepath.Join(shortDir(t), "x.sock")
		ex, err := Listen(path, dev, append([]ListenOption{WithoutAnnounce()}, opts...)...)
		require.NoError(t, err)
		defer ex.Close(testCtx(t))
		info, err := os.Lstat(path)
		require.NoError(t, err)
		return info.Mode().Perm()
	}
	wide := Policy{AllowUIDs: []uint32{uint32(os.Getuid()), 4242}}
	assert.Equal(t, os.FileMode(0o600), mode(WithPolicy(wide)), "the Policy alone leaves the socket private")
	assert.Equal(t, os.FileMode(0o600), mode(SocketFollowsPolicy()))
	assert.Equal(t, os.FileMode(0o666), mode(WithPolicy(wide), SocketFollowsPolicy()))
	group := Policy{AllowGIDs: []uint32{uint32(os.Getgid())}}
	assert.Equal(t, os.FileMode(0o660), mode(WithPolicy(group), SocketFollowsPolicy()))
}

// After Free a name is retired at once: a new buffer can be published under it
// without an Open having noticed the free first.
func TestFreeRetiresTheNameAtOnce(t *testing.T) {
	pr := newProducer(t, nil, nil)
	b := pr.publish(t, "a", 1<<20, 1)
	require.NoError(t, b.Free(pr.stream))
	pr.publish(t, "a", 1<<20, 2)
	c := newConsumer(t, pr.path, 0)
	m, err := c.imp.Open(testCtx(t), "a", c.stream)
	require.NoError(t, err)
	assert.True(t, allAre(c.read(t, m), 2))
	require.NoError(t, m.Release(testCtx(t), c.stream))
}

// Names that would display as something else (bidi overrides, isolates) or break a
// line are refused.
func TestNamesRejectBidiAndControlCharacters(t *testing.T) {
	pr := newProducer(t, nil, nil)
	b, err := pr.pool.Alloc(testCtx(t), 1<<20, pr.stream)
	require.NoError(t, err)
	for _, name := range []string{"kv\u202egnp.exe", "a\u2066b", "a\u200fb", "line\u2028break", "tab\tname", "nul\x00"} {
		err := pr.ex.Publish(testCtx(t), name, b, pr.stream)
		assert.ErrorIs(t, err, ErrBadName, "%q", name)
	}
	assert.NoError(t, pr.ex.Publish(testCtx(t), "layer-0/κv 😀", b, pr.stream))
}

// failFreeOnce fails the next FreeAsync of an imported pointer.
type failFreeOnce struct {
	cudart.Runtime
	armed atomic.Bool
}

func (f *failFreeOnce) FreeAsync(dev int, p cudart.DevicePtr, s cudart.Stream) error {
	if f.armed.CompareAndSwap(true, false) {
		return cudart.NewError("cudaFreeAsync", cudart.ErrUnknown)
	}
	return f.Runtime.FreeAsync(dev, p, s)
}

// A final Release whose free fails leaves the Mapping as it was: still mapped, its
// lease held, and a retry works (it used to say "already released" and keep the lease
// for good).
func TestFailedReleaseCanBeRetried(t *testing.T) {
	pr := newProducer(t, nil, nil)
	pr.publish(t, "a", 1<<20, 5)
	s := newSide(t, 0)
	rt := &failFreeOnce{Runtime: s.dev}
	ctx := testCtx(t)
	imp, err := consumer.Dial(ctx, pr.path, rt, 0, consumer.WithLogger(discardLogger))
	require.NoError(t, err)
	defer imp.Close(context.Background())
	m, err := imp.Open(ctx, "a", s.stream)
	require.NoError(t, err)
	rt.armed.Store(true)
	err = m.Release(ctx, s.stream)
	require.Error(t, err)
	assert.NotErrorIs(t, err, consumer.ErrReleased)
	assert.Equal(t, 1, pr.ex.Peers()[0].Leases, "the lease is held while the import is mapped")
	require.NoError(t, m.Release(ctx, s.stream), "the retry frees and releases")
	require.Eventually(t, func() bool { return pr.activeLeases(t) == 0 }, hangGuard, time.Millisecond)
	assert.ErrorIs(t, m.Release(ctx, s.stream), consumer.ErrReleased)
	s.checkClean(t)
}
