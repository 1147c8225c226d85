package session

import (
	"context"
	"errors"
	"fmt"
	"net"
	"os"
	"syscall"
	"time"
)

// DialBackoffMin and DialBackoffMax bound the backoff of a dial that waits for a
// server: it tries again after 5 ms, doubling to 500 ms.
const (
	DialBackoffMin = 5 * time.Millisecond
	DialBackoffMax = 500 * time.Millisecond
)

// Dial connects to the Unix socket at path. With wait, a dial that fails is tried
// again with backoff (DialBackoffMin to DialBackoffMax) until ctx ends; the error is
// then ctx's, joined with the last dial's.
func Dial(ctx context.Context, path string, wait bool) (*net.UnixConn, error) {
	var nc *net.UnixConn
	dial := func() (bool, error) {
		var d net.Dialer
		c, err := d.DialContext(ctx, "unix", path)
		if err != nil {
			return wait, err
		}
		nc = c.(*net.UnixConn)
		return false, nil
	}
	last, ctxErr := Retry(ctx, DialBackoffMin, DialBackoffMax, errors.New("no dial was tried before the deadline"), dial)
	if ctxErr != nil {
		return nil, errors.Join(ctxErr, last)
	}
	return nc, last
}

// Retry calls try until it succeeds, fails with an error not worth waiting on (again
// false), or ctx ends, waiting between calls with backoff from first to most. It
// returns try's last error, or, once ctx has ended (while waiting, or cutting a try
// short), the last error worth waiting on, and ctx's error. If ctx ended before any
// try got as far as an error worth waiting on (a loaded machine can run the first try
// after the deadline), that error is notYet: what the caller waited for never came,
// which is all a caller can say, and all it needs to.
func Retry(ctx context.Context, first, most time.Duration, notYet error, try func() (again bool, err error)) (last, ctxErr error) {
	delay := first
	t := time.NewTimer(0)
	<-t.C
	defer t.Stop()
	waitedOn := notYet
	for {
		again, err := try()
		if again {
			waitedOn = err
		}
		if err != nil && ctx.Err() != nil {
			return waitedOn, ctx.Err()
		}
		if !again {
			return err, nil
		}
		t.Reset(delay)
		select {
		case <-t.C:
		case <-ctx.Done():
			return waitedOn, ctx.Err()
		}
		delay = min(2*delay, most)
	}
}

// ErrBroken means a write was cut short inside a frame: the peer cannot find the next
// frame's start, so the connection must be closed.
var ErrBroken = errors.New("a write was cut short inside a frame")

// Writer sends whole frames on a connection, one at a time, each bounded by its
// caller's context: the wait for the previous write and the write itself. Its methods
// are safe for concurrent use.
type Writer struct {
	nc      net.Conn
	timeout time.Duration
	turn    chan struct{} // holds a value while a write is under way
	buf     []byte        // used by the writer holding the turn
	broken  error         // set by the writer holding the turn, read with it
}

// NewWriter returns a Writer on nc; timeout, if not zero, bounds each write whose
// context has no earlier deadline.
func NewWriter(nc net.Conn, timeout time.Duration) *Writer {
	return &Writer{nc: nc, timeout: timeout, turn: make(chan struct{}, 1)}
}

// Write sends the frame fill appends to the Writer's buffer. If ctx ends (or the
// timeout passes) before any of it was written, it fails with ctx's error (or
// os.ErrDeadlineExceeded), and the connection carries on. If it ends inside the frame,
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
		woken := make(chan struct{})
		stop := context.AfterFunc(ctx, func() {
			_ = w.nc.SetWriteDeadline(time.Unix(1, 0)) // it only wakes the write
			close(woken)
		})
		defer func() {
			if !stop() {
				<-woken // so that no later write's deadline is cut by this one's
			}
		}()
	}
	n, err := w.send(b, oob)
	if err == nil {
		return nil
	}
	if n == 0 && errors.Is(err, os.ErrDeadlineExceeded) {
		switch {
		case ctx.Err() != nil:
			return ctx.Err()
		case ctxDeadline: // the socket's timer can fire before ctx's
			return context.DeadlineExceeded
		}
		return fmt.Errorf("the write did not start within %v: %w", w.timeout, err)
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
