//go:build cgo

package main

import (
	"fmt"
	"sync"
)

// kind is what a handle refers to; it is part of the handle, so that a handle of one
// kind given where another is wanted is told apart from a made-up one.
type kind uint8

const (
	kindPool kind = iota + 1
	kindExporter
	kindImporter
	kindMapping
	kindKVReplica
	kindChunk
	kindReservation
)

func (k kind) String() string {
	switch k {
	case kindPool:
		return "pool"
	case kindExporter:
		return "exporter"
	case kindImporter:
		return "importer"
	case kindMapping:
		return "mapping"
	case kindKVReplica:
		return "kv replica"
	case kindChunk:
		return "chunk"
	case kindReservation:
		return "reservation"
	}
	return fmt.Sprintf("kind-%d", uint8(k))
}

func (k kind) withArticle() string {
	if k == kindExporter || k == kindImporter {
		return "an " + k.String()
	}
	return "a " + k.String()
}

// A handle is kind<<56 | generation<<32 | slot index. A slot's generation grows each
// time it is freed, so a freed handle never names the slot's next object.
const (
	kindShift = 56
	genShift  = 32
	genMask   = 1<<24 - 1
	indexMask = 1<<32 - 1
)

// table holds the objects of one kind that C holds handles to. Its methods are safe
// for concurrent use.
type table[T any] struct {
	kind  kind
	mu    sync.RWMutex
	slots []slot[T]
	free  []uint32
}

type slot[T any] struct {
	gen  uint32 // of the live object, or of the next one if !live
	live bool
	v    T
}

func newTable[T any](k kind) *table[T] { return &table[T]{kind: k} }

// add stores v and returns its handle, never 0.
func (t *table[T]) add(v T) uint64 {
	t.mu.Lock()
	defer t.mu.Unlock()
	var i uint32
	if n := len(t.free); n > 0 {
		i = t.free[n-1]
		t.free = t.free[:n-1]
	} else {
		t.slots = append(t.slots, slot[T]{gen: 1})
		i = uint32(len(t.slots) - 1)
	}
	s := &t.slots[i]
	s.live, s.v = true, v
	return uint64(t.kind)<<kindShift | uint64(s.gen)<<genShift | uint64(i)
}

// get returns the object h refers to, or an error wrapping errHandle saying why h
// refers to none.
func (t *table[T]) get(h uint64) (T, error) {
	t.mu.RLock()
	defer t.mu.RUnlock()
	s, err := t.slotLocked(h)
	if err != nil {
		var zero T
		return zero, err
	}
	return s.v, nil
}

// all returns every live object, in no order.
func (t *table[T]) all() []T {
	t.mu.RLock()
	defer t.mu.RUnlock()
	var vs []T
	for _, s := range t.slots {
		if s.live {
			vs = append(vs, s.v)
		}
	}
	return vs
}

// remove forgets h and returns what it referred to; h is invalid from then on.
func (t *table[T]) remove(h uint64) (T, error) {
	t.mu.Lock()
	defer t.mu.Unlock()
	var zero T
	s, err := t.slotLocked(h)
	if err != nil {
		return zero, err
	}
	v := s.v
	s.v, s.live = zero, false
	s.gen = (s.gen + 1) & genMask
	if s.gen == 0 {
		s.gen = 1
	}
	t.free = append(t.free, uint32(h&indexMask))
	return v, nil
}

func (t *table[T]) slotLocked(h uint64) (*slot[T], error) {
	if h == 0 {
		return nil, fmt.Errorf("%w: %v handle 0", errHandle, t.kind)
	}
	if k := kind(h >> kindShift); k != t.kind {
		if k >= kindPool && k <= kindReservation {
			return nil, fmt.Errorf("%w: %#x is the handle of %v, not of %v", errHandle, h, k.withArticle(), t.kind.withArticle())
		}
		return nil, fmt.Errorf("%w: %#x is not a cudapool handle", errHandle, h)
	}
	i, gen := h&indexMask, uint32(h>>genShift)&genMask
	if i >= uint64(len(t.slots)) || gen == 0 || gen > t.slots[i].gen {
		return nil, fmt.Errorf("%w: %v handle %#x was never issued", errHandle, t.kind, h)
	}
	s := &t.slots[i]
	if gen < s.gen || !s.live {
		return nil, fmt.Errorf("%w: %v handle %#x was closed or released", errHandle, t.kind, h)
	}
	return s, nil
}
