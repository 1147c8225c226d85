package export

import (
	"context"
	"errors"
	"io"
	"net"
	"testing"
	"time"
)

// A send cut short by its context leaves part of a frame on the stream, which nothing
// can follow: send closes the connection, so the peer sees it end rather than read the
// next frame's bytes as the rest of this one.
func TestSendInterruptedMidFrameClosesConnection(t *testing.T) {
	a, b := net.Pipe()
	defer b.Close()
	c := newConn(a, false)
	ctx, cancel := context.WithCancel(testCtx(t))
	defer cancel()
	sent := make(chan error, 1)
	go func() { sent <- c.send(ctx, &stateRequestMsg{ReqID: 1}, -1) }()
	var first [1]byte
	if _, err := io.ReadFull(b, first[:]); err != nil {
		t.Fatal(err)
	}
	cancel() // the frame's other bytes are still unread: the write is under way
	if err := <-sent; !errors.Is(err, context.Canceled) {
		t.Fatalf("send = %v, want context.Canceled", err)
	}
	b.SetReadDeadline(time.Now().Add(hangGuard))
	var rest [64]byte
	if n, err := b.Read(rest[:]); err != io.EOF {
		t.Fatalf("after an interrupted send the peer read %d bytes, err %v; want the connection closed (io.EOF)", n, err)
	}
}

// A send whose context ended before it began writes nothing, and the stream stays
// usable.
func TestSendWithEndedContextKeepsConnection(t *testing.T) {
	a, b := net.Pipe()
	defer b.Close()
	c := newConn(a, false)
	defer c.close()
	ctx, cancel := context.WithCancel(testCtx(t))
	cancel()
	if err := c.send(ctx, &stateRequestMsg{ReqID: 1}, -1); !errors.Is(err, context.Canceled) {
		t.Fatalf("send = %v, want context.Canceled", err)
	}
	go c.send(context.Background(), &stateRequestMsg{ReqID: 2}, -1)
	got := make([]byte, headerLen+8)
	if _, err := io.ReadFull(b, got); err != nil {
		t.Fatal(err)
	}
	m, _, err := decodeFrame(got)
	if err != nil {
		t.Fatal(err)
	}
	if r, ok := m.(*stateRequestMsg); !ok || r.ReqID != 2 {
		t.Fatalf("read %#v, want the second StateRequest", m)
	}
}

// A send waiting for another to finish writing (to a peer that has stopped reading)
// gives up when its context ends, as a blocking call should.
func TestSendQueuedBehindStuckWriteHonoursContext(t *testing.T) {
	a, b := net.Pipe()
	defer b.Close()
	c := newConn(a, false)
	defer c.close()
	go c.send(context.Background(), &stateRequestMsg{ReqID: 1}, -1)
	var first [1]byte
	if _, err := io.ReadFull(b, first[:]); err != nil {
		t.Fatal(err)
	}
	// The first send now writes, and no one reads the rest.
	ctx, cancel := context.WithCancel(testCtx(t))
	cancel()
	sent := make(chan error, 1)
	go func() { sent <- c.send(ctx, &stateRequestMsg{ReqID: 2}, -1) }()
	select {
	case err := <-sent:
		if !errors.Is(err, context.Canceled) {
			t.Fatalf("send = %v, want context.Canceled", err)
		}
	case <-time.After(hangGuard):
		t.Fatal("a send behind a stuck write ignored its ended context")
	}
}
