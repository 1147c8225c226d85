package wire

import (
	"context"
	"errors"
	"fmt"
	"net"
	"os"
	"sync/atomic"
	"time"

	"golang.org/x/sys/unix"

	"github.com/cudapool/cudapool/cudart"
	"github.com/cudapool/cudapool/export"
	"github.com/cudapool/cudapool/internal/session"
)

// Conn is one side of a protocol connection: whole frames out one at a time, so that
// many goroutines can send on it, and frames in from the one goroutine that reads it.
type Conn struct {
	Nc net.Conn
	// Uc is nc as a Unix socket, which can carry descriptors; nil on a byte stream
	// such as TCP, where only FABRIC handles can travel.
	Uc *net.UnixConn
	// acceptsFDs: frames in may carry a pool's descriptor (the importer's side). On the
	// exporter's side any descriptor that arrives is closed and is a violation.
	acceptsFDs bool

	// w writes whole frames, each bounded by its caller's context, so a peer that
	// stopped reading holds up no caller past its deadline.
	w *session.Writer

	// fr takes whole frames in, and the descriptors that come with them.
	fr *session.FrameReader

	// draining: a write failed on the exporter's side, which now only reads what the
	// peer sent, each frame within drainWindow of the last.
	draining atomic.Bool

	// Received counts whole frames (Sent those out): what a share costs in messages.
	Received atomic.Int64
}

// drainWindow bounds how long the exporter goes on reading a connection it can no
// longer write to: frames the peer sent before it stalled (a Release, a Bye) are
// already in the socket and arrive at once; a peer that sends nothing more is given up
// on after this.
const drainWindow = 250 * time.Millisecond

func NewConn(nc net.Conn, acceptsFDs bool) *Conn {
	maxFDs := 0
	if acceptsFDs {
		maxFDs = 1 // a frame carries at most one
	}
	c := &Conn{Nc: nc, acceptsFDs: acceptsFDs, w: session.NewWriter(nc, 0), fr: session.NewFrameReader(framing, MaxFrame, maxFDs)}
	c.Uc, _ = nc.(*net.UnixConn)
	return c
}

// framing is the sharing protocol's on a stream ([session.Framing]).
var framing = session.Framing{
	HeaderLen: HeaderLen,
	Len: func(h []byte, _ int) (int, error) {
		_, n, err := parseHeader(h) // each type's bound
		return HeaderLen + n, err
	},
	Ended: func(part []byte, need int) error {
		if need == 0 {
			return ProtocolErr("truncated frame header: connection closed after %d of %d bytes", len(part), HeaderLen)
		}
		return ProtocolErr("truncated %s frame: connection closed after %d of %d payload bytes", MsgType(part[4]), len(part)-HeaderLen, need-HeaderLen)
	},
	Refused: func(err error) error { return ProtocolErr("%v", err) },
}

// Sent counts the whole frames written.
func (c *Conn) Sent() int64 { return c.w.Sent() }

// CanPassFDs reports whether this connection can carry a POSIX fd pool handle.
func (c *Conn) CanPassFDs() bool { return c.Uc != nil }

// Send writes m as one frame, with fd attached when fd >= 0. A context that ended
// before the write began fails it with nothing written, the stream intact. A failed or
// interrupted write may leave part of a frame on the stream, which nothing can follow:
// Send then ends the connection (abort), so the peer sees it end.
func (c *Conn) Send(ctx context.Context, m Message, fd int) error {
	if err := c.send(ctx, fd, func(b []byte) ([]byte, error) { return appendChecked(b, m) }); err != nil {
		return fmt.Errorf("cudapool: send %s: %w", m.Kind(), err)
	}
	return nil
}

// appendChecked appends m as one frame, or fails with nothing appended if the frame
// is past MaxFrame: the other side would cut the connection for it.
func appendChecked(b []byte, m Message) ([]byte, error) {
	start := len(b)
	b = AppendFrame(b, m)
	if len(b)-start > MaxFrame {
		return b[:start], fmt.Errorf("%w: a frame of %d bytes, past the frame limit of %d", export.ErrBadRequest, len(b)-start, MaxFrame)
	}
	return b, nil
}

