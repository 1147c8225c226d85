package session

import (
	"errors"
	"io"
	"net"
	"syscall"

	"golang.org/x/sys/unix"

	"github.com/cudapool/cudapool/internal/unixfd"
)

// Framing says how a protocol's frames lie on a stream: a header of HeaderLen bytes
// that tells the frame's length, then the rest of the frame.
type Framing struct {
	HeaderLen int
	// Len is the whole frame's length, header included, from its header h, or the
	// error of a header that breaks the protocol (a frame over max among them): the
	// stream cannot be read further.
	Len func(h []byte, max int) (int, error)
	// Ended is the error of a stream that ended after part, a frame begun and not
	// whole (need is the bytes the frame needs, 0 where the header is not whole).
	Ended func(part []byte, need int) error
	// Refused is the error of a frame that came with more descriptors than a read
	// takes, err (wrapping [unixfd.ErrUnexpectedFDs]) saying so; they were closed.
	Refused func(err error) error
}

// FrameReader takes whole frames from a stream: each read takes whatever has arrived
// into its buffer, so a frame costs one read where it arrives whole, and frames that
// arrive together cost one read between them. A read cut short (a deadline) loses
// nothing: the next Next goes on from where it stopped. On a Unix socket it takes the
// descriptors that come with the bytes (SCM_RIGHTS), at most MaxFDs a read (more are
// closed, and fail the frame they came with): a descriptor belongs to the frame that
// holds the last byte of the read that brought it, as a sender that attaches a frame's
// descriptor to the frame gets from the kernel. A FrameReader is not safe for
// concurrent use.
type FrameReader struct {
	f      Framing
	max    int // the largest frame taken
	maxFDs int

	buf    []byte
	lo, hi int   // buf[lo:hi] is read and not taken
	off    int64 // the stream offset of buf[lo]

	arrived []arrivedFD
	fd      int // the descriptor of the frame last returned, not taken; -1 none

	rx     unixfd.Receiver
	rawFor *net.UnixConn // the connection raw is of
	raw    syscall.RawConn
}

// arrivedFD is a descriptor that came with a read whose last byte is at stream offset
// last; fd -1 with err: what came was refused (and closed), and the frame fails.
type arrivedFD struct {
	fd   int
	last int64
	err  error
}

// minBuf is the buffer a FrameReader starts with, where its frames may be larger.
const minBuf = 16 << 10

// NewFrameReader returns a FrameReader of frames of f, at most max bytes each, that
// takes at most maxFDs descriptors a read.
func NewFrameReader(f Framing, max, maxFDs int) *FrameReader {
	return &FrameReader{f: f, max: max, maxFDs: maxFDs, fd: -1}
}

// SetMax makes r take frames of up to max bytes, keeping what it has buffered.
func (r *FrameReader) SetMax(max int) { r.max = max }

// Next returns the next whole frame from src, header included, aliasing the
// FrameReader's buffer until the next call; a descriptor that came with it is
// [FrameReader.TakeFD]'s, and one not taken by the next Next is closed. Without wait,
// where no whole frame has arrived, it fails with [ErrNoFrame] (on a source that is
// not a Unix socket, without reading). A frame that breaks the framing fails with
// Framing's error, a stream that ends inside a frame with Ended's, and one that ends
// between frames with io.EOF: the stream cannot be read further.
func (r *FrameReader) Next(src io.Reader, wait bool) ([]byte, error) {
	r.closeFD()
	for {
		need := r.f.HeaderLen
		if have := r.hi - r.lo; have >= need {
			n, err := r.f.Len(r.buf[r.lo:r.hi], r.max)
			if err != nil {
				return nil, err
			}
			if have >= n {
				return r.take(n)
			}
			need = n
		}
		if err := r.fill(src, need, wait); err != nil {
			if errors.Is(err, io.EOF) && r.hi > r.lo {
				if need == r.f.HeaderLen {
					need = 0
				}
				err = r.f.Ended(r.buf[r.lo:r.hi], need)
			}
			return nil, err
		}
	}
}

