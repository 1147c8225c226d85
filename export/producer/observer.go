package producer

import (
	"errors"
	"fmt"
	"io"
	"net"

	"github.com/cudapool/cudapool/export"
	"github.com/cudapool/cudapool/export/internal/wire"
)

// observer is the exporter's side of a connection that takes no leases: one made for
// State alone (QueryState's, cmd/poolstat's). It holds nothing, so it is not a peer:
// it is neither listed nor pushed to, and Close does not wait for it.
type observer struct {
	ex  *Exporter
	c   *wire.Conn
	pid int
}

// serve answers the observer's requests until the connection ends.
func (o *observer) serve() {
	defer o.leave()
	for {
		m, _, err := o.c.Recv()
		if err != nil {
			if !errors.Is(err, io.EOF) && !errors.Is(err, net.ErrClosed) {
				o.ex.log.Warn("producer: closing observer connection", "pid", o.pid, "reason", err)
			}
			return
		}
		switch m := m.(type) {
		case *wire.StateRequestMsg:
			answer(o.c, m.ReqID, o.ex.sendState(o.c, m.ReqID))
		case *wire.OpenMsg:
			answer(o.c, m.ReqID, fmt.Errorf("%w: open %q", export.ErrNoLeases, m.Name))
		case *wire.ReleaseMsg:
			answer(o.c, m.ReqID, fmt.Errorf("%w: release of lease %#x", export.ErrNoLeases, m.LeaseID))
		case *wire.ByeMsg:
			return
		default:
			o.ex.log.Warn("producer: closing observer connection", "pid", o.pid, "reason", wire.ProtocolErr("unexpected %s from an observer", m.Kind()))
			return
		}
	}
}

// leave closes the connection and forgets the observer.
func (o *observer) leave() {
	_ = o.c.Close() // cleanup: nothing is left to do if closing fails
	o.ex.mu.Lock()
	delete(o.ex.observers, o)
	o.ex.mu.Unlock()
}

// answer sends an Error frame for a failed request; a request that succeeded has sent
// its own reply.
func answer(c *wire.Conn, reqID uint64, err error) {
	if err == nil {
		return
	}
	ctx, cancel := bounded()
	defer cancel()
	_ = c.Send(ctx, wire.ErrorFor(reqID, err), -1) // the peer may be gone already; a write past the bound ends the connection
}
