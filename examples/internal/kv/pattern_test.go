package kv

import (
	"strings"
	"testing"
)

func TestShapeBytes(t *testing.T) {
	if got, want := GPUShape.Bytes(), uint64(4<<30); got != want {
		t.Errorf("GPUShape.Bytes() = %d, want %d (4 GiB)", got, want)
	}
	if got, want := TestShape.Bytes(), uint64(64<<20); got != want {
		t.Errorf("TestShape.Bytes() = %d, want %d (64 MiB)", got, want)
	}
	if got, want := TestShape.String(), "32 layers x 512 tokens x 8 heads x 128 dims x K,V fp16 = 64 MiB"; got != want {
		t.Errorf("TestShape.String() = %q, want %q", got, want)
	}
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
		switch {
		case tc.want == "" && err != nil:
			t.Errorf("%+v: Validate() = %v, want nil", tc.shape, err)
		case tc.want != "" && (err == nil || !strings.Contains(err.Error(), tc.want)):
			t.Errorf("%+v: Validate() = %v, want an error containing %q", tc.shape, err, tc.want)
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
	if err := c.err(); err != nil {
		t.Fatalf("checker on the filled pattern: %v", err)
	}
	if c.sum != sum {
		t.Errorf("checker sum %v, fill sum %v", c.sum, sum)
	}
	var other checksum = newChecksum()
	fill(make([]byte, len(whole)), seed+1, 0, &other)
	if other == sum {
		t.Errorf("seeds %d and %d give the same checksum %v", seed, seed+1, sum)
	}
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
			if c.err() == nil {
				t.Fatal("damaged cache passed the check")
			}
			if c.firstBad != tc.first || c.badWords != tc.words {
				t.Errorf("first bad offset %d, %d bad words; want %d, %d", c.firstBad, c.badWords, tc.first, tc.words)
			}
			if c.sum == sum {
				t.Errorf("damaged cache has the pattern's checksum %v", sum)
			}
		})
	}
}