func (c *Conn) send(ctx context.Context, fd int, fill func([]byte) ([]byte, error)) error {
	var err error
	switch {
	case fd < 0:
		err = c.w.Write(ctx, fill)
	case c.Uc == nil:
		return errors.New("a descriptor cannot travel on a byte stream") // nothing written
	default:
		err = c.w.WriteFD(ctx, fd, fill)
	}
	if err == nil {
		return nil
	}
	if errors.Is(err, session.ErrBroken) || errors.Is(err, session.ErrStalled) {
		c.abort()
	}
	return unaddressed(err)
}

// abort ends the connection after a failed write. The importer's side, and a byte
// stream, close it. The exporter's side on a Unix socket only stops writing (the peer
// reads the end of the stream) and drains: a peer that stalled may have sent a Release
// or Bye before, and throwing them away would pin its leases until its process exits.
func (c *Conn) abort() {
	if c.acceptsFDs || c.Uc == nil {
		_ = c.Nc.Close() // cleanup: nothing is left to do if closing fails
		return
	}
	if c.draining.Swap(true) {
		return
	}
	_ = c.Uc.CloseWrite()                                 // a courtesy to the peer; Close follows
	_ = c.Nc.SetReadDeadline(time.Now().Add(drainWindow)) // it fails only on a closed connection, which the next read or write reports
}

// Next is [Conn.Recv] as a [session.Client] reads it: with wait false, it fails with
// [session.ErrNoFrame] where no whole frame has arrived.
func (c *Conn) Next(wait bool) (Frame, error) {
	m, fd, err := c.next(wait)
	return Frame{M: m, FD: fd}, err
}

// Buffered reports whether a whole frame (or a malformed header) has been read and
// not yet taken: Next returns it without reading.
func (c *Conn) Buffered() bool { return c.fr.Buffered() }

// Recv reads the next frame, waiting for it. fd is the descriptor that came with a
// POSIX fd PoolHandle, close-on-exec and owned by the caller, else -1. A descriptor on
// any other frame, a PoolHandle without one, and every malformed frame are errors
// wrapping ErrProtocol, after which the connection must be closed; the descriptors
// involved have been closed. A peer that closed between frames gives io.EOF. A read
// cut short by a deadline loses nothing: the next read goes on from there.
func (c *Conn) Recv() (Message, int, error) { return c.next(true) }

func (c *Conn) next(wait bool) (m Message, fd int, err error) {
	f, err := c.fr.Next(c.Nc, wait)
	if err != nil {
		if err != session.ErrNoFrame && !errors.Is(err, os.ErrDeadlineExceeded) {
			c.fr.Close() // the connection ends: nothing will claim them
		}
		return nil, -1, unaddressed(err)
	}
	fd = c.fr.TakeFD()
	t := MsgType(f[4])
	if m, err = DecodePayload(t, f[HeaderLen:]); err != nil {
		closeFD(fd)
		c.fr.Close()
		return nil, -1, err
	}
	c.Received.Add(1)
	wantFD := false
	if ph, ok := m.(*PoolHandleMsg); ok && ph.HandleType == cudart.HandleTypePosixFD {
		wantFD = true
	}
	if ch, ok := m.(*ChunkHandleMsg); ok && ch.HandleType == cudart.HandleTypePosixFD {
		wantFD = true
	}
	switch {
	case fd >= 0 && wantFD:
		return m, fd, nil
	case fd >= 0:
		closeFD(fd)
		c.fr.Close()
		return nil, -1, ProtocolErr("%s arrived with %d unexpected descriptors", t, 1)
	case wantFD:
		c.fr.Close()
		return nil, -1, ProtocolErr("POSIX fd %s arrived with 0 descriptors, want 1", t)
	}
	if c.draining.Load() {
		_ = c.Nc.SetReadDeadline(time.Now().Add(drainWindow)) // it fails only on a closed connection, which the next read or write reports
	}
	return m, -1, nil
}

// closeFD closes fd, if it is one.
func closeFD(fd int) {
	if fd >= 0 {
		_ = unix.Close(fd) // cleanup: the descriptor is ours and unused
	}
}

func (c *Conn) Close() error { return c.Nc.Close() }

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

func CloseFDs(fds []int) {
	for _, fd := range fds {
		_ = unix.Close(fd) // cleanup: the descriptor is ours and unused
	}
}
