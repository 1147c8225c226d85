package export

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"sync/atomic"
	"time"

	"github.com/cudapool/cudapool/cudart"
	"github.com/cudapool/cudapool/internal/unixfd"
	"golang.org/x/sync/semaphore"
	"golang.org/x/sys/unix"
)

// conn is one side of a protocol connection: whole frames out one at a time, so that
// many goroutines can send on it, and frames in from the one goroutine that reads it.
type conn struct {
	nc net.Conn
	// uc is nc as a Unix socket, which can carry descriptors; nil on a byte stream
	// such as TCP, where only FABRIC handles can travel.
	uc *net.UnixConn
	// acceptsFDs: frames in may carry a pool's descriptor (the importer's side). On the
	// exporter's side any descriptor that arrives is closed and is a violation.
	acceptsFDs bool

	// wlock is held while a frame is written: unlike a mutex, waiting for it ends with
	// the waiter's context, so a peer that stopped reading holds up no caller past its
	// deadline.
	wlock *semaphore.Weighted
	wbuf  []byte

	hdr  [headerLen]byte
	rbuf []byte
	// rx keeps the control buffer between reads: recv runs per frame.
	rx unixfd.Receiver

	// draining: a write failed on the exporter's side, which now only reads what the
	// peer sent, each frame within drainWindow of the last.
	draining atomic.Bool

	// sent and received count whole frames: what a share costs in messages.
	sent, received atomic.Int64
}

// drainWindow bounds how long the exporter goes on reading a connection it can no
// longer write to: frames the peer sent before it stalled (a Release, a Bye) are
// already in the socket and arrive at once; a peer that sends nothing more is given up
// on after this.
const drainWindow = 250 * time.Millisecond

func newConn(nc net.Conn, acceptsFDs bool) *conn {
	c := &conn{nc: nc, acceptsFDs: acceptsFDs, wlock: semaphore.NewWeighted(1)}
	c.uc, _ = nc.(*net.UnixConn)
	return c
}

// canPassFDs reports whether this connection can carry a POSIX fd pool handle.
func (c *conn) canPassFDs() bool { return c.uc != nil }

// send writes m as one frame, with fd attached when fd >= 0. A context that ended
// before the write began fails it with nothing written, the stream intact. A failed or
// interrupted write may leave part of a frame on the stream, which nothing can follow:
// send then ends the connection (abort), so the peer sees it end.
func (c *conn) send(ctx context.Context, m message, fd int) error {
	if err := c.wlock.Acquire(ctx, 1); err != nil {
		return fmt.Errorf("export: send %s: %w", m.kind(), err) // nothing written: the stream is intact
	}
	defer c.wlock.Release(1)
	if err := ctx.Err(); err != nil { // Acquire may succeed with ctx already ended
		return fmt.Errorf("export: send %s: %w", m.kind(), err) // nothing written
	}
	if ctx.Done() != nil {
		fired := make(chan struct{})
		stop := context.AfterFunc(ctx, func() {
			c.nc.SetWriteDeadline(time.Unix(1, 0))
			close(fired)
		})
		defer func() {
			if !stop() {
				<-fired // or it could set the deadline after it is cleared
				c.nc.SetWriteDeadline(time.Time{})
			}
		}()
	}
	c.wbuf = appendFrame(c.wbuf[:0], m)
	var err error
	switch {
	case fd >= 0 && c.uc != nil:
		err = unixfd.Send(c.uc, c.wbuf, fd)
	case fd >= 0:
		err = errors.New("a descriptor cannot travel on a byte stream")
	default:
		_, err = c.nc.Write(c.wbuf)
	}
	if err != nil {
		c.abort()
		if ctx.Err() != nil {
			err = ctx.Err()
		}
		err = unaddressed(err)
		return fmt.Errorf("export: send %s: %w", m.kind(), err)
	}
	c.sent.Add(1)
	return nil
}

