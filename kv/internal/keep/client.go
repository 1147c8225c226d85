package keep

import (
	"context"
	"errors"
	"fmt"
	"math"
	"net"
	"os"
	"time"

	"github.com/cudapool/cudapool/internal/session"
	"github.com/cudapool/cudapool/kv/internal/kvwire"
)

// Client is a connection to the keeper, held for the client's life, so that the
// keeper knows it is there; Done says when the keeper has gone. A page server's makes
// requests, on a [session.Client]. Its methods are safe for concurrent use; each
// blocking one is bounded by its context.
type Client struct {
	nc  *net.UnixConn
	w   *session.Writer
	f   *frames // read by the reading role's holder alone
	s   *session.Client[frame]
	pid int
}

// frame is one of the keeper's answers as the Client reads it: its header, its
// message, and the descriptor that came with it (Taken's; -1 if none), which its
// handler takes or closes.
type frame struct {
	Header
	m  any
	fd int
}

// reader reads the keeper's answers for the [session.Client].
type reader struct{ f *frames }

// Next reads the next answer, waiting for it or not (session.ErrNoFrame). One that
// breaks the layout, or is a request's (which the keeper never sends), fails with an
// error wrapping [ErrMalformed]: the connection ends. Once the stream
// cannot be read further, the descriptors that came and were not taken are closed.
func (r reader) Next(wait bool) (frame, error) {
	h, p, fd, err := r.f.next(wait)
	if err != nil {
		if !errors.Is(err, session.ErrNoFrame) && !errors.Is(err, os.ErrDeadlineExceeded) {
			r.f.close()
		}
		return frame{}, err
	}
	m, err := Decode(h, p)
	if err == nil {
		err = notAnswer(h.Type)
	}
	if err != nil {
		closeFD(fd)
		return frame{}, err
	}
	return frame{Header: h, m: m, fd: fd}, nil
}

// Buffered reports whether a whole frame is buffered.
func (r reader) Buffered() bool { return r.f.rd.Whole() }

// Dial connects to the keeper's socket at path and says Hello, as role: a page server
// ([RoleServer]) or a holder ([RoleHolder], whose requests the keeper refuses; it
// holds the connection so that the keeper stays, and learns of its death by Done). It
// fails with an error wrapping [ErrRefused] where the keeper refuses this user or
// version (naming both versions), and with the dial's error where no keeper listens.
// On failure nothing is left open.
func Dial(ctx context.Context, path string, role Role) (*Client, error) {
	nc, err := session.Dial(ctx, path, false)
	if err != nil {
		return nil, fmt.Errorf("keep: the keeper's socket: %w", err)
	}
	f := newFrames(nc, kvwire.NewReader())
	c := &Client{nc: nc, w: session.NewWriter(nc, writeTimeout), f: f}
	if err := c.hello(ctx, f, role); err != nil {
		f.close()
		_ = nc.Close() // cleanup: the handshake's error is the one returned
		return nil, err
	}
	c.s = session.NewClient[frame](nc, reader{f}, session.Protocol[frame]{
		ReplyTo: replyTo,
		Push:    push,
		Writer:  c.w,
		Gone:    func(why error) error { return fmt.Errorf("%w: %w", ErrGone, why) },
		// The keeper sends nothing unasked: what comes while no call reads is read at
		// once, so that a late answer's descriptor is closed then, and a frame that
		// breaks the protocol ends the connection then.
		Watch: session.WatchArrivals,
		MaxID: math.MaxUint32,
	})
	c.s.Start()
	return c, nil
}

// replyTo says which request f answers, and whether it is its answer's last frame.
func replyTo(f frame) (uint64, bool) {
	if l, ok := f.m.(Listed); ok {
		return uint64(f.ID), !l.More
	}
	return uint64(f.ID), true
}

// push takes an answer that no call waits for: it is dropped, its descriptor closed.
func push(f frame) error {
	closeFD(f.fd)
	return nil
}

