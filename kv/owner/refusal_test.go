package owner_test

import (
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/cudapool/cudapool/cudart/cudarttest"
	"github.com/cudapool/cudapool/kv"
	"github.com/cudapool/cudapool/kv/internal/kvwire"
	"github.com/cudapool/cudapool/kv/owner"
)

// alloc leases n pages on r and returns the lease's id.
func (r *raw) alloc(id uint32, n uint32) uint64 {
	r.send(kvwire.AppendU32(nil, kvwire.TypeAlloc, id, n))
	h, p, err := r.next()
	require.NoError(r.t, err)
	require.Equal(r.t, kvwire.TypeLeased, h.Type, "%v", kvwire.ParseError(h.Type, p))
	return kvwire.NewParser(h.Type, p).U64()
}

// refused expects the answer to request id to be an Error wrapping want.
func (r *raw) refused(id uint32, want error, what string) error {
	h, p, err := r.next()
	require.NoError(r.t, err, what)
	require.Equal(r.t, kvwire.TypeError, h.Type, what)
	assert.Equal(r.t, id, h.ID, what)
	err = kvwire.ParseError(h.Type, p)
	assert.ErrorIs(r.t, err, want, what)
	return err
}

// The owner itself refuses what the Go replica never sends: a seal with more hashes
// than pages, a release that names one lease twice (and then ends none), a Match
// that repeats a hash. The connection goes on after each.
func TestOwnerRefusesWhatTheReplicaNeverSends(t *testing.T) {
	_, dir := listen(t, small)
	r := dialRaw(t, dir)
	r.hello()

	l := r.alloc(2, 1)
	r.send(kvwire.AppendSeal(nil, 3, false, l, kvwire.Now, []kv.Hash{{1}, {2}}))
	r.refused(3, kv.ErrGeometry, "a seal of 2 hashes for a lease of 1 page")

	r.send(kvwire.AppendRelease(nil, 4, kvwire.Now, []uint64{l, l}))
	err := r.refused(4, kv.ErrStaleLease, "a release naming one lease twice")
	assert.ErrorContains(t, err, "twice")
	r.send(kvwire.AppendRelease(nil, 5, kvwire.Now, []uint64{l}))
	h, _, err := r.next()
	require.NoError(t, err)
	assert.Equal(t, kvwire.TypeReleased, h.Type, "the refused release ended nothing")

	r.send(kvwire.AppendMatch(nil, 6, []kv.Hash{{1}, {2}, {1}}))
	err = r.refused(6, kv.ErrGeometry, "a match that repeats a hash")
	assert.ErrorContains(t, err, "repeat")
}

// N14: unknown flag bits on Alloc, Seal (or any request) make the frame malformed:
// the connection is closed.
func TestUnknownFlagsAreRefused(t *testing.T) {
	_, dir := listen(t, small)
	for _, c := range []struct {
		name  string
		frame func(l uint64) ([]byte, error)
	}{
		{"Alloc", func(uint64) ([]byte, error) { return kvwire.AppendU32(nil, kvwire.TypeAlloc, 3, 1) }},
		{"Seal", func(l uint64) ([]byte, error) { return kvwire.AppendSeal(nil, 3, true, l, kvwire.Now, nil) }},
		{"Match", func(uint64) ([]byte, error) { return kvwire.AppendMatch(nil, 3, []kv.Hash{{1}}) }},
	} {
		t.Run(c.name, func(t *testing.T) {
			r := dialRaw(t, dir)
			r.hello()
			l := r.alloc(2, 1)
			b, err := c.frame(l)
			require.NoError(t, err)
			b[5] |= 0x80
			r.send(b, nil)
			r.closed(c.name + " with an unknown flag")
		})
	}
}

// N14: the namespace is checked as names are: printable, at most
// kvwire.MaxNamespace bytes.
func TestNamespaceIsChecked(t *testing.T) {
	_, dir := listen(t, small)
	for _, ns := range []string{"a\nb", "kv\u202egnp", strings.Repeat("n", kvwire.MaxNamespace+1), "\xff"} {
		r := dialRaw(t, dir)
		r.send(kvwire.AppendHello(nil, 1, kvwire.Hello{Version: kvwire.Version, Namespace: ns}))
		h, p, err := r.next()
		require.NoError(t, err)
		require.Equal(t, kvwire.TypeRefused, h.Type, "namespace %q", ns)
		assert.ErrorIs(t, kvwire.ParseError(h.Type, p), kv.ErrRefused)
		assert.ErrorContains(t, kvwire.ParseError(h.Type, p), "namespace")
	}
	for _, ns := range []string{"", "llama/prod-2", strings.Repeat("n", kvwire.MaxNamespace)} {
		r := dialRaw(t, dir)
		r.send(kvwire.AppendHello(nil, 1, kvwire.Hello{Version: kvwire.Version, Namespace: ns}))
		h, _, err := r.next()
		require.NoError(t, err)
		assert.Equal(t, kvwire.TypeWelcome, h.Type, "namespace %q", ns)
	}
}

// N14: a Listen that fails removes the directory it created (and only that).
func TestFailedListenRemovesTheDirectoryItMade(t *testing.T) {
	parent := t.TempDir()
	dir := filepath.Join(parent, strings.Repeat("d", 120)) // too long for the socket's address
	dev := cudarttest.ForTest(t)
	_, err := owner.Listen(dir, dev, small)
	require.Error(t, err)
	_, err = os.Lstat(dir)
	assert.ErrorIs(t, err, os.ErrNotExist, "the directory Listen made is left behind")

	require.NoError(t, os.Mkdir(dir, 0o700))
	_, err = owner.Listen(dir, dev, small)
	require.Error(t, err)
	_, err = os.Lstat(dir)
	assert.NoError(t, err, "a directory that was there before stays")
}
