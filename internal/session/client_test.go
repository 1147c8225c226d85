package session

import (
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"net"
	"syscall"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"golang.org/x/sys/unix"

	"github.com/cudapool/cudapool/internal/testwait"
)

// toy is a frame of a protocol made for these tests: u32 request id (0: a push) | u32
// value.
type toy struct{ id, v uint32 }

const toyLen = 8

func appendToy(b []byte, f toy) []byte {
	return binary.LittleEndian.AppendUint32(binary.LittleEndian.AppendUint32(b, f.id), f.v)
}

// toyFrames reads toy frames from a Unix socket.
type toyFrames struct {
	nc  *net.UnixConn
	rc  syscall.RawConn
	buf []byte
}

func (t *toyFrames) Next(wait bool) (toy, error) {
	for len(t.buf) < toyLen {
		var b [64]byte
		var n int
		var err error
		if wait {
			n, err = t.nc.Read(b[:])
		} else if cerr := t.rc.Read(func(fd uintptr) bool { n, err = unix.Read(int(fd), b[:]); return true }); cerr != nil {
			err = cerr
		}
		switch {
		case n > 0:
			t.buf = append(t.buf, b[:n]...)
		case errors.Is(err, unix.EAGAIN):
			return toy{}, ErrNoFrame
		case err == nil:
			return toy{}, io.EOF
		default:
			return toy{}, err
		}
	}
	f := toy{binary.LittleEndian.Uint32(t.buf), binary.LittleEndian.Uint32(t.buf[4:])}
	t.buf = t.buf[toyLen:]
	return f, nil
}

func (t *toyFrames) Buffered() bool { return len(t.buf) >= toyLen }

// boundCtx ends at testwait.Bound, or with the test.
func boundCtx(t *testing.T) context.Context {
	ctx, cancel := context.WithTimeout(context.Background(), testwait.Bound)
	t.Cleanup(cancel)
	return ctx
}

var errToyGone = errors.New("the toy peer is gone")

// toyClient is a Client on one end of a socket pair, the other end returned; pushes
// go to pushed.
func toyClient(t *testing.T, watch Watch, pushed chan<- toy) (*Client[toy], *net.UnixConn) {
	mine, peer := socketPair(t)
	rc, err := mine.SyscallConn()
	require.NoError(t, err)
	cl := NewClient[toy](mine, &toyFrames{nc: mine, rc: rc}, Protocol[toy]{
		ReplyTo: func(f toy) (uint64, bool) { return uint64(f.id), true },
		Push: func(f toy) error {
			pushed <- f
			return nil
		},
		Writer: NewWriter(mine, 0),
		Gone:   func(why error) error { return fmt.Errorf("%w: %w", errToyGone, why) },
		Watch:  watch,
	})
	cl.Start()
	t.Cleanup(func() {
		cl.Fail(net.ErrClosed)
		<-cl.ReaderDone()
	})
	return cl, peer
}

// toyCall sends a request of value v and returns the reply's value, and whether the
// handler saw it claimed, on got.
func toyCall(ctx context.Context, cl *Client[toy], v uint32, got chan<- toy) error {
	return cl.Call(ctx, func(b []byte, id uint64) ([]byte, error) { return appendToy(b, toy{uint32(id), v}), nil },
		HandlerFunc[toy](func(f toy, claimed bool) error {
			if !claimed {
				f.v |= 1 << 31
			}
			got <- f
			return nil
		}))
}

func readToys(t *testing.T, peer net.Conn, n int) []toy {
	b := make([]byte, n*toyLen)
	_, err := io.ReadFull(peer, b)
	require.NoError(t, err)
	fs := make([]toy, n)
	for i := range fs {
		fs[i] = toy{binary.LittleEndian.Uint32(b[i*toyLen:]), binary.LittleEndian.Uint32(b[i*toyLen+4:])}
	}
	return fs
}

func writeToys(t *testing.T, peer net.Conn, fs ...toy) {
	var b []byte
	for _, f := range fs {
		b = appendToy(b, f)
	}
	_, err := peer.Write(b)
	require.NoError(t, err)
}

var watches = map[string]Watch{"arrivals": WatchArrivals, "hang-up": WatchHangUp}

