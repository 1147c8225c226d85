package replica

import (
	"errors"

	"github.com/cudapool/cudapool/kv/internal/kvwire"
)

// ForgeLease is a Lease the owner never issued, for tests of its refusals.
func ForgeLease(id uint64, write bool, pages ...uint32) *Lease {
	return &Lease{id: id, write: write, pages: pages}
}

// HangUp closes r's page connection without Bye, as a process does as it dies.
func HangUp(r *Replica) {
	r.mu.Lock()
	cl := r.cl
	r.mu.Unlock()
	cl.Fail(errors.New("it hung up"))
}

// OpenEventfds counts the eventfds r made and has not closed.
func OpenEventfds(r *Replica) int { return int(r.openFDs.Load()) }

// TornDown is closed once r's Close has completed its teardown, in the background
// where Close gave up waiting.
func TornDown(r *Replica) <-chan struct{} { return r.tornDown }

// OnReply makes f run as r's reader has read each reply frame, with the request's
// id, before the reply is handed on. Set it before the calls it is to see.
func OnReply(r *Replica, f func(id uint32)) {
	r.readHook = func(h kvwire.Header) { f(h.ID) }
}

// FailConn fails r's present connection for why, as its hang-up watch does when the
// owner dies.
func FailConn(r *Replica, why error) {
	r.mu.Lock()
	nc := r.nc
	r.mu.Unlock()
	r.failConn(nc, why)
}

// OnReplied makes f run as Alloc, Seal, Match or Release has its reply and has acted
// on it, before it returns.
func OnReplied(r *Replica, f func()) { r.replyHook = f }
