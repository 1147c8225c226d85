package producer

import (
	"context"
	"errors"
	"fmt"
	"io"
	"sync"
	"time"

	"golang.org/x/sync/semaphore"

	"github.com/cudapool/cudapool/cudart"
	"github.com/cudapool/cudapool/export"
	"github.com/cudapool/cudapool/export/internal/wire"
	"github.com/cudapool/cudapool/internal/peercred"
	"github.com/cudapool/cudapool/pool"
)

// peer is the exporter's side of an admitted connection that takes leases: an
// importer. Its lease ledger is in ledger.go, its granting in grant.go.
type peer struct {
	ex *Exporter
	c  *wire.Conn
	// space and id name the connection in lease ids (connid.go).
	space *idSpace
	id    uint32
	cred  *peercred.Cred // nil for a peer on a byte stream
	hello wire.HelloMsg
	since time.Time

	// proc is the peer's process, opened at admission, whose exit ends the leases of a
	// connection lost without Bye; nil for a peer on a byte stream, or where it could not be opened (procErr says why).
	proc    *peercred.Process
	procErr error
	// exitWait bounds the wait for proc's exit; stopExitWait (Close) ends it.
	exitWait     context.Context
	stopExitWait context.CancelFunc

	// poolLock is held while a pool's handle is sent, so that it goes once and first;
	// waiting for it ends with the waiter's context, as a peer that stopped reading can
	// hold it for as long as it likes.
	poolLock *semaphore.Weighted
	sent     map[*pool.Pool]bool

	mu     sync.Mutex
	issued uint64 // lease counter: ids 1..issued were given out
	grants int    // grants held, over all leases (WithMaxGrants caps it)
	leases map[uint64]*lease
	byHeld map[any]*lease // by lease.held
	// sentAllocs are the VMM allocations whose chunks the peer has imported
	// (sendChunks), until it is told to drop them (dropChunks).
	sentAllocs map[*vmmAlloc]bool
	// releaseEvents holds the peer's release event opened on each device it leased from.
	releaseEvents map[int]cudart.Event
	// completions are those events as the pools they ended leases of know them
	// (*pool.Lease.EndAt); closed before the events are destroyed.
	completions map[*pool.Pool]*pool.Completion
	// settling is held across a settleCompletions: the cleanup after the peer's Bye
	// and the exporter's Close may run it at once, and the one that finds nothing left
	// must not hang up (the peer then destroys its event) while the other still
	// waits on the event.
	settling sync.Mutex
	// ending is held (shared) by a release while it ends grants with the release
	// event, and by shut while it settles the completions and hangs up.
	ending sync.RWMutex
	// bye: the peer said it is done and released all it wanted to; what it still
	// holds is ended as of its release event.
	bye bool
	// closing: the exporter is shutting this connection.
	closing bool
	// awaitingExit: the connection was lost without Bye while the process lives on,
	// still mapping what it holds; its leases end when it exits.
	awaitingExit bool
	// left: cleanup has run; a lease granted now would never be ended.
	left bool
	// retains: the peer may keep imports past their leases (WithRetainedImports);
	// retained holds them by record.
	retains  bool
	retained map[cudart.PtrExportData]*retention

	// detach takes this peer out of what Exporter.Close waits for: Close abandoned
	// it, and it is served on, until it has released all or its process exited.
	detach func()
}

// remote reports whether the peer is on a byte stream: no descriptors, no IPC events.
func (p *peer) remote() bool { return p.cred == nil }

// lost reports whether the peer's connection ended without Bye, and not because the
// exporter is closing, while it still holds leases: nothing says its imports are gone.
func (p *peer) lost() bool {
	p.mu.Lock()
	defer p.mu.Unlock()
	return !p.bye && !p.closing && (len(p.leases) > 0 || len(p.retained) > 0)
}

