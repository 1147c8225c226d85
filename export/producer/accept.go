package producer

import (
	"errors"
	"log/slog"
	"net"
	"sync"
	"syscall"
	"time"
)

// Backoff after an accept fails for want of a resource: short at first, so that a
// moment's exhaustion costs little, and at most a second, so that a long one is
// retried without spinning.
const (
	acceptBackoffMin = 5 * time.Millisecond
	acceptBackoffMax = time.Second
)

// Default caps on connections still in their handshake (WithHandshakeLimit). Each
// costs a descriptor and a goroutine until its Hello arrives or the handshake times
// out; a user who opens more is refused, not others.
const (
	defaultHandshakesTotal  = 1024
	defaultHandshakesPerUID = 128
)

// resourceShortage reports whether err says the system or process lacked something
// for the moment (descriptors, buffers, memory) or the connection went before it was
// accepted: the listener itself is fine and the next accept may succeed.
func resourceShortage(err error) bool {
	var errno syscall.Errno
	if !errors.As(err, &errno) {
		return false
	}
	switch errno {
	case syscall.EMFILE, syscall.ENFILE, syscall.ENOBUFS, syscall.ENOMEM,
		syscall.ECONNABORTED, syscall.EINTR, syscall.EAGAIN, syscall.EPROTO:
		return true
	}
	return false
}

// acceptLoop accepts on l and hands each connection to serve (which runs it on a
// goroutine of its own, or closes it), until l is closed or fails for good. A failure
// for want of a resource is logged once per episode and retried with a growing
// backoff, waited with sleep (time.Sleep); the recovery is logged with how long it
// took.
func acceptLoop(l net.Listener, log *slog.Logger, closed func() bool, serve func(net.Conn), sleep func(time.Duration)) {
	var backoff time.Duration
	var since time.Time
	failures := 0
	for {
		nc, err := l.Accept()
		if err == nil {
			if failures > 0 {
				log.Warn("producer: accepting again", "addr", l.Addr(), "failed_accepts", failures, "after", time.Since(since))
				backoff, failures = 0, 0
			}
			serve(nc)
			continue
		}
		if closed() || errors.Is(err, net.ErrClosed) {
			return
		}
		if !resourceShortage(err) {
			log.Error("producer: accept failed; no more connections on this listener", "addr", l.Addr(), "err", err)
			return
		}
		if failures == 0 {
			since = time.Now()
			log.Error("producer: accept failed; retrying with backoff", "addr", l.Addr(), "err", err)
		}
		failures++
		backoff = min(max(2*backoff, acceptBackoffMin), acceptBackoffMax)
		sleep(backoff)
	}
}

// handshakeLimit counts the connections in their handshake, in total and per uid
// (remote peers, which have no uid, count under remoteUID).
type handshakeLimit struct {
	total, perUID int

	mu    sync.Mutex
	n     int
	byUID map[uint32]int
}

// remoteUID stands for the uid of a peer on a byte stream.
const remoteUID = ^uint32(0)

func newHandshakeLimit(total, perUID int) *handshakeLimit {
	return &handshakeLimit{total: total, perUID: perUID, byUID: map[uint32]int{}}
}

// enter takes a slot for uid, or says which cap is full.
func (h *handshakeLimit) enter(uid uint32) (ok bool, full string) {
	h.mu.Lock()
	defer h.mu.Unlock()
	switch {
	case h.n >= h.total:
		return false, "total"
	case h.byUID[uid] >= h.perUID:
		return false, "per-uid"
	}
	h.n++
	h.byUID[uid]++
	return true, ""
}

// leave gives back uid's slot.
func (h *handshakeLimit) leave(uid uint32) {
	h.mu.Lock()
	defer h.mu.Unlock()
	h.n--
	if h.byUID[uid]--; h.byUID[uid] == 0 {
		delete(h.byUID, uid)
	}
}
