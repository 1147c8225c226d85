package main

import (
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

func TestShapeBytes(t *testing.T) {
	assert.Equal(t, uint64(4<<30), GPUShape.Bytes(), "GPUShape.Bytes(), 4 GiB")
	assert.Equal(t, uint64(64<<20), TestShape.Bytes(), "TestShape.Bytes(), 64 MiB")
	assert.Equal(t, "32 layers x 512 tokens x 8 heads x 128 dims x K,V fp16 = 64 MiB", TestShape.String())
}

func TestShapeValidate(t *testing.T) {
	for _, tc := range []struct {
		shape Shape
		want  string // substring of the error; "" for none
	}{
		{GPUShape, ""},
		{Shape{1, 1, 1, 2}, ""}, // 8 bytes: one word
		{Shape{0, 1, 1, 1}, "layers must be positive"},
		{Shape{1, -3, 1, 1}, "tokens must be positive"},
		{Shape{1, 1, 0, 1}, "heads must be positive"},
		{Shape{1, 1, 1, 0}, "head-dim must be positive"},
		{Shape{1, 1, 1, 1}, "whole number of 8-byte words"}, // 4 bytes
		{Shape{1 << 20, 1 << 20, 1 << 20, 1 << 10}, "overflows 64 bits"},
	} {
		err := tc.shape.Validate()
		if tc.want == "" {
			assert.NoError(t, err, "%+v: Validate()", tc.shape)
		} else {
			assert.ErrorContains(t, err, tc.want, "%+v: Validate()", tc.shape)
		}
	}
}

func TestPatternRoundTrip(t *testing.T) {
	const seed = 7
	whole := make([]byte, 4096)
	sum := newChecksum()
	// Filled in uneven chunks, the pattern must come out as if filled at once.
	for off, n := 0, 8; off < len(whole); off, n = off+n, n*2 {
		n = min(n, len(whole)-off)
		fill(whole[off:off+n], seed, uint64(off), &sum)
	}
	c := newChecker(seed)
	c.check(whole[:1000])
	c.check(whole[1000:])
	require.NoError(t, c.err(), "checker on the filled pattern")
	assert.Equal(t, sum, c.sum, "the checker's sum against the fill's")
	var other checksum = newChecksum()
	fill(make([]byte, len(whole)), seed+1, 0, &other)
	assert.NotEqual(t, sum, other, "seeds %d and %d give the same checksum", seed, seed+1)
}

func TestCheckerFindsDamage(t *testing.T) {
	const seed = 1
	for _, tc := range []struct {
		name   string
		damage func(b []byte)
		first  uint64
		words  uint64
	}{
		{"one bit", func(b []byte) { b[1234] ^= 0x10 }, 1232, 1},
		{"zeroed range", func(b []byte) { clear(b[800:1600]) }, 800, 100},
		{"shifted by a word", func(b []byte) { copy(b[8:], b[:len(b)-8]) }, 8, 511},
	} {
		t.Run(tc.name, func(t *testing.T) {
			b := make([]byte, 4096)
			sum := newChecksum()
			fill(b, seed, 0, &sum)
			tc.damage(b)
			c := newChecker(seed)
			c.check(b)
			require.Error(t, c.err(), "damaged cache passed the check")
			assert.Equal(t, tc.first, c.firstBad, "first bad offset")
			assert.Equal(t, tc.words, c.badWords, "bad words")
			assert.NotEqual(t, sum, c.sum, "damaged cache has the pattern's checksum")
		})
	}
}
