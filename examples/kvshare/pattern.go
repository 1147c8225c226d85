package main

import (
	"encoding/binary"
	"fmt"
)

// The pattern is a function of the byte offset alone, so the producer writes it and every
// consumer checks it without either holding a copy: word i (bytes 8i to 8i+7,
// little-endian) is splitmix64(seed + i). Every chunk of the cache this package moves is a
// whole number of words and starts on a word.

const wordBytes = 8

// patternWord is word i of the pattern for seed: one step of splitmix64, a cheap bijection
// whose neighbouring outputs share no structure, so a shifted, repeated or zeroed range
// never passes for the right one.
func patternWord(seed, i uint64) uint64 {
	z := seed + i*0x9e3779b97f4a7c15
	z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9
	z = (z ^ (z >> 27)) * 0x94d049bb133111eb
	return z ^ (z >> 31)
}

// checksum is FNV-1a 64 taken over 64-bit words rather than bytes: eight times cheaper,
// and just as sure to change when any word does.
type checksum uint64

func newChecksum() checksum { return 0xcbf29ce484222325 }

func (c *checksum) add(word uint64) { *c = (*c ^ checksum(word)) * 0x100000001b3 }

func (c checksum) String() string { return fmt.Sprintf("%016x", uint64(c)) }

// fill writes the pattern for seed into dst, which holds the cache's bytes from offset
// on, and adds the words to sum.
func fill(dst []byte, seed, offset uint64, sum *checksum) {
	first := offset / wordBytes
	for i := range uint64(len(dst)) / wordBytes {
		w := patternWord(seed, first+i)
		binary.LittleEndian.PutUint64(dst[i*wordBytes:], w)
		sum.add(w)
	}
}

// checker verifies a cache that arrives in order, chunk by chunk, against the pattern,
// and takes its checksum.
type checker struct {
	seed     uint64
	offset   uint64 // bytes checked so far
	sum      checksum
	firstBad uint64 // offset of the first word that differs from the pattern, if badWords > 0
	badWords uint64
}

func newChecker(seed uint64) *checker { return &checker{seed: seed, sum: newChecksum()} }

// check takes the next chunk of the cache.
func (c *checker) check(chunk []byte) {
	first := c.offset / wordBytes
	for i := range uint64(len(chunk)) / wordBytes {
		got := binary.LittleEndian.Uint64(chunk[i*wordBytes:])
		c.sum.add(got)
		if got != patternWord(c.seed, first+i) {
			if c.badWords == 0 {
				c.firstBad = (first + i) * wordBytes
			}
			c.badWords++
		}
	}
	c.offset += uint64(len(chunk))
}

// err says whether every byte checked so far matched the pattern.
func (c *checker) err() error {
	if c.badWords == 0 {
		return nil
	}
	return fmt.Errorf("kv: %d of %d words differ from the pattern, the first at byte offset %d",
		c.badWords, c.offset/wordBytes, c.firstBad)
}
