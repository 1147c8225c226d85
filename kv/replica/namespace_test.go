package replica_test

import (
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/cudapool/cudapool/kv"
	"github.com/cudapool/cudapool/kv/replica"
)

// A replica's namespace seeds its prefix hashes: replicas of one namespace match each
// other's pages, byte for byte, and a replica of another namespace, hashing the same
// tokens, finds none of them (the namespace is no boundary of trust, only of naming:
// package kv's Trust).
func TestNamespacesNameTheirOwnPages(t *testing.T) {
	_, _, dir := startOwner(t, small)
	a, adev, as := dial(t, dir, 0, replica.WithNamespace("model-a"))
	a2, a2dev, a2s := dial(t, dir, 0, replica.WithNamespace("model-a"))
	b, _, _ := dial(t, dir, 0, replica.WithNamespace("model-b"))
	plain, _, _ := dial(t, dir, 0)
	ctx := bound(t)

	toks := tokens(small, 4, 21)
	hashes := sealed(t, adev, a, as, 21, 4)
	require.Equal(t, kv.PrefixHashes("model-a", toks, small.TokensPerPage), hashes, "Hashes is the namespace's PrefixHashes")
	assert.Equal(t, hashes, a2.Hashes(toks), "one namespace, one set of hashes")
	assert.NotEqual(t, hashes[0], b.Hashes(toks)[0], "another namespace hashes the same tokens apart")
	assert.NotEqual(t, hashes[0], plain.Hashes(toks)[0], "and so does the default one")

	m, err := a2.Match(ctx, a2.Hashes(toks))
	require.NoError(t, err)
	require.Len(t, m.Pages(), 4, "a replica of the same namespace matches the pages")
	require.NoError(t, check(a2dev, a2, a2s, m.Pages(), hashes), "and reads what was written")
	require.NoError(t, a2.Release(ctx, m, a2s))
	for _, r := range []*replica.Replica{b, plain} {
		m, err := r.Match(ctx, r.Hashes(toks))
		require.NoError(t, err)
		assert.Empty(t, m.Pages(), "a replica of another namespace matches none of the same tokens' pages")
	}
}
