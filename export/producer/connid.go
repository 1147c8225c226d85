package producer

import (
	"sync"
	"sync/atomic"
)

// connIDLimit is the last connection id of a space: maxConnID. Tests lower it before
// Listen, which reads it once.
var connIDLimit uint32 = maxConnID

// idSpace is one space of connection ids.
type idSpace struct {
	keys leaseIDs
	// last is the highest connection id given out in this space.
	last atomic.Uint32
	// maxIssued is the highest lease counter any of its connections reached: a
	// counter above it was never issued.
	maxIssued atomic.Uint64
}

// noteIssued records that a connection of s issued lease counter ctr.
func (s *idSpace) noteIssued(ctr uint64) {
	for {
		cur := s.maxIssued.Load()
		if ctr <= cur || s.maxIssued.CompareAndSwap(cur, ctr) {
			return
		}
	}
}

// issued reports whether (conn, ctr), read under s's key, names a lease some
// connection of s may have been given.
func (s *idSpace) issued(conn uint32, ctr uint64) bool {
	return conn >= 1 && conn <= s.last.Load() && ctr >= 1 && ctr <= s.maxIssued.Load()
}

// connIDs hands out (space, connection id) pairs, forever.
type connIDs struct {
	limit  uint32 // the last id of a space
	mu     sync.Mutex
	spaces []*idSpace // oldest first; the last is current
}

func newConnIDs() *connIDs {
	return &connIDs{limit: connIDLimit, spaces: []*idSpace{{keys: newLeaseIDs()}}}
}

// next returns a fresh connection id and its space.
func (c *connIDs) next() (*idSpace, uint32) {
	c.mu.Lock()
	defer c.mu.Unlock()
	cur := c.spaces[len(c.spaces)-1]
	if cur.last.Load() >= c.limit {
		cur = &idSpace{keys: newLeaseIDs()}
		c.spaces = append(c.spaces, cur)
	}
	return cur, cur.last.Add(1)
}

// owner finds the space and connection that issued lease id, if any did: the first
// space under whose key id reads as an issued lease. Keys are independent random
// permutations, so a forged id reads as issued under one only by chance (about
// maxIssued*last/2^64 per space).
func (c *connIDs) owner(id uint64) (s *idSpace, conn uint32, ctr uint64, ok bool) {
	c.mu.Lock()
	spaces := c.spaces
	c.mu.Unlock()
	for _, s := range spaces {
		if conn, ctr := s.keys.unseal(id); s.issued(conn, ctr) {
			return s, conn, ctr, true
		}
	}
	return nil, 0, 0, false
}