// abort ends the connection after a failed write. The importer's side, and a byte
// stream, close it. The exporter's side on a Unix socket only stops writing (the peer
// reads the end of the stream) and drains: a peer that stalled may have sent a Release
// or Bye before, and throwing them away would pin its leases until its process exits.
func (c *conn) abort() {
	if c.acceptsFDs || c.uc == nil {
		c.nc.Close()
		return
	}
	if c.draining.Swap(true) {
		return
	}
	c.uc.CloseWrite()
	c.nc.SetReadDeadline(time.Now().Add(drainWindow))
}

// recv reads the next frame. fd is the descriptor that came with a POSIX fd
// PoolHandle, close-on-exec and owned by the caller, else -1. A descriptor on any other
// frame, a PoolHandle without one, and every malformed frame are errors wrapping
// ErrProtocol, after which the connection must be closed; the descriptors involved
// have been closed. A peer that closed between frames gives io.EOF.
func (c *conn) recv() (m message, fd int, err error) {
	var fds []int
	defer func() {
		if err != nil {
			closeFDs(fds)
		}
	}()
	if got, err := c.readFull(c.hdr[:], &fds); err != nil {
		if errors.Is(err, io.EOF) && got > 0 {
			err = protocolErr("truncated frame header: connection closed after %d of %d bytes", got, headerLen)
		}
		return nil, -1, err
	}
	t, n, err := parseHeader(c.hdr[:])
	if err != nil {
		return nil, -1, err
	}
	if cap(c.rbuf) < n {
		c.rbuf = make([]byte, n)
	}
	p := c.rbuf[:n]
	if got, err := c.readFull(p, &fds); err != nil {
		if errors.Is(err, io.EOF) {
			err = protocolErr("truncated %s frame: connection closed after %d of %d payload bytes", t, got, n)
		}
		return nil, -1, err
	}
	if m, err = decodePayload(t, p); err != nil {
		return nil, -1, err
	}
	c.received.Add(1)
	wantFD := 0
	if ph, ok := m.(*poolHandleMsg); ok && ph.HandleType == cudart.HandleTypePosixFD {
		wantFD = 1
	}
	switch {
	case len(fds) != wantFD && wantFD == 1:
		return nil, -1, protocolErr("POSIX fd PoolHandle arrived with %d descriptors, want 1", len(fds))
	case len(fds) != wantFD:
		return nil, -1, protocolErr("%s arrived with %d unexpected descriptors", t, len(fds))
	case wantFD == 1:
		return m, fds[0], nil
	}
	if c.draining.Load() {
		c.nc.SetReadDeadline(time.Now().Add(drainWindow))
	}
	return m, -1, nil
}

// readFull fills b, collecting the descriptors that arrive with its bytes, and says
// how many bytes it read.
func (c *conn) readFull(b []byte, fds *[]int) (int, error) {
	got := 0
	for got < len(b) {
		var n int
		var err error
		if c.uc != nil {
			maxFDs := 0
			if c.acceptsFDs {
				maxFDs = 1 // a frame carries at most one
			}
			var in []int
			n, in, err = c.rx.Recv(c.uc, b[got:], maxFDs)
			*fds = append(*fds, in...)
			if errors.Is(err, unixfd.ErrUnexpectedFDs) {
				return got + n, protocolErr("%v", err)
			}
		} else {
			n, err = c.nc.Read(b[got:])
		}
		got += n
		if err != nil && got < len(b) {
			return got, unaddressed(err)
		}
	}
	return got, nil
}

func (c *conn) close() error { return c.nc.Close() }

// unaddressed is err without the addresses a *net.OpError names: an exporter's socket
// is bound under a temporary name and then linked to its path (socket.go), and the
// kernel reports the temporary name as the peer's address, which means nothing to
// anyone. Errors name the path where they know it.
func unaddressed(err error) error {
	var op *net.OpError
	if errors.As(err, &op) && op.Err != nil {
		return fmt.Errorf("%s: %w", op.Op, op.Err)
	}
	return err
}

func closeFDs(fds []int) {
	for _, fd := range fds {
		unix.Close(fd)
	}
}
