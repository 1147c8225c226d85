package session

import (
	"errors"
	"log/slog"
	"net"
	"sync"
	"syscall"
	"time"
)

// AcceptBackoffMin and AcceptBackoffMax bound the backoff after an accept fails for
// want of a resource: short at first, so that a moment's exhaustion costs little, and
// at most a second, so that a long one is retried without spinning.
const (
	AcceptBackoffMin = 5 * time.Millisecond
	AcceptBackoffMax = time.Second
)

// Temporary reports whether err says the system or process lacked something for the
// moment (descriptors, buffers, memory) or the connection went before it was
// accepted: the listener itself is fine and the next accept may succeed.
func Temporary(err error) bool {
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

// AcceptLoop accepts on l and hands each connection to serve (which runs it on a
// goroutine of its own, or closes it), until l is closed or fails for good. A failure
// for want of a resource (Temporary) is logged once per episode and retried with a
// growing backoff, waited with sleep (time.Sleep); the recovery is logged with how
// long it took. who names the server in the log.
func AcceptLoop(l net.Listener, log *slog.Logger, who string, closed func() bool, serve func(net.Conn), sleep func(time.Duration)) {
	var backoff time.Duration
	var since time.Time
	failures := 0
	for {
		nc, err := l.Accept()
		if err == nil {
			if failures > 0 {
				log.Warn(who+": accepting again", "addr", l.Addr(), "failed_accepts", failures, "after", time.Since(since))
				backoff, failures = 0, 0
			}
			serve(nc)
			continue
		}
		if closed() || errors.Is(err, net.ErrClosed) {
			return
		}
		if !Temporary(err) {
			log.Error(who+": accept failed; no more connections on this listener", "addr", l.Addr(), "err", err)
			return
		}
		if failures == 0 {
			since = time.Now()
			log.Error(who+": accept failed; retrying with backoff", "addr", l.Addr(), "err", err)
		}
		failures++
		backoff = min(max(2*backoff, AcceptBackoffMin), AcceptBackoffMax)
		sleep(backoff)
	}
}

// Counter counts what a server holds (connections in their handshake, admitted
// connections), in total and per key (a uid, a pid), each under a cap. Its methods are
// safe for concurrent use.
type Counter struct {
	total, perKey int

	mu    sync.Mutex
	n     int
	byKey map[uint32]int
}

// NewCounter returns a Counter of at most total in all and perKey per key.
func NewCounter(total, perKey int) *Counter {
	return &Counter{total: total, perKey: perKey, byKey: map[uint32]int{}}
}

// Enter takes a slot for key, or says which cap is full ("total" or "per-key").
func (h *Counter) Enter(key uint32) (ok bool, full string) {
	h.mu.Lock()
	defer h.mu.Unlock()
	switch {
	case h.n >= h.total:
		return false, "total"
	case h.byKey[key] >= h.perKey:
		return false, "per-key"
	}
	h.n++
	h.byKey[key]++
	return true, ""
}

// Leave gives back key's slot.
func (h *Counter) Leave(key uint32) {
	h.mu.Lock()
	defer h.mu.Unlock()
	h.n--
	if h.byKey[key]--; h.byKey[key] <= 0 {
		delete(h.byKey, key)
	}
}

// Count is the slots taken, in all and by key.
func (h *Counter) Count(key uint32) (total, byKey int) {
	h.mu.Lock()
	defer h.mu.Unlock()
	return h.n, h.byKey[key]
}
