package kvwire

import (
	"bytes"
	"errors"
	"path/filepath"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/cudapool/cudapool/internal/protospec"
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

// The checked-in seed corpus has a well-formed frame of every type, and one of each
// malformed class DecodeFrame names.
func TestSeedCorpusCoversEveryType(t *testing.T) {
	var types []string
	for typ := range PayloadLimits {
		types = append(types, typ.String())
	}
	protospec.CheckSeedCorpus(t, filepath.Join("testdata", "fuzz", "FuzzDecodeFrame"), func(b []byte) (string, error) {
		h, _, _, err := DecodeFrame(b)
		return h.Type.String(), err
	}, types, []string{"over the limit", "shorter than its header", "reserved bytes", "unknown frame type", "unknown flags",
		"ends early", "after the", "text of", "items, at most", "geometry's reserved",
		"names no notifier but a target", "Notifier of id 0"})
}
