package session

import (
	"errors"
	"os"
	"sync"
	"syscall"

	"golang.org/x/sys/unix"
)

// idleWatch wakes a [Client]'s watcher when frames arrive while no caller reads the
// connection (WatchArrivals), or when the peer hangs up (WatchHangUp). It is an epoll
// instance of its own that holds the socket and is itself waited on in the runtime's
// poller. Unlike the socket's own registration, which wakes whoever reads the socket,
// it can be switched off while a caller reads, so that a reply wakes that caller
// alone, and on again after; a watch for the hang-up alone is never switched.
type idleWatch struct {
	ep    *os.File
	epRaw syscall.RawConn
	// Mu orders set and close: no epoll_ctl after the epoll descriptor is closed, when
	// its number could name another file. The socket's number may go stale under set
	// (the connection closes): its registration then went with it, and the call only
	// fails.
	mu     sync.Mutex
	closed bool
	epfd   int
	sockfd int
	events [1]unix.EpollEvent
	on     uint32 // the events watched while switched on
}

// watchEvents are the events each Watch waits for: an arrival or the peer's hang-up,
// or the hang-up alone.
var watchEvents = [...]uint32{
	WatchArrivals: unix.EPOLLIN | unix.EPOLLRDHUP | unix.EPOLLET,
	WatchHangUp:   unix.EPOLLRDHUP | unix.EPOLLET,
}

// newIdleWatch watches the socket behind sock for what, switched on.
func newIdleWatch(sock syscall.RawConn, what Watch) (*idleWatch, error) {
	if sock == nil {
		return nil, errors.New("no socket to watch")
	}
	epfd, err := unix.EpollCreate1(unix.EPOLL_CLOEXEC)
	if err != nil {
		return nil, os.NewSyscallError("epoll_create1", err)
	}
	sockfd := -1
	var ctlErr error
	err = sock.Control(func(fd uintptr) {
		sockfd = int(fd)
		ev := unix.EpollEvent{Events: watchEvents[what], Fd: int32(fd)}
		ctlErr = unix.EpollCtl(epfd, unix.EPOLL_CTL_ADD, int(fd), &ev)
	})
	if err == nil {
		err = ctlErr
	}
	if err == nil {
		err = unix.SetNonblock(epfd, true) // so that the runtime's poller waits on it
	}
	if err != nil {
		_ = unix.Close(epfd) // cleanup: the descriptor is ours and unused
		return nil, err
	}
	w := &idleWatch{ep: os.NewFile(uintptr(epfd), "session idle watch"), epfd: epfd, sockfd: sockfd, on: watchEvents[what]}
	if w.epRaw, err = w.ep.SyscallConn(); err != nil {
		_ = w.ep.Close() // cleanup: nothing is left to do if closing fails
		return nil, err
	}
	return w, nil
}

// wait blocks until something arrived on the socket while the watch was on, or the
// watch is closed (an error).
func (w *idleWatch) wait() error {
	var werr error
	err := w.epRaw.Read(func(fd uintptr) bool {
		n, err := unix.EpollWait(int(fd), w.events[:], 0)
		if errors.Is(err, unix.EINTR) {
			return false
		}
		werr = err
		return n > 0 || err != nil
	})
	if err != nil {
		return err
	}
	return werr
}

// set switches the watch on or off. Switching it on reports what arrived meanwhile:
// the kernel looks at the socket again. Errors mean the connection or the watch is
// closed: there is nothing left to watch.
func (w *idleWatch) set(on bool) {
	ev := unix.EpollEvent{Fd: int32(w.sockfd)}
	if on {
		ev.Events = w.on
	}
	w.mu.Lock()
	defer w.mu.Unlock()
	if !w.closed {
		_ = unix.EpollCtl(w.epfd, unix.EPOLL_CTL_MOD, w.sockfd, &ev) // a watch that cannot be changed reads for good, which the client copes with
	}
}

// Close ends wait.
func (w *idleWatch) Close() {
	w.mu.Lock()
	defer w.mu.Unlock()
	if !w.closed {
		w.closed = true
		_ = w.ep.Close() // cleanup: nothing is left to do if closing fails
	}
}
