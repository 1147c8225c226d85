package keep

import (
	"context"
	"errors"
	"fmt"
	"net"
	"os"
	"sync"
	"time"

	"github.com/cudapool/cudapool/internal/session"
	"github.com/cudapool/cudapool/kv/internal/kvwire"
)

// Client is a page server's connection to its keeper: it holds one connection for its
// life, so that the keeper knows a page server is there, and Done says when the keeper
// has gone. Its methods are safe for concurrent use; each blocking one is bounded by
// its context.
type Client struct {
	nc  *net.UnixConn
	w   *session.Writer
	pid int

	mu      sync.Mutex
	pending map[uint32]*call
	id      uint32
	err     error // why the connection ended, once done is closed
	done    chan struct{}
}

// call is one request waiting for its answer.
type call struct {
	ready chan struct{} // closed once the answer is whole, or the connection ended
	h     Header
	m     any   // the answer's message; a List's entries gather in listed
	fd    int   // Taken's descriptor, or -1
	err   error // the connection's end, if it ended first
	list  []Entry
}

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
	c := &Client{nc: nc, w: session.NewWriter(nc, writeTimeout), pending: map[uint32]*call{}, done: make(chan struct{})}
	f := newFrames(nc, kvwire.NewReader())
	if err := c.hello(ctx, f, role); err != nil {
		f.close()
		_ = nc.Close() // cleanup: the handshake's error is the one returned
		return nil, err
	}
	go c.read(f)
	return c, nil
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
	h, p, fd, err := f.next()
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
func (c *Client) Done() <-chan struct{} { return c.done }

// Err is why the connection ended, once Done is closed; nil before.
func (c *Client) Err() error {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.err
}

// Close ends the connection: every call waiting fails with [ErrGone]. The keeper keeps
// what it keeps. A second Close does nothing.
func (c *Client) Close() error {
	err := c.nc.Close()
	<-c.done
	if errors.Is(err, net.ErrClosed) {
		return nil
	}
	return err
}

// read takes the keeper's answers and hands each to its call, until the connection
// ends; then it fails every call still waiting.
func (c *Client) read(f *frames) {
	var err error
	for err == nil {
		var h Header
		var p []byte
		var fd int
		if h, p, fd, err = f.next(); err == nil {
			err = c.deliver(h, p, fd)
		}
	}
	f.close()
	_ = c.nc.Close() // cleanup: the connection is over either way
	c.mu.Lock()
	c.err = fmt.Errorf("%w: %w", ErrGone, err)
	for id, cl := range c.pending {
		cl.err = c.err
		close(cl.ready)
		delete(c.pending, id)
	}
	c.mu.Unlock()
	close(c.done)
}

// deliver hands the answer h, p (fd for Taken) to its call; an answer nobody waits for
// (its call gave up) is dropped. An answer that breaks the layout ends the connection.
func (c *Client) deliver(h Header, p []byte, fd int) error {
	m, err := Decode(h, p)
	if err != nil {
		closeFD(fd)
		return err
	}
	if h.Type == TypeHello || h.Type == TypePut || h.Type == TypeTake || h.Type == TypeDrop || h.Type == TypeList {
		closeFD(fd)
		return fmt.Errorf("%w: the keeper sent %s", ErrMalformed, h.Type)
	}
	c.mu.Lock()
	defer c.mu.Unlock()
	cl, ok := c.pending[h.ID]
	if !ok {
		closeFD(fd)
		return nil
	}
	if l, ok := m.(Listed); ok {
		cl.list = append(cl.list, l.Entries...) // the payload's strings are copies already
		if l.More {
			return nil
		}
		m = Listed{Entries: cl.list}
	}
	cl.h, cl.m, cl.fd = h, m, fd
	delete(c.pending, h.ID)
	close(cl.ready)
	return nil
}

// do sends the request m of type t (with fd, if not negative) and waits, until ctx
// ends, for its answer: the answer's header and message, and Taken's descriptor
// (which the caller owns). An Error answer is its error.
func (c *Client) do(ctx context.Context, t Type, m any, fd int) (Header, any, int, error) {
	cl := &call{ready: make(chan struct{}), fd: -1}
	c.mu.Lock()
	if c.err != nil {
		err := c.err
		c.mu.Unlock()
		return Header{}, nil, -1, err
	}
	c.id++
	id := c.id
	c.pending[id] = cl
	c.mu.Unlock()
	fill := func(b []byte) ([]byte, error) { return Append(b, t, id, m) }
	var err error
	if fd >= 0 {
		err = c.w.WriteFD(ctx, fd, fill)
	} else {
		err = c.w.Write(ctx, fill)
	}
	if errors.Is(err, session.ErrBroken) {
		_ = c.nc.Close() // the keeper cannot find the next frame: read ends, and says why
	}
	if err == nil {
		select {
		case <-cl.ready:
		case <-ctx.Done():
			err = ctx.Err()
		}
	}
	c.mu.Lock()
	if _, waiting := c.pending[id]; waiting {
		delete(c.pending, id)
		c.mu.Unlock()
		return Header{}, nil, -1, fmt.Errorf("keep: %s: %w", t, err)
	}
	c.mu.Unlock()
	if cl.err != nil {
		return Header{}, nil, -1, cl.err
	}
	if p, ok := cl.m.(Problem); ok {
		closeFD(cl.fd)
		return cl.h, nil, -1, remote(cl.h.Type, p)
	}
	return cl.h, cl.m, cl.fd, nil
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
