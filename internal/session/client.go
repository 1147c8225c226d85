package session

import (
	"context"
	"errors"
	"net"
	"os"
	"slices"
	"sync"
	"syscall"
	"time"
)

// ErrNoFrame means a read that does not wait ([Frames].Next with wait false) found no
// whole frame; what did arrive is kept for the next read.
var ErrNoFrame = errors.New("session: no whole frame has arrived")

// Frames is a protocol's framing on one connection, as a [Client] reads it.
type Frames[F any] interface {
	// Next reads the next frame, waiting for one unless wait is false: then, where no
	// whole frame has arrived, it fails with [ErrNoFrame], keeping what did. A read cut
	// short by the connection's read deadline fails with an error wrapping
	// os.ErrDeadlineExceeded and loses nothing. Any other error ends the connection.
	Next(wait bool) (F, error)
	// Buffered reports whether a whole frame (or a malformed header) has been read and
	// not taken: Next returns it without reading.
	Buffered() bool
}

// Watch says what a [Client]'s watcher reads while no caller does.
type Watch int

const (
	// WatchArrivals: frames come unasked (pushes), so the watcher reads whatever
	// arrives while no caller reads.
	WatchArrivals Watch = iota
	// WatchHangUp: every frame answers a request, so the watcher reads only once the
	// peer hangs up, to tell the calls at once; it costs a request nothing.
	WatchHangUp
)

// AbandonTimeout bounds the wait for the reply of a call whose caller gave up, where
// no watcher reads what arrives ([WatchHangUp]): it is still read, by a goroutine of
// its own, so that what it grants is given back.
const AbandonTimeout = 30 * time.Second

// Handler acts on the frames of one call's reply ([Client.Call]).
type Handler[F any] interface {
	// Handle runs on the reading goroutine for each frame of the reply, in order,
	// while the frame is valid; it must not block. claimed is false once the caller
	// gave up (its ctx ended): Handle then touches nothing of the caller's and does
	// only what the protocol must, such as give back what the reply grants. An error
	// ends the call (not the connection) with it.
	Handle(f F, claimed bool) error
}

// HandlerFunc is a function as a [Handler].
type HandlerFunc[F any] func(f F, claimed bool) error

// Handle calls h.
func (h HandlerFunc[F]) Handle(f F, claimed bool) error { return h(f, claimed) }

// Protocol is what a [Client] needs of the protocol above it.
type Protocol[F any] struct {
	// ReplyTo says which request f answers, and whether f is the last frame of that
	// reply; 0 if it answers none (a push).
	ReplyTo func(f F) (id uint64, last bool)
	// Push takes a frame that answers no request waiting: a push, or a reply whose
	// call has ended. It runs on the reading goroutine and must not block; an error
	// ends the connection.
	Push func(f F) error
	// Writer sends the requests.
	Writer *Writer
	// Gone is the error calls fail with once the connection ended for why.
	Gone func(why error) error
	// Down, if not nil, runs once when the connection ends, with why, after every
	// call waiting has failed. It must not call the Client but for Err.
	Down func(why error)
	// Watch says what the watcher reads while no caller does.
	Watch Watch
	// MaxID bounds the request ids: they go from 1 to MaxID and wrap; 0 is no bound
	// but the type's.
	MaxID uint64
}

// Client is the requesting side of a connection: it numbers requests, sends them with
// writes bounded by their callers' contexts, and hands each reply to its call, and
// every other frame to the protocol ([Protocol].Push).
//
// One goroutine at a time reads the connection (the reading role) and hands each frame
// to whom it concerns. A call's caller takes the role while it waits, so that its
// reply wakes it directly: a wake passed on through another goroutine costs more than
// the rest of a request. While no caller reads, the watcher goroutine does where
// something arrives ([WatchArrivals]) or the peer hangs up ([WatchHangUp]); where the
// connection cannot be watched (not a Unix socket, not Linux) the watcher reads for
// good and hands every reply over. Its methods are safe for concurrent use.
type Client[F any] struct {
	nc net.Conn
	fr Frames[F]
	p  Protocol[F]

	mu      sync.Mutex
	down    error // why the connection ended, nil while it carries calls
	nextID  uint64
	pending map[uint64]*call[F]
	// reading says who holds the reading role; leaders lists the calls waiting for
	// it, oldest first.
	reading  readRole
	leaders  []*call[F]
	watch    *idleWatch // nil: the watcher reads for good, and replies are handed over
	watchOff bool       // watch is switched off; only the role's holder touches it

	cut cut // the present holder's read, cut short when its ctx ends

	// free holds calls done with, for reuse: a request costs no allocation of its own.
	free sync.Pool

	done       chan struct{} // closed when down is set
	readerDone chan struct{} // closed when the watcher has returned
}

