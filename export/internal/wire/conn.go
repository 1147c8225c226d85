package wire

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"sync/atomic"
	"syscall"
	"time"

	"golang.org/x/sys/unix"

	"github.com/cudapool/cudapool/cudart"
	"github.com/cudapool/cudapool/export"
	"github.com/cudapool/cudapool/internal/session"
	"github.com/cudapool/cudapool/internal/unixfd"
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

	// Frames in: in[lo:hi] holds bytes read and not yet taken, often several frames or
	// part of one, so that a frame costs one read, not one for its header and one for
	// its payload; inOff is the stream offset of in[lo]. arrived holds the descriptors
	// that came with them.
	in      []byte
	lo, hi  int
	inOff   uint64
	arrived []arrivedFD
	// rx keeps the control buffer between reads.
	rx unixfd.Receiver
	// raw is the Unix socket's descriptor, which reads go through; nil on a byte stream.
	raw syscall.RawConn

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
	c := &Conn{Nc: nc, acceptsFDs: acceptsFDs, w: session.NewWriter(nc, 0)}
	if c.Uc, _ = nc.(*net.UnixConn); c.Uc != nil {
		var err error
		if c.raw, err = c.Uc.SyscallConn(); err != nil {
			c.Uc = nil // closed already: reads fail as on any closed connection
		}
	}
	return c
}

// arrivedFD is a descriptor that came with the bytes at stream offsets [from, to). It
// belongs to the last frame that starts there: a sender attaches a frame's descriptor
// to the frame's first byte, and the kernel ends a read after the bytes that carried
// descriptors.
type arrivedFD struct {
	fd       int
	from, to uint64
	// err: what came was refused (and closed), fd is -1; the frame fails with err.
	err error
}

// inSize is the read buffer's size to start with; a larger frame grows it.
const inSize = 16 << 10

// errRefusedFDs marks a read whose descriptors were refused (and closed).
var errRefusedFDs = errors.New("descriptors refused")

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
func (c *Conn) Buffered() bool { return c.hasFrame() }

// Recv reads the next frame, waiting for it. fd is the descriptor that came with a
// POSIX fd PoolHandle, close-on-exec and owned by the caller, else -1. A descriptor on
// any other frame, a PoolHandle without one, and every malformed frame are errors
// wrapping ErrProtocol, after which the connection must be closed; the descriptors
// involved have been closed. A peer that closed between frames gives io.EOF. A read
// cut short by a deadline loses nothing: the next read goes on from there.
func (c *Conn) Recv() (Message, int, error) { return c.next(true) }

func (c *Conn) next(wait bool) (m Message, fd int, err error) {
	defer func() {
		if err != nil && err != session.ErrNoFrame && !errors.Is(err, os.ErrDeadlineExceeded) {
			c.dropFDs() // the connection ends: nothing will claim them
		}
	}()
	for {
		need := HeaderLen
		if c.hi-c.lo >= HeaderLen {
			t, n, err := parseHeader(c.in[c.lo:c.hi])
			if err != nil {
				return nil, -1, err
			}
			if c.hi-c.lo >= HeaderLen+n {
				return c.take(t, n)
			}
			need = HeaderLen + n
		}
		if err := c.fill(need, wait); err != nil {
			switch have := c.hi - c.lo; {
			case !errors.Is(err, io.EOF) || have == 0:
			case have < HeaderLen:
				err = ProtocolErr("truncated frame header: connection closed after %d of %d bytes", have, HeaderLen)
			default:
				err = ProtocolErr("truncated %s frame: connection closed after %d of %d payload bytes", MsgType(c.in[c.lo+4]), have-HeaderLen, need-HeaderLen)
			}
			return nil, -1, err
		}
	}
}

func (c *Conn) hasFrame() bool {
	if c.hi-c.lo < HeaderLen {
		return false
	}
	_, n, err := parseHeader(c.in[c.lo:c.hi])
	return err != nil || c.hi-c.lo >= HeaderLen+n
}

