package session

import (
	"context"
	"sync"
	"time"
)

// cut cuts a blocked read or write on a connection short when its caller's context
// ends: it sets the deadline (set, nc.SetReadDeadline or nc.SetWriteDeadline) in the
// past. It serves one call at a time (a role, a turn); a cut that comes late, once its
// call has returned, finds another call armed, or none, and does nothing.
type cut struct {
	set func(time.Time) error
	n   uint64 // the calls armed so far; by the one holding the role or turn

	mu    sync.Mutex
	armed uint64 // the call the cut is for, 0 none
}

// arm makes ctx's end cut the present call short until disarm, which takes what arm
// returns.
func (k *cut) arm(ctx context.Context) (stop func() bool) {
	k.n++
	me := k.n
	k.mu.Lock()
	k.armed = me
	k.mu.Unlock()
	return context.AfterFunc(ctx, func() {
		k.mu.Lock()
		if k.armed == me {
			_ = k.set(time.Unix(1, 0)) // it only wakes the call; on a closed connection the call fails anyway
		}
		k.mu.Unlock()
	})
}

// disarm ends the cut that arm armed (stop); with clear, the deadline it may have set
// is cleared too.
func (k *cut) disarm(stop func() bool, clear bool) {
	stop()
	k.mu.Lock()
	k.armed = 0
	if clear {
		_ = k.set(time.Time{}) // it fails only on a closed connection, which the next call reports
	}
	k.mu.Unlock()
}
