// Package unixfd owns file-descriptor passing over Unix sockets (SCM_RIGHTS): a message
// of bytes and descriptors goes out in one sendmsg, and comes in with a control buffer
// sized for what the caller expects, descriptors marked close-on-exec, and every
// descriptor the caller did not ask for closed.
package unixfd

import (
	"errors"
	"fmt"
	"io"
	"net"
	"syscall"

	"golang.org/x/sys/unix"
)

// ErrWouldBlock means RecvRaw, not waiting, found nothing to read.
var ErrWouldBlock = errors.New("unixfd: nothing to read now")

// ErrUnexpectedFDs means a message carried more descriptors than the caller accepts,
// or a truncated control message. The descriptors it carried have been closed.
var ErrUnexpectedFDs = errors.New("unixfd: unexpected file descriptors")

// Send writes data and fds on c in one sendmsg. The kernel duplicates the descriptors
// into the receiver; the caller still owns fds. data must not be empty: a stream
// socket cannot carry descriptors without at least one byte.
func Send(c *net.UnixConn, data []byte, fds ...int) error {
	if len(data) == 0 {
		return errors.New("unixfd: Send needs at least one byte of data")
	}
	var oob []byte
	if len(fds) > 0 {
		oob = unix.UnixRights(fds...)
	}
	n, oobn, err := c.WriteMsgUnix(data, oob, nil)
	if err != nil {
		return err
	}
	if n != len(data) || oobn != len(oob) {
		return fmt.Errorf("unixfd: short send: %d of %d bytes, %d of %d control bytes", n, len(data), oobn, len(oob))
	}
	return nil
}

// Recv reads at most len(buf) bytes from c, and at most maxFDs descriptors. On
// success the descriptors are close-on-exec and owned by the caller. If the message
// carried more than maxFDs descriptors, or its control data was truncated, Recv closes
// every descriptor it received and returns an error wrapping ErrUnexpectedFDs together
// with the bytes read.
func Recv(c *net.UnixConn, buf []byte, maxFDs int) (n int, fds []int, err error) {
	var r Receiver
	return r.Recv(c, buf, maxFDs)
}

// Receiver is Recv for a reader that receives many messages: it keeps its control
// buffer between calls, so a message without descriptors allocates nothing. The zero
// value is ready for use. A Receiver serves one reader at a time.
type Receiver struct {
	oob []byte
	// A RecvRaw's call, for read, made once (newRead): a closure made per call would
	// cost allocations per read.
	read           func(fd uintptr) bool
	buf, roob      []byte
	n, oobn, flags int
	wait           bool
	rerr           error
}

// Recv is the package's Recv, with the same guarantees, using r's control buffer.
func (r *Receiver) Recv(c *net.UnixConn, buf []byte, maxFDs int) (n int, fds []int, err error) {
	oob := r.control(maxFDs)
	n, oobn, flags, _, err := c.ReadMsgUnix(buf, oob)
	if err != nil {
		return 0, nil, err // ReadMsgUnix passes on recvmsg's -1
	}
	return r.finish(n, oob[:oobn], flags, maxFDs)
}

// RecvRaw is Recv on the socket behind rc. It allocates nothing for a message without
// descriptors. With wait false it does not wait for data: if none has arrived it
// fails with ErrWouldBlock. A peer that closed gives io.EOF.
func (r *Receiver) RecvRaw(rc syscall.RawConn, buf []byte, maxFDs int, wait bool) (n int, fds []int, err error) {
	if r.read == nil {
		r.read = r.readOnce
	}
	r.buf, r.roob, r.wait = buf, r.control(maxFDs), wait
	err = rc.Read(r.read)
	n, oobn, flags, rerr, oob := r.n, r.oobn, r.flags, r.rerr, r.roob
	r.buf, r.roob, r.rerr = nil, nil, nil
	switch {
	case err != nil:
		return 0, nil, err
	case errors.Is(rerr, unix.EAGAIN):
		return 0, nil, ErrWouldBlock
	case rerr != nil:
		return 0, nil, rerr
	case n == 0 && oobn == 0 && len(buf) > 0:
		return 0, nil, io.EOF
	}
	return r.finish(n, oob[:oobn], flags, maxFDs)
}

// readOnce is one recvmsg of RecvRaw's, done when it read or need not wait.
func (r *Receiver) readOnce(fd uintptr) bool {
	r.n, r.oobn, r.flags, r.rerr = recvmsg(int(fd), r.buf, r.roob, unix.MSG_DONTWAIT|recvFlags)
	return !r.wait || !errors.Is(r.rerr, unix.EAGAIN)
}

// control returns the control buffer for maxFDs descriptors. One spare slot lets an
// extra descriptor arrive whole (and be closed) rather than be dropped by the kernel
// with MSG_CTRUNC and nothing to close. The buffer is cut to exactly that size: a
// larger one would let more descriptors in.
func (r *Receiver) control(maxFDs int) []byte {
	size := unix.CmsgSpace((maxFDs + 1) * 4)
	if cap(r.oob) < size {
		r.oob = make([]byte, size)
	}
	return r.oob[:size]
}

// finish checks what a read brought: n bytes and the control data oob.
func (r *Receiver) finish(n int, oob []byte, flags, maxFDs int) (int, []int, error) {
	var fds []int
	var err error
	if len(oob) > 0 {
		fds, err = parseRights(oob)
	}
	switch {
	case err != nil:
	case flags&unix.MSG_CTRUNC != 0:
		err = fmt.Errorf("%w: control message truncated", ErrUnexpectedFDs)
	case len(fds) > maxFDs:
		err = fmt.Errorf("%w: got %d, accept at most %d", ErrUnexpectedFDs, len(fds), maxFDs)
	}
	if err != nil {
		closeAll(fds)
		return n, nil, err
	}
	for _, fd := range fds {
		unix.CloseOnExec(fd)
	}
	return n, fds, nil
}

func parseRights(oob []byte) ([]int, error) {
	msgs, err := unix.ParseSocketControlMessage(oob)
	if err != nil {
		return nil, fmt.Errorf("%w: %v", ErrUnexpectedFDs, err)
	}
	var fds []int
	var bad error
	for _, m := range msgs {
		if m.Header.Level != unix.SOL_SOCKET || m.Header.Type != unix.SCM_RIGHTS {
			bad = fmt.Errorf("%w: control message level %d type %d", ErrUnexpectedFDs, m.Header.Level, m.Header.Type)
			continue
		}
		got, err := unix.ParseUnixRights(&m)
		if err != nil {
			bad = fmt.Errorf("%w: %v", ErrUnexpectedFDs, err)
			continue
		}
		fds = append(fds, got...)
	}
	return fds, bad
}

func closeAll(fds []int) {
	for _, fd := range fds {
		_ = unix.Close(fd) // cleanup: the descriptor is ours and unused
	}
}
