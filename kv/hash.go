package kv

import (
	"crypto/sha256"
	"encoding/binary"
	"encoding/hex"
	"slices"
	"unsafe"
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

// AppendPrefixHashes is [PrefixHashes] appending to dst.
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
	// One buffer for every page's message, prev || le32 tokens: on a little-endian
	// machine the tokens are copied as they lie in memory, one copy a page.
	var stack [16 + 4*64]byte
	var buf []byte
	if need := len(prev) + 4*tokensPerPage; need <= len(stack) {
		buf = stack[:need]
	} else {
		buf = make([]byte, need)
	}
	raw := tokenBytes(tokens[:n*tokensPerPage])
	step := 4 * tokensPerPage
	for i := range n {
		copy(buf, prev[:])
		if raw != nil {
			copy(buf[len(prev):], raw[i*step:(i+1)*step])
		} else {
			b := buf[len(prev):]
			for j, t := range tokens[i*tokensPerPage : (i+1)*tokensPerPage] {
				binary.LittleEndian.PutUint32(b[4*j:], uint32(t))
			}
		}
		sum := sha256.Sum256(buf)
		copy(prev[:], sum[:])
		dst = append(dst, prev)
	}
	return dst
}

// littleEndian says whether this machine stores an int32 as its little-endian bytes.
var littleEndian = func() bool {
	x := uint16(1)
	return *(*byte)(unsafe.Pointer(&x)) == 1
}()

// tokenBytes is tokens' memory as bytes where that is their little-endian encoding,
// and nil elsewhere.
func tokenBytes(tokens []int32) []byte {
	if !littleEndian || len(tokens) == 0 {
		return nil
	}
	return unsafe.Slice((*byte)(unsafe.Pointer(unsafe.SliceData(tokens))), 4*len(tokens))
}
