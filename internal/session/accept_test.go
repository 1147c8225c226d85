package session

import (
	"log/slog"
	"net"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// shortListener fails its Accepts with EMFILE, as a process out of descriptors does,
// except those whose turn is in ok; it is closed after limit calls.
type shortListener struct {
	net.Listener
	mu     sync.Mutex
	calls  int
	ok     map[int]bool
	limit  int
	closed bool
}

func (l *shortListener) Accept() (net.Conn, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	l.calls++
	switch {
	case l.calls > l.limit:
		l.closed = true
		return nil, net.ErrClosed
	case l.ok[l.calls]:
		a, b := net.Pipe()
		b.Close()
		return a, nil
	}
	return nil, &net.OpError{Op: "accept", Net: "unix", Err: syscall.EMFILE}
}

func (l *shortListener) Addr() net.Addr { return &net.UnixAddr{Name: "short", Net: "unix"} }

// While accepts fail for want of descriptors, each retry waits: from
// AcceptBackoffMin, doubling, to AcceptBackoffMax and no more, so an exhaustion costs
// at most about one accept a second, not a spinning core; an accept that succeeds
// starts the backoff over.
func TestAcceptBackoffIsBounded(t *testing.T) {
	l := &shortListener{ok: map[int]bool{20: true}, limit: 30}
	var waits []time.Duration
	served := 0
	AcceptLoop(l, slog.New(slog.DiscardHandler), "test", func() bool { return false }, func(nc net.Conn) { served++; nc.Close() },
		func(d time.Duration) { waits = append(waits, d) })
	require.Equal(t, 1, served)
	require.Len(t, waits, l.limit-1, "a wait after every failed accept, none after the success")
	want := time.Duration(0)
	for i, d := range waits {
		if i == 19 { // the first failure after the success at call 20
			want = 0
		}
		want = min(max(2*want, AcceptBackoffMin), AcceptBackoffMax)
		assert.Equal(t, want, d, "wait %d", i)
	}
	assert.Equal(t, AcceptBackoffMax, waits[18], "the backoff reached its bound")
	assert.LessOrEqual(t, AcceptBackoffMax, time.Second, "at most about one accept a second")
}