// awaitExit keeps a lost peer's leases until its process has exited: until then the
// process may still map and read what it holds. It returns cleanup's clean: false once
// the process has exited (its imports went with it), true when Close stopped the wait
// (Close ends leases as of the peer's last release). For a process that cannot be
// watched it returns the connection's own verdict, clean, and logs why.
func (p *peer) awaitExit(clean bool) bool {
	if p.proc == nil {
		p.ex.log.Warn("producer: cannot watch the process of a peer lost without Bye; ending its leases now",
			"pid", p.pid(), "err", p.procErr)
		return clean
	}
	p.mu.Lock()
	p.awaitingExit = true
	leases := len(p.leases)
	p.mu.Unlock()
	p.ex.log.Info("producer: peer lost without Bye; its leases are held until its process exits",
		"pid", p.pid(), "leases", leases)
	err := p.proc.Wait(p.exitWait)
	switch {
	case err == nil:
		p.ex.log.Info("producer: lost peer's process exited; ending its leases", "pid", p.pid(), "leases", leases)
		return false
	case p.exitWait.Err() != nil:
		return true
	}
	p.ex.log.Warn("producer: cannot wait for the process of a peer lost without Bye; ending its leases now",
		"pid", p.pid(), "err", err)
	return clean
}

// goneErr is the error of a grant to a peer whose connection is gone.
func (p *peer) goneErr() error {
	return fmt.Errorf("%w: pid %d's connection is gone", ErrNoPeer, p.pid())
}

func (p *peer) pid() int {
	if p.cred != nil {
		return p.cred.PID
	}
	return int(p.hello.PID) // what a remote peer says: not checked
}

// frameHook, set by tests alone, sees each request before it is served.
var frameHook func(wire.Message)

// serve answers the peer's requests in order until the connection ends. reason says
// why, nil for a peer that said Bye or an exporter that is closing; clean reports
// whether the peer's release event covers all it freed.
func (p *peer) serve() (reason error, clean bool) {
	for {
		m, _, err := p.c.Recv()
		if err != nil {
			p.mu.Lock()
			bye, closing := p.bye, p.closing
			p.mu.Unlock()
			switch {
			case bye || closing:
				return nil, true
			case errors.Is(err, io.EOF):
				// Without Bye the peer exited, crashed or hung up; which, its process
				// tells (awaitExit).
				return errors.New("connection closed without Bye"), false
			case errors.Is(err, export.ErrProtocol):
				return err, true
			}
			return err, false
		}
		if frameHook != nil {
			frameHook(m)
		}
		switch m := m.(type) {
		case *wire.OpenMsg:
			answer(p.c, m.ReqID, p.answerOpen(m))
		case *wire.ReleaseMsg:
			answer(p.c, m.ReqID, p.releaseLease(m))
		case *wire.StateRequestMsg:
			answer(p.c, m.ReqID, p.ex.sendState(p.c, m.ReqID))
		case *wire.RevokedMsg:
			p.answerRevoked(m)
		case *wire.OpenBatchMsg:
			answer(p.c, m.ReqID, p.answerOpenBatch(m))
		case *wire.ReleaseBatchMsg:
			answer(p.c, m.ReqID, p.releaseBatch(m))
		case *wire.ByeMsg:
			p.mu.Lock()
			p.bye = true
			p.mu.Unlock()
			// Now, while the peer waits for the connection to close: it destroys its
			// release event after that.
			p.endRetentions()
			return nil, true
		default:
			return wire.ProtocolErr("unexpected %s from an importer", m.Kind()), true
		}
	}
}

// holdsLeases reports whether the peer holds any lease.
func (p *peer) holdsLeases() bool {
	p.mu.Lock()
	defer p.mu.Unlock()
	return len(p.leases) > 0
}

// shut closes the connection from the exporter's side; serve then returns, and so does
// a wait for a lost peer's exit.
func (p *peer) shut() {
	p.mu.Lock()
	p.closing = true
	p.mu.Unlock()
	// The peer destroys its release event once hung up on: what its released leases
	// left owed is settled first, and no End may be using the event meanwhile.
	p.ending.Lock()
	p.settleCompletions(true)
	_ = p.c.Close() // cleanup: nothing is left to do if closing fails
	p.ending.Unlock()
	p.stopExitWait()
}

// state describes the peer for Exporter.Peers and State.
func (p *peer) state() export.PeerState {
	s := export.PeerState{PID: p.pid(), Remote: p.remote(), Device: p.hello.Device.String(), ConnectedSince: p.since}
	if p.cred != nil {
		s.UID, s.GID = p.cred.UID, p.cred.GID
	}
	p.mu.Lock()
	defer p.mu.Unlock()
	s.AwaitingExit = p.awaitingExit
	for _, l := range p.leases {
		s.Leases++
		s.Grants += len(l.grants)
		s.BytesLeased += l.bytes
	}
	return s
}
