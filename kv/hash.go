package kv

import (
	"crypto/sha256"
	"encoding/binary"
	"encoding/hex"
	"slices"
)

// Hash is a prefix hash: it names a page by the whole token prefix up to its end.
type Hash [16]byte

func (h Hash) String() string { return hex.EncodeToString(h[:]) }

// rootPrefix is what Root hashes before the namespace.
const rootPrefix = "cudapool/kv/v1\x00"

// Root is the hash before the first page of namespace: the first 16 bytes of
// SHA-256("cudapool/kv/v1\x00" + namespace).
func Root(namespace string) Hash {
	d := sha256.New()
	d.Write([]byte(rootPrefix))
	d.Write([]byte(namespace))
	var h Hash
	copy(h[:], d.Sum(nil))
	return h
}

// PrefixHashes returns the hash of each full page of tokens in namespace; a trailing
// partial page has none. It returns nil for tokensPerPage < 1.
func PrefixHashes(namespace string, tokens []int32, tokensPerPage int) []Hash {
	return AppendPrefixHashes(nil, namespace, tokens, tokensPerPage)
}

// AppendPrefixHashes is PrefixHashes appending to dst.
func AppendPrefixHashes(dst []Hash, namespace string, tokens []int32, tokensPerPage int) []Hash {
	if tokensPerPage < 1 {
		return dst
	}
	n := len(tokens) / tokensPerPage
	if n == 0 {
		return dst
	}
	dst = slices.Grow(dst, n)
	prev := Root(namespace)
	buf := make([]byte, len(prev)+4*tokensPerPage)
	var sum [sha256.Size]byte
	for i := range n {
		copy(buf, prev[:])
		b := buf[len(prev):]
		for j, t := range tokens[i*tokensPerPage : (i+1)*tokensPerPage] {
			binary.LittleEndian.PutUint32(b[4*j:], uint32(t))
		}
		sum = sha256.Sum256(buf)
		copy(prev[:], sum[:])
		dst = append(dst, prev)
	}
	return dst
}
