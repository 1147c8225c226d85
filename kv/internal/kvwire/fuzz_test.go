package kvwire

import (
	"bytes"
	"errors"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/cudapool/cudapool/kv"
)

// FuzzDecodeFrame: whatever the bytes, DecodeFrame fails with ErrMalformed or
// kv.ErrTooLarge, or decodes a frame within its type's PayloadLimits that Append
// encodes back to the same bytes.
func FuzzDecodeFrame(f *testing.F) {
	for _, s := range protocolSamples() {
		b, err := Append(nil, s.t, 1, s.m)
		require.NoError(f, err)
		f.Add(b)
	}
	f.Fuzz(func(t *testing.T, b []byte) {
		h, m, n, err := DecodeFrame(b)
		if err != nil {
			require.True(t, errors.Is(err, ErrMalformed) || errors.Is(err, kv.ErrTooLarge), "error %v wraps neither ErrMalformed nor kv.ErrTooLarge", err)
			return
		}
		lim := PayloadLimits[h.Type]
		require.True(t, n-HeaderLen >= lim.Min && n-HeaderLen <= lim.Max, "%s of %d payload bytes, outside PayloadLimits %v", h.Type, n-HeaderLen, lim)
		again, err := Append(nil, h.Type, h.ID, m)
		require.NoError(t, err, "%s re-encodes", h.Type)
		require.True(t, bytes.Equal(again, b[:n]), "%s re-encodes differently:\n got %x\nwant %x", h.Type, again, b[:n])
	})
}

// readCorpusEntry reads a `go test fuzz v1` file of one []byte.
func readCorpusEntry(t *testing.T, path string) []byte {
	raw, err := os.ReadFile(path)
	require.NoError(t, err)
	lines := strings.SplitN(strings.TrimSpace(string(raw)), "\n", 2)
	require.Len(t, lines, 2, "%s", path)
	require.Equal(t, "go test fuzz v1", lines[0], "%s", path)
	lit := strings.TrimSuffix(strings.TrimPrefix(lines[1], "[]byte("), ")")
	s, err := strconv.Unquote(lit)
	require.NoError(t, err, "%s", path)
	return []byte(s)
}

// The checked-in seed corpus has a well-formed frame of every type, and one of each
// malformed class DecodeFrame names.
func TestSeedCorpusCoversEveryType(t *testing.T) {
	dir := filepath.Join("testdata", "fuzz", "FuzzDecodeFrame")
	entries, err := os.ReadDir(dir)
	require.NoError(t, err)
	seen := map[Type]bool{}
	var failures []string
	for _, e := range entries {
		b := readCorpusEntry(t, filepath.Join(dir, e.Name()))
		h, _, _, err := DecodeFrame(b)
		if err == nil {
			seen[h.Type] = true
		} else {
			failures = append(failures, err.Error())
		}
	}
	for typ := range PayloadLimits {
		assert.True(t, seen[typ], "no well-formed %s seed in %s", typ, dir)
	}
	for _, class := range []string{"over the limit", "shorter than its header", "reserved bytes", "unknown frame type", "unknown flags",
		"ends early", "after the", "text of", "items, at most", "geometry's reserved",
		"names no notifier but a target", "Notifier of id 0"} {
		found := false
		for _, f := range failures {
			found = found || strings.Contains(f, class)
		}
		assert.True(t, found, "no seed in %s fails with %q", dir, class)
	}
}