// notAnswer fails, with an error wrapping [ErrMalformed], for a frame of type t that
// the keeper never sends: a request's.
func notAnswer(t Type) error {
	switch t {
	case TypeHello, TypePut, TypeTake, TypeDrop, TypeList:
		return fmt.Errorf("%w: the keeper sent %s", ErrMalformed, t)
	}
	return nil
}

// hello says Hello and reads the answer, within ctx.
func (c *Client) hello(ctx context.Context, f *frames, role Role) error {
	err := c.w.Write(ctx, func(b []byte) ([]byte, error) {
		return Append(b, TypeHello, 1, Hello{Version: Version, PID: uint32(os.Getpid()), Role: role})
	})
	if err != nil {
		return fmt.Errorf("keep: saying Hello to the keeper: %w", err)
	}
	stop := context.AfterFunc(ctx, func() { _ = c.nc.SetReadDeadline(time.Unix(1, 0)) }) // it only wakes the read
	defer stop()
	h, p, fd, err := f.next(true)
	if err != nil {
		if ctx.Err() != nil {
			err = errors.Join(ctx.Err(), err)
		}
		return fmt.Errorf("keep: the keeper's answer to Hello: %w", err)
	}
	closeFD(fd)
	m, err := Decode(h, p)
	if err != nil {
		return fmt.Errorf("keep: the keeper's answer to Hello: %w", err)
	}
	switch v := m.(type) {
	case Problem:
		// A keeper of version 1 refuses this version's Hello by its length, not its version.
		return fmt.Errorf("%w (this client speaks keeper protocol version %d)", remote(h.Type, v), Version)
	case Welcome:
		if v.Version != Version {
			return fmt.Errorf("%w: the keeper speaks keeper protocol version %d; this client speaks %d", ErrRefused, v.Version, Version)
		}
		c.pid = int(v.PID)
		_ = c.nc.SetReadDeadline(time.Time{}) // it fails only on a closed connection, which the next read reports
		return nil
	}
	return fmt.Errorf("%w: the keeper answered Hello with %s", ErrMalformed, h.Type)
}

// remote is the error an Error or Refused frame stands for.
func remote(t Type, p Problem) error {
	sentinel, ok := codes[p.Code]
	if !ok {
		sentinel = ErrInternal
	}
	if t == TypeRefused && sentinel != ErrRefused {
		return fmt.Errorf("%w: %w: %s", ErrRefused, sentinel, p.Text)
	}
	return fmt.Errorf("%w: %s", sentinel, p.Text)
}

// KeeperPID is the keeper's pid, as its Welcome said.
func (c *Client) KeeperPID() int { return c.pid }

// Done is closed once the connection has ended: the keeper stopped or died (what it
// kept is gone), or Close was called. Err then says why.
func (c *Client) Done() <-chan struct{} { return c.s.Done() }

// Err is why the connection ended, once Done is closed; nil before.
func (c *Client) Err() error { return c.s.Err() }

// Close ends the connection: every call waiting fails with [ErrGone]. The keeper keeps
// what it keeps. A second Close does nothing.
func (c *Client) Close() error {
	c.s.Fail(net.ErrClosed)
	<-c.s.ReaderDone()
	// With the reading role, once every reader has seen the end: the descriptors
	// that came and were not taken are closed.
	release, err := c.s.Hold(context.Background())
	if err == nil {
		c.f.close()
		release()
	}
	return nil
}

// answer is what a call's handler keeps of the keeper's answer.
type answer struct {
	h    Header
	m    any // a List's entries gather in list
	fd   int // Taken's descriptor, or -1
	list []Entry
}

// Handle keeps the answer f for its caller; one nobody claims is dropped, its
// descriptor closed.
func (a *answer) Handle(f frame, claimed bool) error {
	if !claimed {
		closeFD(f.fd)
		return nil
	}
	if l, ok := f.m.(Listed); ok {
		a.list = append(a.list, l.Entries...) // the payload's strings are copies already
		if l.More {
			return nil
		}
		f.m = Listed{Entries: a.list}
	}
	a.h, a.m, a.fd = f.Header, f.m, f.fd
	return nil
}