// readRole says who holds the reading role.
type readRole int

const (
	readerNone    readRole = iota // nobody: the watch is on
	readerCaller                  // a call's caller, waiting for its reply, or a Hold
	readerWatcher                 // the watcher goroutine
)

// call is one request's wait for its reply, made for that request alone. It is pending
// until its last reply frame is handled or the connection fails; whoever takes it out
// of pending completes it, without blocking. A call of id 0 waits for the reading
// role alone (Hold).
type call[F any] struct {
	id     uint64
	handle Handler[F]
	wake   chan struct{} // a token: look at the fields below again (or none: spurious)
	// Under Client.mu:
	lead      bool // handed the reading role, not yet taken up
	done      bool
	abandoned bool  // its caller gave up: the reply is handled unclaimed
	err       error // the handling of the reply, or why the connection ended
}

func (c *call[F]) signal() {
	select {
	case c.wake <- struct{}{}:
	default: // a token is there already
	}
}

// NewClient returns a Client on nc, reading with fr, for protocol p; Start runs it.
func NewClient[F any](nc net.Conn, fr Frames[F], p Protocol[F]) *Client[F] {
	return &Client[F]{nc: nc, fr: fr, p: p, pending: map[uint64]*call[F]{}, cut: cut{set: nc.SetReadDeadline},
		done: make(chan struct{}), readerDone: make(chan struct{})}
}

// Start runs the watcher.
func (cl *Client[F]) Start() {
	if rc := rawOf(cl.nc); rc != nil {
		if w, err := newIdleWatch(rc, cl.p.Watch); err == nil {
			cl.watch = w
			if cl.p.Watch == WatchHangUp {
				go cl.watchHangUp()
			} else {
				go cl.watchIdle()
			}
			return
		}
	}
	cl.reading = readerWatcher
	go cl.readAll()
}

// Done is closed when the connection ends ([Client.Err] is not nil).
func (cl *Client[F]) Done() <-chan struct{} { return cl.done }

// ReaderDone is closed when the watcher has returned, after the connection ended.
func (cl *Client[F]) ReaderDone() <-chan struct{} { return cl.readerDone }

// Err is nil while the connection carries calls, and afterwards the error they fail
// with.
func (cl *Client[F]) Err() error {
	cl.mu.Lock()
	defer cl.mu.Unlock()
	return cl.down
}

// readAll reads every frame, for a connection without a watch.
func (cl *Client[F]) readAll() {
	defer close(cl.readerDone)
	defer cl.passRole() // to a Hold
	for {
		if _, err := cl.handOn(true); err != nil {
			cl.Fail(err)
			return
		}
	}
}

// watchIdle reads what arrives while no caller does, until the connection ends. Its
// first look is before any wake: the handshake's read may have brought more than its
// answer.
func (cl *Client[F]) watchIdle() {
	defer close(cl.readerDone)
	for first := true; ; first = false {
		var watchErr error
		if !first {
			watchErr = cl.watch.wait()
		}
		if !cl.takeRole() {
			if watchErr != nil {
				<-cl.done // the watch closed with the connection; the reader sees its end
				return
			}
			continue // a caller reads; its passRole switches the watch on again
		}
		if watchErr != nil {
			cl.Fail(watchErr)
			cl.passRole()
			return
		}
		for {
			_, err := cl.handOn(false)
			if err == ErrNoFrame {
				break
			}
			if err != nil {
				cl.Fail(err)
				cl.passRole()
				return
			}
			if cl.leaderWaits() {
				break // it reads the rest, its reply among it
			}
		}
		cl.passRole()
	}
}

// watchHangUp waits for the peer's hang-up and then reads, with the reading role,
// what it sent before, to the end of the stream.
func (cl *Client[F]) watchHangUp() {
	defer close(cl.readerDone)
	if cl.watch.wait() != nil {
		return // the watch closed with the connection
	}
	if cl.hold(context.Background()) != nil {
		return
	}
	defer cl.passRole()
	for {
		if _, err := cl.handOn(true); err != nil {
			cl.Fail(err)
			return
		}
	}
}

// takeRole gives the watcher the reading role if nobody holds it.
func (cl *Client[F]) takeRole() bool {
	cl.mu.Lock()
	defer cl.mu.Unlock()
	if cl.reading != readerNone {
		return false
	}
	cl.reading = readerWatcher
	return true
}

