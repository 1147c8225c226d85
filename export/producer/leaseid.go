package producer

import (
	"crypto/aes"
	"crypto/cipher"
	"crypto/rand"
	"encoding/binary"
)

// Lease ids are (connection id, lease counter) pairs put through a keyed permutation of
// 64-bit values, so that an exporter can tell, from the id alone, a lease of this
// connection, of another connection, or one it never issued, while a peer can neither
// guess another connection's ids nor forge new ones.
const (
	connIDBits  = 24
	counterBits = 64 - connIDBits
	maxConnID   = 1<<connIDBits - 1
	maxCounter  = 1<<counterBits - 1
)

// leaseIDs is the permutation: a four-round Feistel network on 32-bit halves whose
// round function is AES under a key drawn at random for each Exporter. Four rounds of
// a pseudo-random function make a strong pseudo-random permutation (Luby-Rackoff).
type leaseIDs struct{ block cipher.Block }

func newLeaseIDs() leaseIDs {
	var key [16]byte
	rand.Read(key[:])
	block, err := aes.NewCipher(key[:])
	if err != nil {
		panic("producer: AES-128 refused a 16-byte key: " + err.Error())
	}
	return leaseIDs{block}
}

// round is the round function; b is scratch space for the block's input and output
// (one allocation for the four rounds: Encrypt, through an interface, lets them escape).
func (k leaseIDs) round(b *[2 * aes.BlockSize]byte, i byte, x uint32) uint32 {
	in, out := b[:aes.BlockSize], b[aes.BlockSize:]
	clear(in)
	in[0] = i
	binary.LittleEndian.PutUint32(in[1:], x)
	k.block.Encrypt(out, in)
	return binary.LittleEndian.Uint32(out)
}

// seal returns the lease id of counter ctr of connection conn.
func (k leaseIDs) seal(conn uint32, ctr uint64) uint64 {
	x := uint64(conn)<<counterBits | ctr&maxCounter
	l, r := uint32(x>>32), uint32(x)
	b := new([2 * aes.BlockSize]byte)
	for i := range byte(4) {
		l, r = r, l^k.round(b, i, r)
	}
	return uint64(l)<<32 | uint64(r)
}

// unseal inverts seal.
func (k leaseIDs) unseal(id uint64) (conn uint32, ctr uint64) {
	l, r := uint32(id>>32), uint32(id)
	b := new([2 * aes.BlockSize]byte)
	for i := byte(4); i > 0; i-- {
		l, r = r^k.round(b, i-1, l), l
	}
	x := uint64(l)<<32 | uint64(r)
	return uint32(x >> counterBits), x & maxCounter
}
