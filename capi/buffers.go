//go:build cgo

package main

import (
	"sync"

	"github.com/cudapool/cudapool/pool"
)

// buffers maps each live buffer's device address to its pool.Buffer, for every pool
// of the library (cudapool_alloc's and the PyTorch allocator's): C knows a buffer only
// by its address. It is sharded so that allocations on many threads rarely meet on a
// lock; one shard's critical section is a map access.
var buffers bufferTable

const shardCount = 64

type bufferTable struct {
	shards [shardCount]bufferShard
}

type bufferShard struct {
	mu sync.Mutex
	m  map[uintptr]*pool.Buffer
	_  [40]byte // a cache line each, so neighbouring shards' locks do not share one
}

// shard picks by a multiplicative hash: exportable buffers start on 2 MiB granules, so
// the low bits alone would put them all in one shard.
func (t *bufferTable) shard(ptr uintptr) *bufferShard {
	return &t.shards[(uint64(ptr)*0x9E3779B97F4A7C15)>>58]
}

func (t *bufferTable) put(b *pool.Buffer) {
	ptr := uintptr(b.Ptr())
	s := t.shard(ptr)
	s.mu.Lock()
	if s.m == nil {
		s.m = make(map[uintptr]*pool.Buffer)
	}
	s.m[ptr] = b
	s.mu.Unlock()
}

// take removes and returns the buffer that starts at ptr.
func (t *bufferTable) take(ptr uintptr) (*pool.Buffer, bool) {
	s := t.shard(ptr)
	s.mu.Lock()
	b, ok := s.m[ptr]
	if ok {
		delete(s.m, ptr)
	}
	s.mu.Unlock()
	return b, ok
}

// putBack undoes take when the free it was for failed, unless ptr was given out again
// meanwhile.
func (t *bufferTable) putBack(b *pool.Buffer) {
	ptr := uintptr(b.Ptr())
	s := t.shard(ptr)
	s.mu.Lock()
	if _, ok := s.m[ptr]; !ok {
		s.m[ptr] = b
	}
	s.mu.Unlock()
}

// containing returns the buffer that holds the address ptr, and ptr's offset in it.
// A buffer's start is one map lookup; an address inside a buffer (a tensor that
// PyTorch carved out of a segment) is found by a scan, which is what Publish needs and
// no hot path does.
func (t *bufferTable) containing(ptr uintptr) (*pool.Buffer, uint64, bool) {
	s := t.shard(ptr)
	s.mu.Lock()
	b, ok := s.m[ptr]
	s.mu.Unlock()
	if ok {
		return b, 0, true
	}
	for i := range t.shards {
		s := &t.shards[i]
		s.mu.Lock()
		for start, b := range s.m {
			if ptr > start && uint64(ptr-start) < b.Size() {
				s.mu.Unlock()
				return b, uint64(ptr - start), true
			}
		}
		s.mu.Unlock()
	}
	return nil, 0, false
}

// forgetPool drops every buffer of p, once p is closed.
func (t *bufferTable) forgetPool(p *pool.Pool) {
	for i := range t.shards {
		s := &t.shards[i]
		s.mu.Lock()
		for ptr, b := range s.m {
			if b.Pool() == p {
				delete(s.m, ptr)
			}
		}
		s.mu.Unlock()
	}
}
