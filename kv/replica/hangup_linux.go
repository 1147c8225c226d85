package replica

import (
	"errors"
	"fmt"
	"net"

	"golang.org/x/sys/unix"
)

// hangup tells when the owner has closed the connection, without reading from it, so
// that an idle replica learns of an owner that stops (or dies) at once: a poll of a
// duplicate of the socket for POLLRDHUP, ended early by an eventfd.
type hangup struct {
	sock, stop int
	done       chan struct{}
}

// watchHangup starts watching nc; fired is closed when the owner hangs up.
func watchHangup(nc *net.UnixConn, fired func()) (*hangup, error) {
	f, err := nc.File() // a duplicate: nc keeps its own descriptor and mode
	if err != nil {
		return nil, err
	}
	sock, err := unix.Dup(int(f.Fd()))
	f.Close()
	if err != nil {
		return nil, fmt.Errorf("kv/replica: %w", err)
	}
	stop, err := unix.Eventfd(0, unix.EFD_CLOEXEC)
	if err != nil {
		unix.Close(sock)
		return nil, fmt.Errorf("kv/replica: %w", err)
	}
	h := &hangup{sock: sock, stop: stop, done: make(chan struct{})}
	go func() {
		defer close(h.done)
		fds := []unix.PollFd{{Fd: int32(sock), Events: unix.POLLRDHUP}, {Fd: int32(stop), Events: unix.POLLIN}}
		for {
			_, err := unix.Poll(fds, -1)
			if errors.Is(err, unix.EINTR) {
				continue
			}
			if err == nil && fds[1].Revents != 0 {
				return
			}
			if err == nil && fds[0].Revents&(unix.POLLRDHUP|unix.POLLHUP|unix.POLLERR) != 0 {
				fired()
			}
			return
		}
	}()
	return h, nil
}

// close stops the watch and waits for it.
func (h *hangup) close() {
	var one [8]byte
	one[0] = 1
	unix.Write(h.stop, one[:])
	<-h.done
	unix.Close(h.sock)
	unix.Close(h.stop)
}
