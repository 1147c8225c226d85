package owner

import (
	"encoding/binary"
	"os"
	"path/filepath"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/cudapool/cudapool/kv"
)

// An index of records that are well formed but make no sense is dropped, saying why;
// one that does is read back as it was written.
func TestLoadIndex(t *testing.T) {
	g := kv.Geometry{Layers: 2, KVHeads: 2, HeadDim: 8, TokensPerPage: 4, DType: kv.DTypeFP32, Pages: 16}
	hdr := indexHeader{Epoch: 3, Keeper: procID{PID: 7, Start: 99}, Geometry: g, Devices: []int{0, 1}}
	h1, h2 := kv.Hash{1}, kv.Hash{2}
	alice := procID{PID: 11, Start: 5}
	good := appendHeader(nil, hdr)
	good = appendPageRecord(good, recSeal, 0, 3, &h1)
	good = appendPageRecord(good, recSeal, 1, 4, &h2)
	good = appendPageRecord(good, recSeal, 0, 5, &h2)
	good = appendPageRecord(good, recFree, 0, 3, nil)
	good = appendPageRecord(good, recSeal, 0, 6, &h1)
	good = appendPageRecord(good, recHostSeal, 0, 40, &h1) // host pages: beyond the slab's 16, and under a hash the slab holds too
	good = appendPageRecord(good, recHostSeal, 0, 2, &h2)
	good = appendPageRecord(good, recHostFree, 0, 40, nil)
	good = appendPageRecord(good, recHostSeal, 1, 9, &h1)
	good = appendProcRecord(good, recAttach, alice)
	good = appendProcRecord(good, recAttach, procID{PID: 12})
	good = appendProcRecord(good, recDetach, procID{PID: 12})
	bob := grantRec{lease: 9, dev: 1, holder: procID{PID: 13, Start: 8}, pages: []uint32{7, 8}}
	good = appendGrantRecord(good, &grantRec{lease: 5, dev: 0, holder: alice, pages: []uint32{9}})
	good = appendGrantRecord(good, &bob)
	good = appendGrantRecord(good, &grantRec{lease: 4, dev: 0, holder: alice, pages: []uint32{10, 11}})
	good = appendRecord(good, func(b []byte) []byte { return binary.LittleEndian.AppendUint64(append(b, recEnd), 5) })
	dir := t.TempDir()
	write := func(b []byte) string {
		path := filepath.Join(dir, "index")
		require.NoError(t, os.WriteFile(path, b, 0o600))
		return path
	}
	rec, err := loadIndex(write(good))
	require.NoError(t, err)
	assert.Equal(t, hdr, rec.hdr)
	assert.Equal(t, []sealedPage{{5, h2}, {6, h1}}, rec.sealed[0], "least recent first, the freed page gone")
	assert.Equal(t, []sealedPage{{4, h2}}, rec.sealed[1])
	assert.Equal(t, []procID{alice}, rec.attached)
	assert.Equal(t, []sealedPage{{2, h2}}, rec.host[0], "the evicted host page gone")
	assert.Equal(t, []sealedPage{{9, h1}}, rec.host[1])
	assert.Equal(t, []grantRec{{lease: 4, dev: 0, holder: alice, pages: []uint32{10, 11}}, bob}, rec.grants, "the write leases not ended, by id")

	_, err = loadIndex(filepath.Join(dir, "none"))
	assert.ErrorIs(t, err, errNoIndex)
	for _, tc := range []struct {
		name string
		b    []byte
		why  string
	}{
		{"empty", nil, "the header: truncated"},
		{"magic", appendRecord(nil, func(b []byte) []byte { return append(b, "CPKVIDX9"...) }), "bad magic"},
		{"device", appendPageRecord(appendHeader(nil, hdr), recSeal, 2, 1, &h1), "device 2 is not one of [0 1]"},
		{"page", appendPageRecord(appendHeader(nil, hdr), recSeal, 0, 16, &h1), "page 16 of 16"},
		{"type", appendRecord(appendHeader(nil, hdr), func(b []byte) []byte { return append(b, 9) }), "unknown type 9"},
		{"short page", appendRecord(appendHeader(nil, hdr), func(b []byte) []byte { return append(b, recSeal, 0, 0) }), "2 bytes for a page record"},
		{"one hash twice", appendPageRecord(appendPageRecord(appendHeader(nil, hdr), recSeal, 0, 1, &h1), recSeal, 0, 2, &h1), "visible under one hash"},
		{"host device", appendPageRecord(appendHeader(nil, hdr), recHostSeal, 2, 1, &h1), "device 2 is not one of [0 1]"},
		{"host hash twice", appendPageRecord(appendPageRecord(appendHeader(nil, hdr), recHostSeal, 0, 1, &h1), recHostSeal, 0, 20, &h1), "are sealed under one hash"},
		{"a tail cut", good[:len(good)-1], "truncated"},
		{"grant device", appendGrantRecord(appendHeader(nil, hdr), &grantRec{lease: 1, dev: 2, pages: []uint32{1}}), "device 2 is not one of [0 1]"},
		{"grant page", appendGrantRecord(appendHeader(nil, hdr), &grantRec{lease: 1, pages: []uint32{1, 16}}), "page 16 of 16"},
		{"grant of no page", appendGrantRecord(appendHeader(nil, hdr), &grantRec{lease: 1}), "24 bytes for a grant record"},
		{"short end", appendRecord(appendHeader(nil, hdr), func(b []byte) []byte { return append(b, recEnd, 1) }), "1 bytes for an end record"},
	} {
		_, err := loadIndex(write(tc.b))
		require.Error(t, err, tc.name)
		assert.Contains(t, err.Error(), tc.why, tc.name)
	}
}
