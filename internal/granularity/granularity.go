// Package granularity owns the allocation granularity of cudapool: asking the runtime
// for it once per (device, handle type), and rounding and alignment arithmetic that
// is exact up to 2^64-1.
//
// An exportable pool rounds every allocation up to the granularity so that each buffer
// starts and ends on a granule and owns its pages (FACTS item 1: the driver packs
// smaller allocations below the granularity). The arithmetic here does not assume the
// granularity is a power of two; the drivers seen so far report 2 MiB.
package granularity

import (
	"fmt"
	"math"
	"reflect"
	"sync"

	"github.com/cudapool/cudapool/cudart"
)

// Querier is the part of cudart.Runtime a Cache asks.
type Querier interface {
	AllocationGranularity(dev int, ht cudart.HandleType, recommended bool) (uint64, error)
}

type key struct {
	dev int
	ht  cudart.HandleType
}

// Cache remembers the minimum allocation granularity of each (device, handle type) of
// one runtime. The minimum is the unit the driver maps and shares, so it is the unit
// a buffer must own. A Cache is safe for concurrent use.
type Cache struct {
	q Querier

	mu    sync.Mutex
	known map[key]uint64
	holds int // holders of a shared Cache; see Acquire
}

// NewCache returns an empty Cache that asks q. It is not shared: Release does
// nothing on it.
func NewCache(q Querier) *Cache {
	return &Cache{q: q, known: make(map[key]uint64)}
}

// Get returns the minimum allocation granularity of pinned device memory on dev that
// can be shared as ht. The first successful answer for (dev, ht) is remembered and
// returned from then on; a failed query is not remembered, so a later Get asks
// again. A granularity of 0 from the runtime is an error wrapping ErrZeroGranularity.
func (c *Cache) Get(dev int, ht cudart.HandleType) (uint64, error) {
	k := key{dev, ht}
	c.mu.Lock()
	g, ok := c.known[k]
	c.mu.Unlock()
	if ok {
		return g, nil
	}
	// Asked without the lock: two first callers may both ask, and get the same answer.
	g, err := c.q.AllocationGranularity(dev, ht, false)
	if err != nil {
		return 0, fmt.Errorf("granularity of device %d for handle type %v: %w", dev, ht, err)
	}
	if g == 0 {
		return 0, fmt.Errorf("granularity of device %d for handle type %v: runtime reported %w", dev, ht, ErrZeroGranularity)
	}
	c.mu.Lock()
	c.known[k] = g
	c.mu.Unlock()
	return g, nil
}

// shared maps each Querier to the Cache its holders share. Entries live while held,
// so a process that makes and drops runtimes (tests do, with software devices) does
// not keep them alive.
var shared struct {
	mu     sync.Mutex
	caches map[Querier]*Cache
}

// Acquire returns the Cache that every holder of q shares, so that the granularity of
// a (device, handle type) is asked once however many pools use it. Each Acquire must
// be matched by one Release when the holder is done. A Querier whose dynamic type
// cannot be a map key gets a Cache of its own.
func Acquire(q Querier) *Cache {
	if t := reflect.TypeOf(q); t == nil || !t.Comparable() {
		return NewCache(q)
	}
	shared.mu.Lock()
	defer shared.mu.Unlock()
	c := shared.caches[q]
	if c == nil {
		if shared.caches == nil {
			shared.caches = make(map[Querier]*Cache)
		}
		c = NewCache(q)
		shared.caches[q] = c
	}
	c.holds++
	return c
}

// Release gives back one Acquire. When the last holder releases it, the Cache is
// forgotten and the next Acquire for its Querier starts empty. Release on a Cache that
// is not shared, or that has no holders left, does nothing.
func (c *Cache) Release() {
	shared.mu.Lock()
	defer shared.mu.Unlock()
	if c.holds == 0 {
		return
	}
	c.holds--
	if c.holds == 0 && shared.caches[c.q] == c {
		delete(shared.caches, c.q)
	}
}

// RoundUp returns the smallest multiple of g that is at least n. RoundUp(0, g) is 0.
// It fails with ErrZeroGranularity when g is 0, and with ErrOverflow when that multiple
// is above 2^64-1.
func RoundUp(n, g uint64) (uint64, error) {
	if g == 0 {
		return 0, ErrZeroGranularity
	}
	r := remainder(n, g)
	if r == 0 {
		return n, nil
	}
	add := g - r
	if n > math.MaxUint64-add {
		return 0, fmt.Errorf("rounding %d up to a multiple of %d: %w", n, g, ErrOverflow)
	}
	return n + add, nil
}

// RoundDown returns the largest multiple of g that is at most n. It fails with
// ErrZeroGranularity when g is 0.
func RoundDown(n, g uint64) (uint64, error) {
	if g == 0 {
		return 0, ErrZeroGranularity
	}
	return n - n%g, nil
}

// IsAligned reports whether v is a multiple of g. Nothing is aligned to 0.
func IsAligned(v, g uint64) bool {
	return g != 0 && remainder(v, g) == 0
}

// remainder is n % g for g > 0, without a division when g is a power of two, as
// every granularity seen is: Alloc rounds and checks on every call.
func remainder(n, g uint64) uint64 {
	if g&(g-1) == 0 {
		return n & (g - 1)
	}
	return n % g
}
