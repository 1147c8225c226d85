package pool

import (
	"sync"
	"sync/atomic"
)

// gateClosed marks a closed gate in gate.n; the bits below it count calls inside.
const gateClosed = 1 << 62

// gate counts the calls that are using the pool's CUDA objects, so Close never
// destroys them under a call; once closed it admits no more. Entering and leaving
// are one atomic add each, outside the pool's mutex.
type gate struct {
	n       atomic.Int64
	drained chan struct{} // closed once the gate is closed and empty
	once    sync.Once
}

func newGate() gate { return gate{drained: make(chan struct{})} }

// enter admits a call unless the gate is closed. Every true enter must be matched by
// one leave.
func (g *gate) enter() bool {
	if g.n.Add(1)&gateClosed != 0 {
		g.leave()
		return false
	}
	return true
}

func (g *gate) leave() {
	if g.n.Add(-1) == gateClosed {
		g.markDrained()
	}
}

// closeIfIdle closes the gate if no call is inside, and reports whether it did.
func (g *gate) closeIfIdle() bool {
	if !g.n.CompareAndSwap(0, gateClosed) {
		return false
	}
	g.markDrained()
	return true
}

// close closes the gate; drained is closed when the last call inside leaves.
func (g *gate) close() {
	if g.n.Or(gateClosed) == 0 {
		g.markDrained()
	}
}

func (g *gate) markDrained() { g.once.Do(func() { close(g.drained) }) }
