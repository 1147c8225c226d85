package kvwire

import (
	"fmt"

	"github.com/cudapool/cudapool/kv"
)

// Reattach is a lease a replica held before its owner's restart, declared to the new
// owner after Welcome: its id, whether it is a write lease, its pages, and for a read
// lease the hashes it matched (one per page). A Reattach of lease 0 ends the list.
type Reattach struct {
	Lease  uint64
	Write  bool
	Pages  []uint32
	Hashes []kv.Hash
}

// The statuses of a Reattached frame.
const (
	ReattachKept uint32 = 0 // the lease is the new owner's, the same pages in the same state
	ReattachLost uint32 = 1 // the lease is not held; the text says why
)

// AppendReattach appends a Reattach frame: u64 lease | u32 write (0 or 1) | u32 count,
// pages | u32 count, hashes.
func AppendReattach(b []byte, id uint32, m Reattach) ([]byte, error) {
	if err := checkBatch("pages", len(m.Pages)); err != nil {
		return b, err
	}
	if err := checkBatch("hashes", len(m.Hashes)); err != nil {
		return b, err
	}
	w := uint32(0)
	if m.Write {
		w = 1
	}
	start := len(b)
	b = appendU32(appendU32(appendU64(Begin(b, TypeReattach, 0, id), m.Lease), w), uint32(len(m.Pages)))
	for _, p := range m.Pages {
		b = appendU32(b, p)
	}
	b = append(appendU32(b, uint32(len(m.Hashes))), hashBytes(m.Hashes)...)
	return End(b, start)
}

// ParseReattach reads a Reattach payload; its Hashes alias p.
func ParseReattach(p []byte, pages []uint32) (Reattach, error) {
	pr := NewParser(TypeReattach, p)
	m := Reattach{Lease: pr.U64()}
	w := pr.U32()
	m.Pages = pr.U32s(pages)
	m.Hashes = pr.Hashes()
	if err := pr.Done(); err != nil {
		return Reattach{}, err
	}
	if w > 1 {
		return Reattach{}, fmt.Errorf("%w: Reattach with write flag %d", ErrMalformed, w)
	}
	m.Write = w == 1
	return m, nil
}

// AppendReattached appends a Reattached frame: u32 status | text reason.
func AppendReattached(b []byte, id uint32, status uint32, reason string) ([]byte, error) {
	return frame(b, TypeReattached, 0, id, func(b []byte) []byte { return appendText(appendU32(b, status), reason) })
}
