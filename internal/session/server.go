package session

import (
	"errors"
	"fmt"
	"hash/fnv"
	"log/slog"
	"net"
	"runtime/debug"
	"sync"
	"time"

	"github.com/cudapool/cudapool/internal/peercred"
)

// Defaults of Limits.
const (
	DefaultHandshakeTimeout = 10 * time.Second
	DefaultHandshakes       = 1024
	DefaultHandshakesPerUID = 128
	DefaultConns            = 4096
	DefaultConnsPerProcess  = 64
)

// Limits bound what a server gives its connections. A zero field takes its default.
type Limits struct {
	// HandshakeTimeout bounds the time from accept to Admit: past it, the
	// connection's reads and writes fail. Default DefaultHandshakeTimeout.
	HandshakeTimeout time.Duration
	// Handshakes and HandshakesPerUID cap the connections accepted and not yet
	// admitted, in all and per uid (the peers on byte streams of one host count as one
	// uid): one past a cap is closed at once, logged. So a user whom the policy
	// refuses cannot hold every descriptor. Defaults 1024 and 128.
	Handshakes, HandshakesPerUID int
	// Conns and ConnsPerProcess cap the admitted connections, in all and per process
	// (pid; the peers on byte streams of one host count as one process): Admit past a
	// cap fails naming it. Defaults 4096 and 64.
	Conns, ConnsPerProcess int
}

// WithDefaults is l with each zero field at its default: the limits a [Server] made
// with l keeps.
func (l Limits) WithDefaults() Limits {
	def := func(v *int, d int) {
		if *v <= 0 {
			*v = d
		}
	}
	if l.HandshakeTimeout <= 0 {
		l.HandshakeTimeout = DefaultHandshakeTimeout
	}
	def(&l.Handshakes, DefaultHandshakes)
	def(&l.HandshakesPerUID, DefaultHandshakesPerUID)
	def(&l.Conns, DefaultConns)
	def(&l.ConnsPerProcess, DefaultConnsPerProcess)
	return l
}

// ErrLimit means a connection was refused because a cap of Limits is full; the
// error names the cap and its value.
var ErrLimit = errors.New("connection limit reached")

// ErrClosed means the server was shut down: it serves no new listener.
var ErrClosed = errors.New("the server is shut down")

// remoteKey stands for a peer on a byte stream whose address names no host (a pipe),
// in the caps; no pid of Linux takes it.
const remoteKey = ^uint32(0)

// hostKey is a peer on a byte stream's key in the caps, which has no credentials: its
// host's, so that each host counts as one user (its handshakes) and as one process
// (its connections). The top bit is set, which no pid of Linux has (pid_max is at
// most 2^22). An address without an IP gives remoteKey.
func hostKey(addr net.Addr) uint32 {
	var ip net.IP
	switch a := addr.(type) {
	case *net.TCPAddr:
		ip = a.IP
	case *net.IPAddr:
		ip = a.IP
	}
	if ip == nil {
		return remoteKey
	}
	h := fnv.New32a()
	_, _ = h.Write(ip.To16()) // a hash's Write never fails
	return h.Sum32() | 1<<31
}

// Server serves the connections of its listeners, Unix sockets and byte streams alike,
// with one handler, under one set of caps and one handshake timeout: net/http's
// Server, for the framing of cudapool's protocols. Its methods are safe for concurrent
// use.
type Server struct {
	log   *slog.Logger
	who   string
	lim   Limits
	serve func(*Conn)

	shakes *Counter
	conns  *Counter

	mu        sync.Mutex
	closed    bool
	listeners []net.Listener
	live      map[*Conn]struct{} // served and not detached
	wg        sync.WaitGroup     // the accept loops and the handlers not detached
}

// Conn is an accepted connection and the peer at its other end.
type Conn struct {
	net.Conn
	// UnixConn is the connection as a Unix socket, which carries descriptors; nil on a
	// byte stream.
	UnixConn *net.UnixConn
	// Cred names the process that connected, as the kernel recorded it; zero for a
	// peer on a byte stream (Remote).
	Cred peercred.Cred
	// Remote: the peer is on a byte stream (TCP); nothing names it but what it says.
	Remote bool

	s    *Server
	host uint32 // a remote peer's key in the caps (hostKey)
	// done gives back c's place in s.wg, once; set before its handler starts.
	done func()
	// Under s.mu:
	shaking  bool // holds a handshake slot
	admitted bool // holds a connection slot
}