// leaderWaits reports whether a call waits for the reading role.
func (cl *Client[F]) leaderWaits() bool {
	cl.mu.Lock()
	defer cl.mu.Unlock()
	return len(cl.leaders) > 0
}

// passRole gives the reading role, which the caller holds, to the oldest call waiting
// for it, or else to nobody, with the watch on.
func (cl *Client[F]) passRole() {
	cl.mu.Lock()
	for len(cl.leaders) > 0 {
		c := cl.leaders[0]
		cl.leaders[0] = nil
		cl.leaders = cl.leaders[1:]
		if !c.done {
			c.lead = true
			cl.reading = readerCaller
			cl.mu.Unlock()
			c.signal()
			return
		}
	}
	cl.reading = readerNone
	turnOn := cl.watch != nil && cl.watchOff
	cl.watchOff = false
	cl.mu.Unlock()
	if turnOn {
		// After the role is free: whatever arrived meanwhile wakes the watcher now.
		// (Should the next holder's switching off come first, the watch is on while it
		// reads: a wake to spare, nothing lost.)
		cl.watch.set(true)
	}
}

// quiet switches the watch off while the caller holds the reading role, so that its
// reads alone wake it.
func (cl *Client[F]) quiet() {
	if cl.p.Watch != WatchArrivals {
		return
	}
	cl.mu.Lock()
	turnOff := cl.watch != nil && !cl.watchOff
	cl.watchOff = true
	cl.mu.Unlock()
	if turnOff {
		cl.watch.set(false)
	}
}

// Call sends the request build appends under a fresh id and waits for its reply,
// reading it itself if nobody else reads the connection; h handles each frame of the
// reply ([Handler]). On success the reply's last frame has been handled, and Call
// returns what h returned for it (or for the first frame it failed on). If ctx ends
// first Call returns ctx's error, and the reply is still handled, unclaimed, when it
// comes. If the connection ends first, or a write is cut short inside the frame
// ([ErrBroken], which ends it), it returns [Client.Err]. An error of build, or of a
// write that wrote nothing, is returned as it is, and the connection carries on.
func (cl *Client[F]) Call(ctx context.Context, build func(b []byte, id uint64) ([]byte, error), h Handler[F]) error {
	return cl.CallFD(ctx, -1, build, h)
}

// CallFD is [Client.Call] of a request whose frame carries descriptor fd (SCM_RIGHTS,
// [Writer.WriteFD]; -1: none), which stays the caller's.
func (cl *Client[F]) CallFD(ctx context.Context, fd int, build func(b []byte, id uint64) ([]byte, error), h Handler[F]) error {
	c, _ := cl.free.Get().(*call[F])
	if c == nil {
		c = &call[F]{wake: make(chan struct{}, 1)}
	}
	c.handle = h
	cl.mu.Lock()
	if cl.down != nil {
		err := cl.down
		cl.mu.Unlock()
		cl.reuse(c)
		return err
	}
	cl.nextID++
	if cl.p.MaxID != 0 && cl.nextID > cl.p.MaxID {
		cl.nextID = 1
	}
	c.id = cl.nextID
	cl.pending[c.id] = c
	lead := false
	switch {
	case cl.reading == readerNone:
		cl.reading, lead = readerCaller, true
	case cl.watch != nil:
		cl.leaders = append(cl.leaders, c)
	}
	cl.mu.Unlock()
	fill := func(b []byte) ([]byte, error) { return build(b, c.id) }
	var err error
	if fd >= 0 {
		err = cl.p.Writer.WriteFD(ctx, fd, fill)
	} else {
		err = cl.p.Writer.Write(ctx, fill)
	}
	if err != nil {
		cl.forget(c, lead)
		cl.reuse(c)
		if errors.Is(err, ErrBroken) {
			cl.Fail(err) // a frame cut short: the peer cannot read on
		}
		return cl.errOr(err)
	}
	err = cl.wait(ctx, c, lead)
	cl.mu.Lock()
	kept := c.abandoned // its reply is still to be handled
	cl.mu.Unlock()
	if !kept {
		cl.reuse(c)
	}
	return err
}

// reuse puts c, done with, in the free list. Nothing refers to it any more but a
// wake that may still come, which its next call takes for a spurious one: it is out
// of pending, and taken out of leaders here (a call completed while it waited for the
// role is left there, for passRole to skip).
func (cl *Client[F]) reuse(c *call[F]) {
	cl.mu.Lock()
	if i := slices.Index(cl.leaders, c); i >= 0 {
		cl.leaders = slices.Delete(cl.leaders, i, i+1)
	}
	c.id, c.handle, c.lead, c.done, c.abandoned, c.err = 0, nil, false, false, false, nil
	cl.mu.Unlock()
	select {
	case <-c.wake:
	default:
	}
	cl.free.Put(c)
}

