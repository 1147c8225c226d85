package wire

import (
	"context"
	"io"
	"net"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/cudapool/cudapool/internal/testwait"
)

// A send cut short by its context leaves part of a frame on the stream, which nothing
// can follow: send closes the connection, so the peer sees it end rather than read the
// next frame's bytes as the rest of this one.
func TestSendInterruptedMidFrameClosesConnection(t *testing.T) {
	a, b := net.Pipe()
	defer func() { _ = b.Close() }() // test cleanup
	c := NewConn(a, false)
	ctx, cancel := context.WithCancel(testCtx(t))
	defer cancel()
	sent := make(chan error, 1)
	go func() { sent <- c.Send(ctx, &StateRequestMsg{ReqID: 1}, -1) }()
	var first [1]byte
	_, err := io.ReadFull(b, first[:])
	require.NoError(t, err)
	cancel() // the frame's other bytes are still unread: the write is under way
	require.ErrorIs(t, testwait.Recv(t, sent, "the cancelled send to return"), context.Canceled, "send, want context.Canceled")
	_ = b.SetReadDeadline(time.Now().Add(hangGuard)) // test cleanup
	var rest [64]byte
	n, err := b.Read(rest[:])
	require.EqualValues(t, io.EOF, err, "after an interrupted send the peer read %d bytes, err %v; want the connection closed (io.EOF)", n, err)
}

// A send whose context ended before it began writes nothing, and the stream stays
// usable.
func TestSendWithEndedContextKeepsConnection(t *testing.T) {
	a, b := net.Pipe()
	defer func() { _ = b.Close() }() // test cleanup
	c := NewConn(a, false)
	defer func() { _ = c.Close() }() // test cleanup
	ctx, cancel := context.WithCancel(testCtx(t))
	cancel()
	require.ErrorIs(t, c.Send(ctx, &StateRequestMsg{ReqID: 1}, -1), context.Canceled, "send, want context.Canceled")
	go func() { _ = c.Send(context.Background(), &StateRequestMsg{ReqID: 2}, -1) }() // test cleanup
	got := make([]byte, HeaderLen+8)
	_, err := io.ReadFull(b, got)
	require.NoError(t, err)
	m, _, err := decodeFrame(got)
	require.NoError(t, err)
	r, ok := m.(*StateRequestMsg)
	require.False(t, !ok || r.ReqID != 2, "read %#v, want the second StateRequest", m)
}

// A send waiting for another to finish writing (to a peer that has stopped reading)
// gives up when its context ends, as a blocking call should.
func TestSendQueuedBehindStuckWriteHonoursContext(t *testing.T) {
	a, b := net.Pipe()
	defer func() { _ = b.Close() }() // test cleanup
	c := NewConn(a, false)
	defer func() { _ = c.Close() }()                                                 // test cleanup
	go func() { _ = c.Send(context.Background(), &StateRequestMsg{ReqID: 1}, -1) }() // test cleanup
	var first [1]byte
	_, err := io.ReadFull(b, first[:])
	require.NoError(t, err)
	// The first send now writes, and no one reads the rest.
	ctx, cancel := context.WithCancel(testCtx(t))
	cancel()
	sent := make(chan error, 1)
	go func() { sent <- c.Send(ctx, &StateRequestMsg{ReqID: 2}, -1) }()
	select {
	case err := <-sent:
		require.ErrorIs(t, err, context.Canceled, "send = %v, want context.Canceled", err)
	case <-time.After(hangGuard):
		t.Fatal("a send behind a stuck write ignored its ended context")
	}
}
