package producer_test

import (
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/cudapool/cudapool/export"
	"github.com/cudapool/cudapool/export/internal/exporttest"
	"github.com/cudapool/cudapool/export/producer"
)

func TestListenWithoutRuntimeIsAnError(t *testing.T) {
	path := filepath.Join(exporttest.ShortDir(t), "x.sock")
	var ex *producer.Exporter
	var err error
	require.NotPanics(t, func() { ex, err = producer.Listen(path, nil, producer.WithoutAnnounce()) })
	require.Error(t, err)
	assert.Nil(t, ex)
	assert.Contains(t, err.Error(), "runtime")
	_, statErr := os.Lstat(path)
	assert.ErrorIs(t, statErr, os.ErrNotExist, "nothing is left behind")
}

// A socket path longer than the kernel's limit cannot be connected to: Listen
// refuses it instead of creating a socket nobody can reach.
func TestListenRefusesOverlongSocketPath(t *testing.T) {
	dir := exporttest.ShortDir(t)
	long := filepath.Join(dir, strings.Repeat("d", 60), strings.Repeat("s", 60)+".sock")
	require.NoError(t, os.MkdirAll(filepath.Dir(long), 0o700))
	require.Greater(t, len(long), 108)
	_, err := producer.Listen(long, exporttest.NewSide(t, 0).Dev, producer.WithoutAnnounce())
	require.ErrorIs(t, err, producer.ErrSocketPath)
	assert.Contains(t, err.Error(), "108")
	_, statErr := os.Lstat(long)
	assert.ErrorIs(t, statErr, os.ErrNotExist)
}

// Errors name the socket path the caller gave, never the temporary name the socket
// is bound under first.
func TestListenErrorsNameTheRealPath(t *testing.T) {
	path := filepath.Join(exporttest.ShortDir(t), "missing-dir", "x.sock")
	_, err := producer.Listen(path, exporttest.NewSide(t, 0).Dev, producer.WithoutAnnounce())
	require.Error(t, err)
	assert.Contains(t, err.Error(), path)
	assert.NotContains(t, err.Error(), ".cudapool-")
}

// The socket's mode and group follow the Policy when asked: without the option it
// stays 0600 (Policy alone would admit peers that cannot connect).
func TestSocketModeFollowsPolicy(t *testing.T) {
	dev := exporttest.NewSide(t, 0).Dev
	mode := func(opts ...producer.ListenOption) os.FileMode {
		path := filepath.Join(exporttest.ShortDir(t), "x.sock")
		ex, err := producer.Listen(path, dev, append([]producer.ListenOption{producer.WithoutAnnounce()}, opts...)...)
		require.NoError(t, err)
		defer ex.Close(exporttest.Ctx(t))
		info, err := os.Lstat(path)
		require.NoError(t, err)
		return info.Mode().Perm()
	}
	wide := export.Policy{AllowUIDs: []uint32{uint32(os.Getuid()), 4242}}
	assert.Equal(t, os.FileMode(0o600), mode(producer.WithPolicy(wide)), "the Policy alone leaves the socket private")
	assert.Equal(t, os.FileMode(0o600), mode(producer.SocketFollowsPolicy()))
	assert.Equal(t, os.FileMode(0o666), mode(producer.WithPolicy(wide), producer.SocketFollowsPolicy()))
	group := export.Policy{AllowGIDs: []uint32{uint32(os.Getgid())}}
	assert.Equal(t, os.FileMode(0o660), mode(producer.WithPolicy(group), producer.SocketFollowsPolicy()))
}

// Names that would display as something else (bidi overrides, isolates) or break a
// line are refused.
func TestNamesRejectBidiAndControlCharacters(t *testing.T) {
	pr := exporttest.NewProducer(t, nil, nil)
	b, err := pr.Pool.Alloc(exporttest.Ctx(t), 1<<20, pr.Stream)
	require.NoError(t, err)
	for _, name := range []string{"kv\u202egnp.exe", "a\u2066b", "a\u200fb", "line\u2028break", "tab\tname", "nul\x00"} {
		err := pr.Ex.Publish(exporttest.Ctx(t), name, b, pr.Stream)
		assert.ErrorIs(t, err, export.ErrBadName, "%q", name)
	}
	assert.NoError(t, pr.Ex.Publish(exporttest.Ctx(t), "layer-0/κv 😀", b, pr.Stream))
}