// take decodes the whole frame at in[lo:] and gives it its descriptor, if it has one.
func (c *Conn) take(t MsgType, n int) (Message, int, error) {
	at := c.inOff
	p := c.in[c.lo+HeaderLen : c.lo+HeaderLen+n]
	c.lo += HeaderLen + n
	c.inOff += uint64(HeaderLen + n)
	m, err := DecodePayload(t, p)
	if err != nil {
		return nil, -1, err
	}
	c.Received.Add(1)
	wantFD := false
	if ph, ok := m.(*PoolHandleMsg); ok && ph.HandleType == cudart.HandleTypePosixFD {
		wantFD = true
	}
	// The next descriptor is this frame's if it came with the bytes where this frame
	// starts and no later frame starts there (this one reaches the read's end).
	owns := len(c.arrived) > 0 && c.arrived[0].from <= at && c.inOff >= c.arrived[0].to
	switch {
	case owns && c.arrived[0].err != nil:
		return nil, -1, c.arrived[0].err
	case owns && wantFD:
		fd := c.arrived[0].fd
		c.arrived = c.arrived[1:]
		return m, fd, nil
	case owns:
		return nil, -1, ProtocolErr("%s arrived with %d unexpected descriptors", t, 1)
	case wantFD:
		return nil, -1, ProtocolErr("POSIX fd PoolHandle arrived with 0 descriptors, want 1")
	}
	if c.draining.Load() {
		_ = c.Nc.SetReadDeadline(time.Now().Add(drainWindow)) // it fails only on a closed connection, which the next read or write reports
	}
	return m, -1, nil
}

// fill reads more bytes, with room for need bytes from in[lo].
func (c *Conn) fill(need int, wait bool) error {
	if c.lo == c.hi {
		c.lo, c.hi = 0, 0
	}
	if len(c.in)-c.lo < need {
		if len(c.in) < need {
			grown := make([]byte, max(need, inSize))
			copy(grown, c.in[c.lo:c.hi])
			c.in = grown
		} else {
			copy(c.in, c.in[c.lo:c.hi])
		}
		c.hi -= c.lo
		c.lo = 0
	}
	n, fds, err := c.read(c.in[c.hi:], wait)
	from := c.inOff + uint64(c.hi-c.lo)
	for _, fd := range fds {
		c.arrived = append(c.arrived, arrivedFD{fd: fd, from: from, to: from + uint64(n)})
	}
	if n > 0 && errors.Is(err, errRefusedFDs) {
		// The frame they came with fails, not the ones before it in this read.
		c.arrived = append(c.arrived, arrivedFD{fd: -1, from: from, to: from + uint64(n), err: err})
	}
	c.hi += n
	if n > 0 {
		return nil // any other error shows again at the next read
	}
	return err
}

// read reads what has arrived into b, waiting for something unless wait is false (then
// session.ErrNoFrame says nothing had).
func (c *Conn) read(b []byte, wait bool) (int, []int, error) {
	if c.Uc == nil {
		n, err := c.Nc.Read(b)
		return n, nil, unaddressed(err)
	}
	maxFDs := 0
	if c.acceptsFDs {
		maxFDs = 1 // a frame carries at most one
	}
	n, fds, err := c.rx.RecvRaw(c.raw, b, maxFDs, wait)
	switch {
	case errors.Is(err, unixfd.ErrUnexpectedFDs):
		return n, nil, fmt.Errorf("%w: %w", errRefusedFDs, ProtocolErr("%v", err))
	case errors.Is(err, unixfd.ErrWouldBlock):
		return 0, nil, session.ErrNoFrame
	}
	return n, fds, unaddressed(err)
}

// dropFDs closes the descriptors that arrived and were not taken.
func (c *Conn) dropFDs() {
	for _, a := range c.arrived {
		_ = unix.Close(a.fd) // cleanup: the descriptor is ours and unused
	}
	c.arrived = nil
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
