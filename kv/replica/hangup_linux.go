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
	// A duplicate made without nc.File, whose Fd would put the socket (the open file
	// both descriptors share) into blocking mode, where deadlines no longer cut nc's
	// reads short.
	rc, err := nc.SyscallConn()
	if err != nil {
		return nil, fmt.Errorf("kv/replica: %w", err)
	}
	sock := -1
	if cerr := rc.Control(func(fd uintptr) { sock, err = unix.FcntlInt(fd, unix.F_DUPFD_CLOEXEC, 0) }); cerr != nil {
		err = cerr
	}
	if err != nil {
		return nil, fmt.Errorf("kv/replica: %w", err)
	}
	stop, err := unix.Eventfd(0, unix.EFD_CLOEXEC)
	if err != nil {
		_ = unix.Close(sock) // cleanup: the descriptor is ours and unused
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

// close stops the watch and waits for it. If it cannot wake the watch, it returns why
// without waiting, and the watch keeps its descriptors until the owner hangs up.
func (h *hangup) close() error {
	var one [8]byte
	one[0] = 1
	if _, err := unix.Write(h.stop, one[:]); err != nil {
		return fmt.Errorf("kv/replica: stopping the hang-up watch: %w", err)
	}
	<-h.done
	_ = unix.Close(h.sock) // cleanup: the descriptor is ours and unused
	_ = unix.Close(h.stop) // cleanup: the descriptor is ours and unused
	return nil
}
