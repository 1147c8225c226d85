package kv_test

import (
	"encoding/json"
	"errors"
	"os"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/cudapool/cudapool/kv"
)

// TestPrefixHashesFixed pins two vectors in the code itself, so that a change to the
// hash cannot pass by regenerating testdata.
func TestPrefixHashesFixed(t *testing.T) {
	assert.Equal(t, "33fbf7215ae8bdbba6ff4b8fdd79c194", kv.Root("").String())
	got := kv.PrefixHashes("", []int32{1, 2, 3, 4, 5, 6, 7, 8, 9}, 4)
	require.Len(t, got, 2, "9 tokens in pages of 4: two full pages, the ninth token has no hash")
	assert.Equal(t, "35b8a3bdb29162483d14958d09c9b648", got[0].String())
	assert.Equal(t, "42de7ecc30277d5cb6586e5fb32b4cd5", got[1].String())
	got = kv.PrefixHashes("llama", []int32{1, 2, 3, 4, 5, 6, 7, 8}, 4)
	require.Len(t, got, 2)
	assert.Equal(t, "2c9c15a3101940859a7ed1fbb0d79a9f", got[0].String())
	assert.Equal(t, "343f7461d259a2511a69e4a8645f3fdd", got[1].String())
}

// TestPrefixHashesVectors checks testdata/hashes.json, which Python's pure-hashlib
// reference reads too.
func TestPrefixHashesVectors(t *testing.T) {
	raw, err := os.ReadFile("testdata/hashes.json")
	require.NoError(t, err)
	var v struct {
		Roots []struct{ Namespace, Root string }
		Cases []struct {
			Namespace     string
			TokensPerPage int `json:"tokens_per_page"`
			Tokens        []int32
			Hashes        []string
		}
	}
	require.NoError(t, json.Unmarshal(raw, &v))
	require.NotEmpty(t, v.Roots)
	require.NotEmpty(t, v.Cases)
	for _, r := range v.Roots {
		assert.Equal(t, r.Root, kv.Root(r.Namespace).String(), "root of %q", r.Namespace)
	}
	for i, c := range v.Cases {
		got := kv.PrefixHashes(c.Namespace, c.Tokens, c.TokensPerPage)
		s := make([]string, len(got))
		for j, h := range got {
			s[j] = h.String()
		}
		if len(c.Hashes) == 0 {
			c.Hashes = []string{}
		}
		assert.Equal(t, c.Hashes, s, "case %d", i)
	}
}

func TestPrefixHashesIsAPrefixFunction(t *testing.T) {
	toks := make([]int32, 64)
	for i := range toks {
		toks[i] = int32(i * 7)
	}
	all := kv.PrefixHashes("x", toks, 8)
	require.Len(t, all, 8)
	assert.Equal(t, all[:3], kv.PrefixHashes("x", toks[:24], 8), "the hashes of a prefix are a prefix of the hashes")
	assert.NotEqual(t, all[0], kv.PrefixHashes("y", toks, 8)[0], "namespaces separate hashes")
	toks[9]++
	changed := kv.PrefixHashes("x", toks, 8)
	assert.Equal(t, all[0], changed[0], "a change in page 1 leaves page 0's hash")
	for i := 1; i < 8; i++ {
		assert.NotEqual(t, all[i], changed[i], "a change in page 1 changes every later hash (page %d)", i)
	}
	assert.Nil(t, kv.PrefixHashes("x", toks, 0))
	assert.Empty(t, kv.PrefixHashes("x", toks[:7], 8))
	assert.Equal(t, append([]kv.Hash{{1}}, all[0]), kv.AppendPrefixHashes([]kv.Hash{{1}}, "x", toks[:8], 8), "Append appends")
}

func TestGeometry(t *testing.T) {
	g, err := kv.Layout("llama-0.85b")
	require.NoError(t, err)
	assert.Equal(t, kv.Geometry{Layers: 16, KVHeads: 8, HeadDim: 64, TokensPerPage: 16, DType: kv.DTypeBF16}, g)
	require.ErrorIs(t, g.Validate(), kv.ErrGeometry, "a layout leaves Pages to the caller")
	g.Pages = 1000
	require.NoError(t, g.Validate())
	assert.Equal(t, uint64(16*8*64*2), g.PageBytes())
	assert.Equal(t, 16*2*g.PageBytes(), g.PageSpanBytes(), "a page in every layer's K and V")
	assert.Equal(t, uint64(16*2*1000*16384), g.SlabBytes())
	l, err := g.SlabLayout(2 << 20)
	require.NoError(t, err)
	assert.Equal(t, 32, l.Regions())
	assert.Equal(t, 8, l.Steps(), "a 15.6 MiB tensor is 8 chunks of 2 MiB")
	assert.Equal(t, 0, l.Region(0, kv.K))
	assert.Equal(t, 1, l.Region(0, kv.V))
	assert.Equal(t, 31, l.Region(15, kv.V))

	_, err = kv.Layout("nope")
	require.ErrorIs(t, err, kv.ErrGeometry)
	assert.Contains(t, err.Error(), "llama-0.85b", "an unknown layout's error lists the known ones")

	for _, bad := range []kv.Geometry{
		{Layers: 0, KVHeads: 1, HeadDim: 1, TokensPerPage: 1, DType: kv.DTypeFP32, Pages: 1},
		{Layers: 1, KVHeads: 1, HeadDim: 1, TokensPerPage: 1, DType: 0, Pages: 1},
		{Layers: 1, KVHeads: 1, HeadDim: -4, TokensPerPage: 1, DType: kv.DTypeFP32, Pages: 1},
		{Layers: 1 << 20, KVHeads: 1 << 20, HeadDim: 1 << 20, TokensPerPage: 1, DType: kv.DTypeFP32, Pages: 1},
	} {
		assert.ErrorIs(t, bad.Validate(), kv.ErrGeometry, "%+v", bad)
	}
}

func TestDType(t *testing.T) {
	for d, size := range map[kv.DType]int{kv.DTypeBF16: 2, kv.DTypeFP16: 2, kv.DTypeFP32: 4, kv.DTypeFP8E4M3: 1} {
		assert.Equal(t, size, d.Size(), "%v", d)
		p, err := kv.ParseDType(d.String())
		require.NoError(t, err)
		assert.Equal(t, d, p)
	}
	_, err := kv.ParseDType("int4")
	assert.ErrorIs(t, err, kv.ErrGeometry)
	assert.Equal(t, 0, kv.DType(77).Size())
}

func TestRemoteError(t *testing.T) {
	err := error(&kv.RemoteError{Err: kv.ErrNoSpace, Text: "12 pages asked, 3 free", Peer: "kv: owner"})
	assert.True(t, errors.Is(err, kv.ErrNoSpace))
	assert.Equal(t, "kv: owner: 12 pages asked, 3 free", err.Error())
}

func BenchmarkPrefixHashes512(b *testing.B) {
	toks := make([]int32, 512*16)
	for i := range toks {
		toks[i] = int32(i)
	}
	dst := make([]kv.Hash, 0, 512)
	b.SetBytes(int64(4 * len(toks)))
	for b.Loop() {
		dst = kv.AppendPrefixHashes(dst[:0], "ns", toks, 16)
	}
}
