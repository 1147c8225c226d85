package export

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net"
)

// observer is the exporter's side of a connection that takes no leases: one made for
// State alone (QueryState's, cmd/poolstat's). It holds nothing, so it is not a peer:
// it is neither listed nor pushed to, and Close does not wait for it.
type observer struct {
	ex  *Exporter
	c   *conn
	pid int
}

// serve answers the observer's requests until the connection ends.
func (o *observer) serve() {
	defer o.leave()
	for {
		m, _, err := o.c.recv()
		if err != nil {
			if !errors.Is(err, io.EOF) && !errors.Is(err, net.ErrClosed) {
				o.ex.log.Warn("export: closing observer connection", "pid", o.pid, "reason", err)
			}
			return
		}
		switch m := m.(type) {
		case *stateRequestMsg:
			answer(o.c, m.ReqID, o.ex.sendState(o.c, m.ReqID))
		case *openMsg:
			answer(o.c, m.ReqID, fmt.Errorf("%w: open %q", ErrNoLeases, m.Name))
		case *releaseMsg:
			answer(o.c, m.ReqID, fmt.Errorf("%w: release of lease %#x", ErrNoLeases, m.LeaseID))
		case *byeMsg:
			return
		default:
			o.ex.log.Warn("export: closing observer connection", "pid", o.pid, "reason", protocolErr("unexpected %s from an observer", m.kind()))
			return
		}
	}
}

// leave closes the connection and forgets the observer.
func (o *observer) leave() {
	o.c.close()
	o.ex.mu.Lock()
	delete(o.ex.observers, o)
	o.ex.mu.Unlock()
}

// answer sends an Error frame for a failed request; a request that succeeded has sent
// its own reply.
func answer(c *conn, reqID uint64, err error) {
	if err == nil {
		return
	}
	c.send(context.Background(), errorFor(reqID, err), -1)
}