// take returns the whole frame of n bytes at buf[lo:], with its descriptor.
func (r *FrameReader) take(n int) ([]byte, error) {
	start, end := r.off, r.off+int64(n)
	frame := r.buf[r.lo : r.lo+n]
	r.lo += n
	r.off = end
	if r.lo == r.hi {
		r.lo, r.hi = 0, 0
	}
	for len(r.arrived) > 0 && r.arrived[0].last < end {
		a := r.arrived[0]
		r.arrived = r.arrived[1:]
		switch {
		case a.last < start: // an earlier frame's, not taken
			if a.fd >= 0 {
				_ = unix.Close(a.fd) // cleanup: a descriptor nobody asked for
			}
		case a.err != nil:
			return nil, a.err
		case r.fd >= 0: // a second for this frame, refused
			_ = unix.Close(a.fd) // cleanup: a descriptor nobody asked for
		default:
			r.fd = a.fd
		}
	}
	return frame, nil
}

// TakeFD returns the descriptor that came with the frame Next returned last, -1 if
// none did; the caller owns it.
func (r *FrameReader) TakeFD() int {
	fd := r.fd
	r.fd = -1
	return fd
}

func (r *FrameReader) closeFD() {
	if r.fd >= 0 {
		_ = unix.Close(r.fd) // cleanup: a descriptor nobody took
		r.fd = -1
	}
}

// Close closes the descriptors that arrived and were not taken; the FrameReader reads
// no more.
func (r *FrameReader) Close() {
	r.closeFD()
	for _, a := range r.arrived {
		if a.fd >= 0 {
			_ = unix.Close(a.fd) // cleanup: a descriptor nobody asked for
		}
	}
	r.arrived = nil
}

// Unread is how many bytes r has taken from its source past the last frame Next
// returned: with the bytes read so far, where in the stream that frame ended.
func (r *FrameReader) Unread() int { return r.hi - r.lo }

// Buffered reports whether a whole frame (or a header that breaks the framing) has
// been read and not taken: Next returns it without reading.
func (r *FrameReader) Buffered() bool {
	have := r.hi - r.lo
	if have < r.f.HeaderLen {
		return false
	}
	n, err := r.f.Len(r.buf[r.lo:r.hi], r.max)
	return err != nil || have >= n
}

// fill reads more bytes, with room for need bytes from buf[lo].
func (r *FrameReader) fill(src io.Reader, need int, wait bool) error {
	if len(r.buf)-r.lo < need {
		if len(r.buf) < need {
			grown := make([]byte, max(need, min(2*r.max, minBuf)))
			r.hi = copy(grown, r.buf[r.lo:r.hi])
			r.buf = grown
		} else {
			r.hi = copy(r.buf, r.buf[r.lo:r.hi])
		}
		r.lo = 0
	}
	n, fds, err := r.read(src, r.buf[r.hi:], wait)
	last := r.off + int64(r.hi-r.lo+n) - 1
	for _, fd := range fds {
		r.arrived = append(r.arrived, arrivedFD{fd: fd, last: last})
	}
	if n > 0 && errors.Is(err, unixfd.ErrUnexpectedFDs) {
		// The frame they came with fails, not the ones before it in this read.
		r.arrived = append(r.arrived, arrivedFD{fd: -1, last: last, err: r.f.Refused(err)})
	}
	r.hi += n
	if n > 0 {
		return nil // any other error shows again at the next read
	}
	if err == nil {
		err = io.ErrNoProgress
	}
	return err
}

// read reads what has arrived into b, with its descriptors, waiting for something
// unless wait is false (then ErrNoFrame says nothing had).
func (r *FrameReader) read(src io.Reader, b []byte, wait bool) (int, []int, error) {
	uc, ok := src.(*net.UnixConn)
	if !ok {
		if !wait {
			return 0, nil, ErrNoFrame
		}
		n, err := src.Read(b)
		return n, nil, err
	}
	if r.rawFor != uc {
		raw, err := uc.SyscallConn()
		if err != nil {
			return 0, nil, err
		}
		r.rawFor, r.raw = uc, raw
	}
	n, fds, err := r.rx.RecvRaw(r.raw, b, r.maxFDs, wait)
	switch {
	case errors.Is(err, unixfd.ErrWouldBlock):
		return 0, nil, ErrNoFrame
	case n == 0 && errors.Is(err, unixfd.ErrUnexpectedFDs):
		return 0, nil, r.f.Refused(err)
	}
	return n, fds, err // with n > 0, an ErrUnexpectedFDs is fill's to place
}
