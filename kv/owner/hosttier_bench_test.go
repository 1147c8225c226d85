package owner

import (
	"math/rand/v2"
	"testing"

	"github.com/cudapool/cudapool/kv"
)

// BenchmarkPickSpill is the spiller's pick, under the owner's lock at every seal, on
// a 100 GiB slab of llama-0.85b pages (204,800, in random LRU order) whose window of
// pages to copy ahead is all copied already: what a pick costs when it finds nothing.
func BenchmarkPickSpill(b *testing.B) {
	const pages = 204800
	s := newSlab(0, pages)
	s.free = s.free[:0]
	for _, p := range rand.Perm(pages) {
		pg := &s.pages[p]
		pg.state = pageSealed
		pg.hash = kv.Hash{byte(p), byte(p >> 8), byte(p >> 16)}
		s.index[pg.hash] = uint32(p)
		s.pushFront(uint32(p))
	}
	t := &hostTier{s: s, twin: make([]uint32, pages), index: map[kv.Hash]uint32{}, head: none, tail: none, ahead: maxAhead, mark: none}
	var o Owner
	var task spillTask
	for b.Loop() {
		o.pickSpillLocked(t, &task)
		if len(task.gpu) != 0 {
			b.Fatalf("picked %d pages of a window copied already", len(task.gpu))
		}
	}
}