// do sends the request m of type t (with fd, if not negative) and waits, until ctx
// ends, for its answer: the answer's header and message, and Taken's descriptor
// (which the caller owns). An Error answer is its error; an answer that comes after
// ctx ended is dropped, its descriptor closed.
func (c *Client) do(ctx context.Context, t Type, m any, fd int) (Header, any, int, error) {
	a := &answer{fd: -1}
	build := func(b []byte, id uint64) ([]byte, error) { return Append(b, t, uint32(id), m) }
	err := c.s.CallFD(ctx, fd, build, a)
	if err != nil {
		closeFD(a.fd)
		return Header{}, nil, -1, fmt.Errorf("keep: %s: %w", t, err)
	}
	if p, ok := a.m.(Problem); ok {
		closeFD(a.fd)
		return a.h, nil, -1, remote(a.h.Type, p)
	}
	return a.h, a.m, a.fd, nil
}

// expect checks that the answer to a t is of type want.
func expect(t Type, h Header, want Type) error {
	if h.Type != want {
		return fmt.Errorf("%w: the keeper answered %s with %s, not %s", ErrMalformed, t, h.Type, want)
	}
	return nil
}

// Put asks the keeper to keep fd (the caller keeps its own) under name, with size,
// which Take and List give back (the keeper does not check it); a descriptor kept
// under name before is closed by the keeper. It fails with an error wrapping [ErrName]
// for a bad name, [ErrLimit] where the keeper keeps [MaxKept] names, [ErrGone] where the
// keeper has gone; then nothing is kept under name by this call.
func (c *Client) Put(ctx context.Context, name string, fd int, size uint64) error {
	if fd < 0 {
		return fmt.Errorf("keep: Put of %q: no descriptor (%d)", name, fd)
	}
	if err := checkName(name); err != nil {
		return err
	}
	h, _, afd, err := c.do(ctx, TypePut, Put{Name: name, Size: size}, fd)
	closeFD(afd)
	if err != nil {
		return err
	}
	return expect(TypePut, h, TypeDone)
}

// Take returns a duplicate of the descriptor kept under name, which the caller owns
// and closes, and its size; the keeper keeps its own. It fails with an error wrapping
// [ErrNotKept] where nothing is kept under name.
func (c *Client) Take(ctx context.Context, name string) (fd int, size uint64, err error) {
	if err := checkName(name); err != nil {
		return -1, 0, err
	}
	h, m, fd, err := c.do(ctx, TypeTake, Name{Name: name}, -1)
	if err != nil {
		return -1, 0, err
	}
	if err := expect(TypeTake, h, TypeTaken); err != nil {
		closeFD(fd)
		return -1, 0, err
	}
	return fd, m.(Taken).Size, nil
}

// Drop makes the keeper close the descriptor kept under name: its memory lives on
// while another process holds or maps it. It fails with an error wrapping [ErrNotKept]
// where nothing is kept under name.
func (c *Client) Drop(ctx context.Context, name string) error {
	if err := checkName(name); err != nil {
		return err
	}
	h, _, fd, err := c.do(ctx, TypeDrop, Name{Name: name}, -1)
	closeFD(fd)
	if err != nil {
		return err
	}
	return expect(TypeDrop, h, TypeDone)
}

// List returns what the keeper keeps under the names that begin with prefix ("" for
// every name), by name.
func (c *Client) List(ctx context.Context, prefix string) ([]Entry, error) {
	if len(prefix) > MaxName {
		return nil, fmt.Errorf("%w: a prefix of %d bytes, at most %d", ErrName, len(prefix), MaxName)
	}
	h, m, fd, err := c.do(ctx, TypeList, Name{Name: prefix}, -1)
	closeFD(fd)
	if err != nil {
		return nil, err
	}
	if err := expect(TypeList, h, TypeListed); err != nil {
		return nil, err
	}
	return m.(Listed).Entries, nil
}