// NewServer returns a Server that hands each connection its listeners accept to serve
// on a goroutine of its own, once the handshake caps have room for it; its reads and
// writes are bounded by the handshake timeout until [Conn.Admit]. When serve returns,
// or panics, the connection is closed and its slots are given back; a panic is logged
// with its stack (who names the server) and the server serves on. A Unix connection
// whose peer's credentials cannot be read is closed unserved. log nil logs nothing.
// [Server.Serve] gives it listeners; [Server.Close] stops it.
func NewServer(log *slog.Logger, who string, lim Limits, serve func(*Conn)) *Server {
	if log == nil {
		log = slog.New(slog.DiscardHandler)
	}
	lim = lim.WithDefaults()
	return &Server{log: log, who: who, lim: lim, serve: serve,
		shakes: NewCounter(lim.Handshakes, lim.HandshakesPerUID), conns: NewCounter(lim.Conns, lim.ConnsPerProcess),
		live: map[*Conn]struct{}{}}
}

// Serve is [NewServer] serving ln.
func Serve(ln net.Listener, log *slog.Logger, who string, lim Limits, serve func(*Conn)) *Server {
	s := NewServer(log, who, lim, serve)
	_ = s.Serve(ln) // a new server is not shut down
	return s
}

// Serve accepts connections on ln, on a goroutine of its own, until ln fails for good
// or the server is shut down, which closes ln. It returns at once: nil, or [ErrClosed]
// after [Server.Shutdown] (ln is then left open, the caller's).
func (s *Server) Serve(ln net.Listener) error {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.closed {
		return ErrClosed
	}
	s.listeners = append(s.listeners, ln)
	s.wg.Add(1)
	go func() {
		defer s.wg.Done()
		AcceptLoop(ln, s.log, s.who, s.isClosed, s.start, time.Sleep)
	}()
	return nil
}

// Limits are the server's limits, defaults filled in.
func (s *Server) Limits() Limits { return s.lim }

// Count is how many connections are in their handshake, and how many admitted.
func (s *Server) Count() (handshakes, admitted int) {
	handshakes, _ = s.shakes.Count(0)
	admitted, _ = s.conns.Count(0)
	return handshakes, admitted
}

func (s *Server) isClosed() bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.closed
}

// start takes a handshake slot for nc and serves it, or closes it.
func (s *Server) start(nc net.Conn) {
	c := &Conn{Conn: nc, s: s}
	var key uint32
	if c.UnixConn, _ = nc.(*net.UnixConn); c.UnixConn != nil {
		cred, err := peercred.Get(c.UnixConn)
		if err != nil {
			s.log.Warn(s.who+": cannot name a connecting process; connection closed", "err", err)
			_ = nc.Close() // cleanup: nothing was said on it
			return
		}
		c.Cred, key = cred, cred.UID
	} else {
		c.Remote = true
		c.host = hostKey(nc.RemoteAddr())
		key = c.host
	}
	if ok, full := s.shakes.Enter(key); !ok {
		s.log.Warn(s.who+": too many handshakes in progress; connection closed", "pid", c.Cred.PID, "uid", c.Cred.UID, "remote", c.remoteAddr(),
			"cap", full, "total", s.lim.Handshakes, "per_uid", s.lim.HandshakesPerUID)
		_ = nc.Close() // cleanup: nothing was said on it
		return
	}
	s.mu.Lock()
	if s.closed {
		s.mu.Unlock()
		s.shakes.Leave(key)
		_ = nc.Close() // cleanup: nothing was said on it
		return
	}
	c.shaking = true
	c.done = sync.OnceFunc(s.wg.Done)
	s.live[c] = struct{}{}
	s.wg.Add(1)
	s.mu.Unlock()
	_ = nc.SetDeadline(time.Now().Add(s.lim.HandshakeTimeout)) // it fails only on a closed connection, which the handler's first read reports
	go s.run(c)
}

// remoteHost names a remote peer's host: its address without the port.
func (c *Conn) remoteHost() string {
	addr := c.RemoteAddr().String()
	if host, _, err := net.SplitHostPort(addr); err == nil {
		return host
	}
	return addr
}

// remoteAddr is what the log says of a peer on a byte stream: its address.
func (c *Conn) remoteAddr() string {
	if !c.Remote {
		return ""
	}
	return c.RemoteAddr().String()
}

// run serves c and then gives back what it held, a panic contained.
func (s *Server) run(c *Conn) {
	defer c.done()
	defer func() {
		if p := recover(); p != nil {
			_ = Recovered(s.log, s.who, c.Cred.PID, p) // logged; the connection closes next
		}
		_ = c.Conn.Close() // cleanup: the connection's service is over
		s.mu.Lock()
		c.leaveLocked()
		delete(s.live, c)
		s.mu.Unlock()
	}()
	s.serve(c)
}

// Close gives back c's slots and closes the connection. Only c's handler calls it;
// the handler's return does the same.
func (c *Conn) Close() error {
	c.s.mu.Lock()
	c.leaveLocked()
	c.s.mu.Unlock()
	return c.Conn.Close()
}