// wait waits until c is completed, reading for it while it holds the reading role
// (lead), and returns how it ended.
func (cl *Client[F]) wait(ctx context.Context, c *call[F], lead bool) error {
	for {
		if lead {
			err := cl.lead(ctx, c)
			lead = false
			cl.mu.Lock()
			done, cerr := c.done, c.err
			cl.mu.Unlock()
			switch {
			case done:
				return cerr
			case ctx.Err() != nil:
				return cl.abandon(ctx, c)
			}
			return err // cannot happen: a failed connection completes its calls
		}
		select {
		case <-c.wake:
			cl.mu.Lock()
			done, cerr := c.done, c.err
			lead, c.lead = c.lead, false
			cl.mu.Unlock()
			if done {
				if lead {
					cl.passRole()
				}
				return cerr
			}
		case <-ctx.Done():
			return cl.abandon(ctx, c)
		}
	}
}

// lead reads the connection, with the reading role held, until c is completed (c nil:
// until the connection ends) or ctx ends, and then passes the role on. It fails with
// ctx's error if ctx ended, or with why the connection ended.
func (cl *Client[F]) lead(ctx context.Context, c *call[F]) error {
	defer cl.passRole()
	cl.quiet()
	if ctx.Done() != nil {
		defer cl.cut.disarm(cl.cut.arm(ctx), true)
	}
	for {
		got, err := cl.handOn(true)
		if err != nil {
			if ctx.Err() != nil && errors.Is(err, os.ErrDeadlineExceeded) {
				return ctx.Err() // nothing is lost: the next reader goes on
			}
			cl.Fail(err)
			return cl.Err()
		}
		if got != nil && got == c {
			if cl.p.Watch == WatchArrivals {
				// Frames read with the reply would wait for the next wake: take them now.
				for cl.fr.Buffered() {
					if _, err := cl.handOn(true); err != nil {
						cl.Fail(err)
						break
					}
				}
			}
			return nil
		}
	}
}

// forget takes c, whose request was not sent, out of the calls; the reading role, if
// c held it (lead) or was handed it meanwhile, is passed on.
func (cl *Client[F]) forget(c *call[F], lead bool) {
	cl.mu.Lock()
	if cl.pending[c.id] == c {
		delete(cl.pending, c.id)
	}
	c.done = true
	if i := slices.Index(cl.leaders, c); i >= 0 {
		cl.leaders = slices.Delete(cl.leaders, i, i+1)
	}
	lead = lead || c.lead
	c.lead = false
	cl.mu.Unlock()
	if lead {
		cl.passRole()
	}
}

// abandon ends the wait of c's caller, whose ctx ended: its reply, still to come, is
// handled unclaimed. If it came meanwhile, it was handled for the caller, and abandon
// returns how it ended. A call abandoned a second time (awaitAbandoned gave up on it)
// is forgotten: a reply that comes later is the protocol's (Push).
func (cl *Client[F]) abandon(ctx context.Context, c *call[F]) error {
	cl.mu.Lock()
	passOn := c.lead
	c.lead = false
	if i := slices.Index(cl.leaders, c); i >= 0 {
		cl.leaders = slices.Delete(cl.leaders, i, i+1)
	}
	done, cerr, again := c.done, c.err, c.abandoned
	c.abandoned = !done
	if again && !done && cl.pending[c.id] == c {
		delete(cl.pending, c.id)
		c.done = true
	}
	cl.mu.Unlock()
	if passOn {
		cl.passRole()
	}
	if done {
		return cerr // what the reply grants is the caller's
	}
	if !again && cl.p.Watch == WatchHangUp && cl.watch != nil {
		go cl.awaitAbandoned(c) // nobody reads what arrives while no caller does
	}
	return ctx.Err()
}

// awaitAbandoned reads for c, abandoned, until its reply has been handled, the
// connection ends, or AbandonTimeout passes.
func (cl *Client[F]) awaitAbandoned(c *call[F]) {
	ctx, cancel := context.WithTimeout(context.Background(), AbandonTimeout)
	defer cancel()
	cl.mu.Lock()
	lead := false
	switch {
	case c.done:
		cl.mu.Unlock()
		return
	case cl.reading == readerNone:
		cl.reading, lead = readerCaller, true
	default:
		cl.leaders = append(cl.leaders, c)
	}
	cl.mu.Unlock()
	_ = cl.wait(ctx, c, lead) // the reply was handled unclaimed, or the wait gave up
}

