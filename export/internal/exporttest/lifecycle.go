package exporttest

import (
	"net"
	"sync"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/cudapool/cudapool/export/internal/wire"
)

// PipeListener hands the exporter one end of in-memory pipes, which hold no bytes: a
// write to a peer that does not read blocks for certain.
type PipeListener struct {
	Conns chan net.Conn
	Done  chan struct{}
	Once  sync.Once
}

func NewPipeListener() *PipeListener {
	return &PipeListener{Conns: make(chan net.Conn), Done: make(chan struct{})}
}

func (l *PipeListener) Accept() (net.Conn, error) {
	select {
	case c := <-l.Conns:
		return c, nil
	case <-l.Done:
		return nil, net.ErrClosed
	}
}

func (l *PipeListener) Close() error {
	l.Once.Do(func() { close(l.Done) })
	return nil
}

func (l *PipeListener) Addr() net.Addr { return &net.UnixAddr{Name: "pipe", Net: "pipe"} }

// Dial connects a peer that says h, and returns it once admitted.
func (l *PipeListener) Dial(t *testing.T, h *wire.HelloMsg) *wire.Conn {
	t.Helper()
	a, b := net.Pipe()
	t.Cleanup(func() { _ = b.Close() }) // cleanup: what is tested is above
	l.Conns <- a
	c := wire.NewConn(b, true)
	require.NoError(t, c.Send(Ctx(t), h, -1))
	m, _, err := c.Recv()
	require.NoError(t, err, "handshake: %v %v", m, err)
	require.EqualValues(t, wire.MsgWelcome, m.Kind(), "handshake: %v %v", m, err)
	return c
}
