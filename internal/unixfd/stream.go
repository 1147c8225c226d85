package unixfd

import (
	"net"

	"golang.org/x/sys/unix"
)

// Stream is a Unix stream connection's bytes, as an io.Reader for a reader of frames,
// with the descriptors that come with them. The kernel hands a message's descriptor to
// the read that takes the message's last byte or an earlier one of it, and ends that
// read inside the message, so a descriptor belongs to the frame holding the last byte
// of the read it came with: Take gives it to a frame that carries one, and Drop closes
// the others. A Stream takes at most one descriptor a message; a message with more
// fails its read (ErrUnexpectedFDs) with its bytes dropped, for the connection must
// close. A Stream is not safe for concurrent use.
type Stream struct {
	nc   *net.UnixConn
	recv Receiver
	off  int64    // bytes read so far
	fds  []sentFD // received, not yet taken or closed
}

// sentFD is a descriptor received and the stream offset of the last byte read with it.
type sentFD struct {
	fd   int
	last int64
}

// NewStream reads nc.
func NewStream(nc *net.UnixConn) *Stream { return &Stream{nc: nc} }

// Read reads what has arrived into b, noting the descriptor that came with it.
func (s *Stream) Read(b []byte) (int, error) {
	n, fds, err := s.recv.Recv(s.nc, b, 1)
	if err != nil {
		return 0, err // Recv closed what came with a message of more than one
	}
	s.off += int64(n)
	for _, fd := range fds {
		s.fds = append(s.fds, sentFD{fd: fd, last: s.off - 1})
	}
	return n, nil
}

// Offset is how many bytes Read has returned in all.
func (s *Stream) Offset() int64 { return s.off }

// Take returns the descriptor that came with the frame of bytes [start, end) of the
// stream, which the caller then owns, closing those that came before it; false if
// none did.
func (s *Stream) Take(start, end int64) (int, bool) {
	s.Drop(start)
	if len(s.fds) > 0 && s.fds[0].last < end {
		fd := s.fds[0].fd
		s.fds = s.fds[1:]
		return fd, true
	}
	return -1, false
}

// Drop closes the descriptors that came with bytes before offset end.
func (s *Stream) Drop(end int64) {
	k := 0
	for k < len(s.fds) && s.fds[k].last < end {
		_ = unix.Close(s.fds[k].fd) // cleanup: a descriptor no frame carries
		k++
	}
	s.fds = s.fds[k:]
}