// handOn reads a frame, waiting for it or not (ErrNoFrame), and dispatches it; it
// returns the call the frame completed, if any.
func (cl *Client[F]) handOn(wait bool) (*call[F], error) {
	f, err := cl.fr.Next(wait)
	if err != nil {
		return nil, err
	}
	return cl.dispatch(f)
}

// dispatch hands a frame to its call, or else to the protocol. An error ends the
// connection.
func (cl *Client[F]) dispatch(f F) (*call[F], error) {
	id, last := cl.p.ReplyTo(f)
	if id == 0 {
		return nil, cl.p.Push(f)
	}
	cl.mu.Lock()
	c := cl.pending[id]
	if c == nil {
		cl.mu.Unlock()
		return nil, cl.p.Push(f)
	}
	if last {
		delete(cl.pending, id)
	}
	claimed := !c.abandoned
	cl.mu.Unlock()
	err := c.handle.Handle(f, claimed)
	if !last {
		if err == nil {
			return nil, nil
		}
		cl.mu.Lock()
		mine := cl.pending[id] == c // else the connection failed meanwhile, and completed it
		if mine {
			delete(cl.pending, id)
		}
		cl.mu.Unlock()
		if !mine {
			return nil, nil
		}
	}
	cl.complete(c, err)
	return c, nil
}

// complete ends c, taken out of the calls, with err, and wakes its caller.
func (cl *Client[F]) complete(c *call[F], err error) {
	cl.mu.Lock()
	c.done, c.err = true, err
	cl.mu.Unlock()
	c.signal()
}

// Fail ends the connection for why: it closes it, and every call waiting and every
// later one fails with [Protocol].Gone's error for why. Only the first Fail counts.
func (cl *Client[F]) Fail(why error) {
	err := cl.p.Gone(why)
	cl.mu.Lock()
	if cl.down != nil {
		cl.mu.Unlock()
		cl.closeConn()
		return
	}
	cl.down = err
	failed := cl.pending
	cl.pending = map[uint64]*call[F]{}
	close(cl.done)
	cl.mu.Unlock()
	cl.closeConn()
	for _, c := range failed {
		cl.complete(c, err)
	}
	if cl.p.Down != nil {
		cl.p.Down(why)
	}
}

// closeConn closes the connection and its watch.
func (cl *Client[F]) closeConn() {
	_ = cl.nc.Close() // cleanup: nothing is left to do if closing fails
	if cl.watch != nil {
		cl.watch.Close()
	}
}

// errOr is why the connection ended, or err while it carries calls.
func (cl *Client[F]) errOr(err error) error {
	if down := cl.Err(); down != nil {
		return down
	}
	return err
}

// hold takes the reading role, waiting for it until ctx ends.
func (cl *Client[F]) hold(ctx context.Context) error {
	c := &call[F]{wake: make(chan struct{}, 1)}
	cl.mu.Lock()
	if cl.reading == readerNone {
		cl.reading = readerCaller
		cl.mu.Unlock()
		cl.quiet()
		return nil
	}
	cl.leaders = append(cl.leaders, c)
	cl.mu.Unlock()
	for {
		select {
		case <-c.wake:
			cl.mu.Lock()
			lead := c.lead
			c.lead = false
			cl.mu.Unlock()
			if lead {
				cl.quiet()
				return nil
			}
		case <-ctx.Done():
			cl.forget(c, false)
			return ctx.Err()
		}
	}
}

// Hold takes the reading role, waiting for it until ctx ends, and returns what gives
// it back: while it is held no frame is read, and none is being handled, so that
// what the replies handled so far recorded is all there is. It fails only with ctx's
// error.
func (cl *Client[F]) Hold(ctx context.Context) (release func(), err error) {
	if err := cl.hold(ctx); err != nil {
		return nil, err
	}
	return cl.passRole, nil
}

// Drain reads, with the reading role, every frame the peer sends until the
// connection ends, and dispatches them; it returns nil once the connection has ended,
// or ctx's error if ctx ends first.
func (cl *Client[F]) Drain(ctx context.Context) error {
	if err := cl.hold(ctx); err != nil {
		return err
	}
	if err := cl.lead(ctx, nil); ctx.Err() != nil {
		return err
	}
	return nil
}

// rawOf is the socket behind nc, nil if it has none (not a Unix socket, or closed).
func rawOf(nc net.Conn) syscall.RawConn {
	uc, ok := nc.(*net.UnixConn)
	if !ok {
		return nil
	}
	rc, err := uc.SyscallConn()
	if err != nil {
		return nil
	}
	return rc
}