// Replies that come in another order than their requests each reach their own call,
// whoever reads them.
func TestClientRepliesReachTheirCalls(t *testing.T) {
	for name, watch := range watches {
		t.Run(name, func(t *testing.T) {
			cl, peer := toyClient(t, watch, make(chan toy, 1))
			const n = 8
			got := make([]chan toy, n)
			errs := make(chan error, n)
			for i := range n {
				got[i] = make(chan toy, 1)
				go func() { errs <- toyCall(boundCtx(t), cl, uint32(i), got[i]) }()
			}
			reqs := readToys(t, peer, n)
			for i := n - 1; i >= 0; i-- {
				writeToys(t, peer, toy{reqs[i].id, reqs[i].v + 100})
			}
			for range n {
				require.NoError(t, testwait.Recv(t, errs, "a call to return"))
			}
			for i := range n {
				f := testwait.Recv(t, got[i], "call's reply")
				assert.Equal(t, uint32(i+100), f.v, "call %d got another's reply", i)
			}
		})
	}
}

// A call whose caller gave up returns ctx's error; its reply, when it comes, is
// handled unclaimed, with nobody else calling.
func TestClientAbandonedReplyIsHandledUnclaimed(t *testing.T) {
	for name, watch := range watches {
		t.Run(name, func(t *testing.T) {
			cl, peer := toyClient(t, watch, make(chan toy, 1))
			got := make(chan toy, 1)
			ctx, cancel := context.WithCancel(boundCtx(t))
			errs := make(chan error, 1)
			go func() { errs <- toyCall(ctx, cl, 7, got) }()
			req := readToys(t, peer, 1)[0]
			cancel()
			require.ErrorIs(t, testwait.Recv(t, errs, "the call to give up"), context.Canceled)
			writeToys(t, peer, toy{req.id, 8})
			f := testwait.Recv(t, got, "the reply to be handled")
			assert.Equal(t, uint32(8|1<<31), f.v, "handled unclaimed")
		})
	}
}

// The peer's hang-up ends the connection at once, with no call under way to read it,
// and fails the calls after it.
func TestClientHangUpEndsTheConnection(t *testing.T) {
	for name, watch := range watches {
		t.Run(name, func(t *testing.T) {
			cl, peer := toyClient(t, watch, make(chan toy, 1))
			require.NoError(t, peer.Close())
			testwait.Recv(t, cl.Done(), "the client to see the hang-up")
			require.ErrorIs(t, cl.Err(), errToyGone)
			require.ErrorIs(t, toyCall(boundCtx(t), cl, 1, make(chan toy, 1)), errToyGone)
		})
	}
}

// A push that arrives while no call reads is read by the watcher; the one that arrives
// with a reply is handed on by the call that read it.
func TestClientPushesArriveWhileIdle(t *testing.T) {
	pushed := make(chan toy, 2)
	cl, peer := toyClient(t, WatchArrivals, pushed)
	writeToys(t, peer, toy{0, 1})
	assert.Equal(t, toy{0, 1}, testwait.Recv(t, pushed, "the idle push"))
	got := make(chan toy, 1)
	errs := make(chan error, 1)
	go func() { errs <- toyCall(boundCtx(t), cl, 5, got) }()
	req := readToys(t, peer, 1)[0]
	writeToys(t, peer, toy{req.id, 6}, toy{0, 2})
	require.NoError(t, testwait.Recv(t, errs, "the call"))
	assert.Equal(t, toy{0, 2}, testwait.Recv(t, pushed, "the push behind the reply"))
}

// Drain reads to the end of the stream, handing on what comes before it.
func TestClientDrainReadsToTheEnd(t *testing.T) {
	pushed := make(chan toy, 1)
	cl, peer := toyClient(t, WatchHangUp, pushed)
	writeToys(t, peer, toy{0, 3})
	require.NoError(t, peer.CloseWrite())
	require.NoError(t, cl.Drain(boundCtx(t)))
	assert.Equal(t, toy{0, 3}, testwait.Recv(t, pushed, "the frame before the end"))
	require.ErrorIs(t, cl.Err(), errToyGone)
}