// Recovered logs v, a panic recovered while serving pid's connection, with its stack
// (log, under who's name), as net/http does, and returns it as an error: the caller
// closes that connection alone and serves on.
func Recovered(log *slog.Logger, who string, pid int, v any) error {
	log.Error(who+": panic serving a connection; it is closed", "pid", pid, "panic", v, "stack", string(debug.Stack()))
	return fmt.Errorf("%s: panic serving the connection: %v", who, v)
}

// leaveLocked gives back c's slots. Call with c.s.mu held.
func (c *Conn) leaveLocked() {
	if c.shaking {
		c.shaking = false
		c.s.shakes.Leave(c.uid())
	}
	if c.admitted {
		c.admitted = false
		c.s.conns.Leave(c.pid())
	}
}

// uid is c's key in the handshake caps, pid in the connection caps.
func (c *Conn) uid() uint32 {
	if c.Remote {
		return c.host
	}
	return c.Cred.UID
}

func (c *Conn) pid() uint32 {
	if c.Remote {
		return c.host
	}
	return uint32(c.Cred.PID)
}

// Admits says why uids, gids and remote do not admit c's peer, or "" if they do: a
// peer on a byte stream is admitted by remote alone (a Policy's AllowRemote), a local
// one as [Admits] says.
func (c *Conn) Admits(uids, gids []uint32, remote bool, who string) string {
	if c.Remote {
		if remote {
			return ""
		}
		return "peers without credentials (not on a Unix socket) are not allowed: " + who + "'s policy does not set AllowRemote"
	}
	return Admits(uids, gids, c.Cred, who)
}

// Admit ends c's handshake: its handshake slot is given back, its deadline cleared,
// and it takes a connection slot (the peers on a byte stream of one host count as one
// process). If a connection cap is full it fails with an error wrapping
// [ErrLimit] that names the cap (the handler refuses the peer with it), and c holds no
// slot. Only c's handler calls it, once.
func (c *Conn) Admit() error {
	s := c.s
	s.mu.Lock()
	if c.shaking {
		c.shaking = false
		s.shakes.Leave(c.uid())
	}
	ok, full := s.conns.Enter(c.pid())
	c.admitted = ok
	s.mu.Unlock()
	if !ok {
		switch {
		case full == "total":
			return fmt.Errorf("%w: %d connections, the most the server takes (its connection limit)", ErrLimit, s.lim.Conns)
		case c.Remote:
			return fmt.Errorf("%w: the peers on byte streams from %s (one process, as the caps count them) hold %d connections, the most one process may have (its connection limit per process)", ErrLimit, c.remoteHost(), s.lim.ConnsPerProcess)
		}
		return fmt.Errorf("%w: pid %d has %d connections, the most one process may have (its connection limit per process)", ErrLimit, c.Cred.PID, s.lim.ConnsPerProcess)
	}
	_ = c.SetDeadline(time.Time{}) // it fails only on a closed connection, which the next read or write reports
	return nil
}

// Detach takes c out of what [Server.Close] closes and waits for: its handler serves
// it on after Close has returned (an exporter's peer whose leases Close abandoned).
// Its slots are given back when its handler returns. Only c's handler, or the code
// that ends the server, calls it.
func (c *Conn) Detach() {
	c.s.mu.Lock()
	delete(c.s.live, c)
	c.s.mu.Unlock()
	c.done()
}

// Shutdown stops the server taking connections: it closes the listeners and every
// connection still in its handshake. Admitted connections are served on, for the
// protocol to end as it ends them ([Server.Close] closes them). Later calls do
// nothing.
func (s *Server) Shutdown() {
	s.mu.Lock()
	s.closed = true
	listeners := s.listeners
	s.listeners = nil
	var shaking []net.Conn
	for c := range s.live {
		if c.shaking {
			shaking = append(shaking, c.Conn)
		}
	}
	s.mu.Unlock()
	for _, l := range listeners {
		_ = l.Close() // cleanup: nothing is left to do if closing fails
	}
	for _, nc := range shaking {
		_ = nc.Close() // cleanup: a connection not admitted holds nothing
	}
}

// Close shuts the server down ([Server.Shutdown]), closes every connection not
// detached (each handler's reads and writes then fail), and waits for the accept
// loops and those handlers to return.
func (s *Server) Close() {
	s.Shutdown()
	s.mu.Lock()
	live := make([]net.Conn, 0, len(s.live))
	for c := range s.live {
		live = append(live, c.Conn)
	}
	s.mu.Unlock()
	for _, nc := range live {
		_ = nc.Close() // cleanup: closing it is what ends its service
	}
	s.wg.Wait()
}
