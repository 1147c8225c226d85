package producer

import (
	"context"
	"testing"
	"time"

	"github.com/cudapool/cudapool/export"
	"github.com/cudapool/cudapool/export/internal/wire"
	"github.com/cudapool/cudapool/pool"
)

// ConnCount is how many connections are in their handshake, and how many admitted.
func (ex *Exporter) ConnCount() (handshakes, admitted int) { return ex.srv.Count() }

// SetWriteTimeout bounds the exporters' writes to a peer by d instead of 10 s, until
// the returned func undoes it. Set it, and undo it, while no exporter serves.
func SetWriteTimeout(d time.Duration) (undo func()) {
	old := writeTimeout
	writeTimeout = d
	return func() { writeTimeout = old }
}

// SetConnIDLimit makes the id spaces of exporters the test starts from now on n
// connections long.
func SetConnIDLimit(t *testing.T, n uint32) {
	old := connIDLimit
	connIDLimit = n
	t.Cleanup(func() { connIDLimit = old })
}

// SetFrameHook makes hook see every frame a peer sends before it is handled, until
// the test ends: a hook that panics stands for a handler that does.
func SetFrameHook(t *testing.T, hook func(wire.Message)) {
	frameHook = hook
	t.Cleanup(func() { frameHook = nil })
}

// ConnIDBits is the width of a connection's number in its lease ids.
const ConnIDBits = connIDBits

// PeerList is the Exporter's peers, for the tests that drive one directly.
func (ex *Exporter) PeerList() []*peer { return ex.peerList() }

// Lookup is the publication under name.
func (ex *Exporter) Lookup(name string) (*publication, error) { return ex.lookup(name) }

// PublishedBuffer is the buffer published under name, nil if none is.
func (ex *Exporter) PublishedBuffer(name string) *pool.Buffer {
	ex.mu.Lock()
	defer ex.mu.Unlock()
	if pub := ex.pubs[name]; pub != nil {
		return pub.buf
	}
	return nil
}

// PublishedCount is how many names are published.
func (ex *Exporter) PublishedCount() int {
	ex.mu.Lock()
	defer ex.mu.Unlock()
	return len(ex.pubs)
}

// Push pushes pub to the peer, as Exporter.Push does.
func (p *peer) Push(ctx context.Context, pub *publication) error { return p.push(ctx, pub) }

// Grant grants pub to the peer without sending it.
func (p *peer) Grant(ctx context.Context, pub *publication, reqID uint64) (wire.LeaseMsg, *pool.Lease, error) {
	return p.grant(ctx, pub, reqID)
}

// ReleaseUnsent gives back a grant whose frame did not go out.
func (p *peer) ReleaseUnsent(id uint64, pl *pool.Lease) { p.releaseUnsent(id, pl) }

// State is the peer's PeerState.
func (p *peer) State() export.PeerState { return p.state() }

// HangUp closes the peer's connection, as the exporter's side of a crash.
func (p *peer) HangUp() error { return p.c.Close() }

// EndGrantsEarly ends the pool lease of every grant the peer holds, in the wrong order
// (before the importer freed its import), for the tests that the software device
// catches it.
func (p *peer) EndGrantsEarly() {
	p.mu.Lock()
	defer p.mu.Unlock()
	for _, g := range p.leases {
		for _, l := range g.grants {
			_ = l.End(0) // the wrong order is the point; its error is not
		}
	}
}
