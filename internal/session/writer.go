package session

import (
	"context"
	"errors"
	"fmt"
	"net"
	"os"
	"sync/atomic"
	"syscall"
	"time"
)

// ErrBroken means a write was cut short inside a frame: the peer cannot find the next
// frame's start, so the connection must be closed.
var ErrBroken = errors.New("a write was cut short inside a frame")

// ErrStalled means a write's bound passed before the peer took any of the frame:
// nothing was written and the stream is intact, but the peer does not read; a server
// gives up on such a peer.
var ErrStalled = errors.New("the peer took nothing of the frame within the write's bound")

// Writer sends whole frames on a connection, one at a time, each bounded by its
// caller's context: the wait for the previous write and the write itself. Its methods
// are safe for concurrent use.
type Writer struct {
	nc      net.Conn
	timeout time.Duration
	turn    chan struct{} // holds a value while a write is under way
	buf     []byte        // used by the writer holding the turn
	broken  error         // set by the writer holding the turn, read with it
	sent    atomic.Int64  // frames written whole
	cut     cut           // the present write, cut short when its ctx ends
}

// NewWriter returns a Writer on nc; timeout, if not zero, bounds each write whose
// context has no earlier deadline.
func NewWriter(nc net.Conn, timeout time.Duration) *Writer {
	return &Writer{nc: nc, timeout: timeout, turn: make(chan struct{}, 1), cut: cut{set: nc.SetWriteDeadline}}
}

// Sent is the number of frames written whole.
func (w *Writer) Sent() int64 { return w.sent.Load() }

// Write sends the frame fill appends to the Writer's buffer. If ctx ends (or the
// timeout passes) before any of it was written, it fails with ctx's error (or
// os.ErrDeadlineExceeded), and the connection carries on; if the write had begun, the
// error wraps [ErrStalled] too. If it ends inside the frame,
// or the write fails, it fails with an error wrapping ErrBroken and the write's error,
// and so does every later Write: the caller closes the connection. An error from fill
// is returned as it is, with nothing written.
func (w *Writer) Write(ctx context.Context, fill func([]byte) ([]byte, error)) error {
	return w.write(ctx, fill, nil)
}

// WriteFD is Write of a frame that carries descriptor fd with its first byte
// (SCM_RIGHTS), on a Writer made on a *net.UnixConn; the caller keeps fd. It fails as
// Write does, and with an error wrapping ErrBroken on another kind of connection.
func (w *Writer) WriteFD(ctx context.Context, fd int, fill func([]byte) ([]byte, error)) error {
	return w.write(ctx, fill, syscall.UnixRights(fd))
}

func (w *Writer) write(ctx context.Context, fill func([]byte) ([]byte, error), oob []byte) error {
	select {
	case w.turn <- struct{}{}:
	default:
		select {
		case w.turn <- struct{}{}:
		case <-ctx.Done():
			return ctx.Err()
		}
	}
	defer func() { <-w.turn }()
	if w.broken != nil {
		return w.broken
	}
	b, err := fill(w.buf[:0])
	w.buf = b[:0]
	if err != nil {
		return err
	}
	deadline, has := ctx.Deadline()
	ctxDeadline := has // the deadline in effect is ctx's
	if w.timeout > 0 {
		if d := time.Now().Add(w.timeout); !has || d.Before(deadline) {
			deadline, has, ctxDeadline = d, true, false
		}
	}
	if !has {
		deadline = time.Time{}
	}
	_ = w.nc.SetWriteDeadline(deadline) // it fails only on a closed connection, which the write reports
	if ctx.Done() != nil {
		if err := ctx.Err(); err != nil {
			return err
		}
		defer w.cut.disarm(w.cut.arm(ctx), false) // the next write sets its own deadline
	}
	n, err := w.send(b, oob)
	if err == nil {
		w.sent.Add(1)
		return nil
	}
	if n == 0 && errors.Is(err, os.ErrDeadlineExceeded) {
		switch {
		case ctx.Err() != nil:
			return fmt.Errorf("%w: %w", ErrStalled, ctx.Err())
		case ctxDeadline: // the socket's timer can fire before ctx's
			return fmt.Errorf("%w: %w", ErrStalled, context.DeadlineExceeded)
		}
		return fmt.Errorf("%w: the write did not start within %v: %w", ErrStalled, w.timeout, err)
	}
	if errors.Is(err, os.ErrDeadlineExceeded) && ctx.Err() != nil {
		err = ctx.Err() // what cut it
	}
	w.broken = fmt.Errorf("%w (%d of %d bytes): %w", ErrBroken, n, len(b), err)
	return w.broken
}

// send writes b, the descriptors of oob with its first byte where oob is not nil.
func (w *Writer) send(b, oob []byte) (int, error) {
	if oob == nil {
		return w.nc.Write(b)
	}
	uc, ok := w.nc.(*net.UnixConn)
	if !ok {
		return 0, fmt.Errorf("descriptors cannot go over a %T", w.nc)
	}
	n, _, err := uc.WriteMsgUnix(b, oob, nil)
	if err == nil && n < len(b) { // the rest, as Write would go on
		var m int
		m, err = w.nc.Write(b[n:])
		n += m
	}
	return n, err
}
