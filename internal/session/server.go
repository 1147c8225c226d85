package session

import (
	"errors"
	"fmt"
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
	// admitted, in all and per uid: one past a cap is closed at once, logged. So a user
	// whom the policy refuses cannot hold every descriptor. Defaults 1024 and 128.
	Handshakes, HandshakesPerUID int
	// Conns and ConnsPerProcess cap the admitted connections, in all and per process
	// (pid): Admit past a cap fails naming it. Defaults 4096 and 64.
	Conns, ConnsPerProcess int
}

func (l Limits) withDefaults() Limits {
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

// Server serves the connections of one listener. Its methods are safe for concurrent
// use.
type Server struct {
	ln    net.Listener
	log   *slog.Logger
	who   string
	lim   Limits
	serve func(*Conn)

	shakes *Counter
	conns  *Counter

	mu     sync.Mutex
	closed bool
	live   map[*Conn]struct{}
	wg     sync.WaitGroup
}

// Conn is an accepted connection and the process at its other end.
type Conn struct {
	*net.UnixConn
	// Cred names the process that connected, as the kernel recorded it.
	Cred peercred.Cred

	s        *Server
	shaking  bool // holds a handshake slot; the handler's goroutine alone
	admitted bool // holds a connection slot; the handler's goroutine alone
}

// Serve starts serving ln: each accepted Unix connection whose peer's credentials can
// be read, while the handshake caps allow, goes to serve on a goroutine of its own,
// its reads and writes bounded by the handshake timeout until Admit. When serve
// returns, or panics, the connection is closed and its slots are given back; a panic
// is logged with its stack (who names the server) and the server serves on. Close
// stops it. log nil logs nothing.
func Serve(ln net.Listener, log *slog.Logger, who string, lim Limits, serve func(*Conn)) *Server {
	if log == nil {
		log = slog.New(slog.DiscardHandler)
	}
	lim = lim.withDefaults()
	s := &Server{ln: ln, log: log, who: who, lim: lim, serve: serve,
		shakes: NewCounter(lim.Handshakes, lim.HandshakesPerUID), conns: NewCounter(lim.Conns, lim.ConnsPerProcess),
		live: map[*Conn]struct{}{}}
	s.wg.Add(1)
	go func() {
		defer s.wg.Done()
		AcceptLoop(ln, log, who, s.isClosed, s.start, time.Sleep)
	}()
	return s
}

// Limits are the server's limits, defaults filled in.
func (s *Server) Limits() Limits { return s.lim }

func (s *Server) isClosed() bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.closed
}

// start takes a handshake slot for nc and serves it, or closes it.
func (s *Server) start(nc net.Conn) {
	uc, ok := nc.(*net.UnixConn)
	if !ok {
		_ = nc.Close() // cleanup: only Unix connections name their peer
		return
	}
	cred, err := peercred.Get(uc)
	if err != nil {
		s.log.Warn(s.who+": cannot name a connecting process; connection closed", "err", err)
		_ = nc.Close() // cleanup: nothing was said on it
		return
	}
	if ok, full := s.shakes.Enter(cred.UID); !ok {
		s.log.Warn(s.who+": too many handshakes in progress; connection closed", "pid", cred.PID, "uid", cred.UID, "cap", full,
			"total", s.lim.Handshakes, "per_uid", s.lim.HandshakesPerUID)
		_ = nc.Close() // cleanup: nothing was said on it
		return
	}
	c := &Conn{UnixConn: uc, Cred: cred, s: s, shaking: true}
	s.mu.Lock()
	if s.closed {
		s.mu.Unlock()
		s.shakes.Leave(cred.UID)
		_ = nc.Close() // cleanup: nothing was said on it
		return
	}
	s.live[c] = struct{}{}
	s.wg.Add(1)
	s.mu.Unlock()
	_ = uc.SetDeadline(time.Now().Add(s.lim.HandshakeTimeout)) // it fails only on a closed connection, which the handler's first read reports
	go s.run(c)
}

// run serves c and then gives back what it held, a panic contained.
func (s *Server) run(c *Conn) {
	defer s.wg.Done()
	defer func() {
		if p := recover(); p != nil {
			_ = Recovered(s.log, s.who, c.Cred.PID, p) // logged; the connection closes next
		}
		_ = c.UnixConn.Close() // cleanup: the connection's service is over
		c.leave()
		s.mu.Lock()
		delete(s.live, c)
		s.mu.Unlock()
	}()
	s.serve(c)
}

// Close gives back c's slots and closes the connection. Only c's handler calls it;
// the handler's return does the same.
func (c *Conn) Close() error {
	c.leave()
	return c.UnixConn.Close()
}

// Recovered logs v, a panic recovered while serving pid's connection, with its stack
// (log, under who's name), as net/http does, and returns it as an error: the caller
// closes that connection alone and serves on.
func Recovered(log *slog.Logger, who string, pid int, v any) error {
	log.Error(who+": panic serving a connection; it is closed", "pid", pid, "panic", v, "stack", string(debug.Stack()))
	return fmt.Errorf("%s: panic serving the connection: %v", who, v)
}

// leave gives back c's slots.
func (c *Conn) leave() {
	if c.shaking {
		c.shaking = false
		c.s.shakes.Leave(c.Cred.UID)
	}
	if c.admitted {
		c.admitted = false
		c.s.conns.Leave(uint32(c.Cred.PID))
	}
}

// Admit ends c's handshake: its handshake slot is given back, its deadline cleared,
// and it takes a connection slot. If a connection cap is full it fails with an error
// wrapping ErrLimit that names the cap (the handler refuses the peer with it), and c
// holds no slot. Only c's handler calls it, once.
func (c *Conn) Admit() error {
	if c.shaking {
		c.shaking = false
		c.s.shakes.Leave(c.Cred.UID)
	}
	if ok, full := c.s.conns.Enter(uint32(c.Cred.PID)); !ok {
		if full == "total" {
			return fmt.Errorf("%w: %d connections, the most the server takes (its connection limit)", ErrLimit, c.s.lim.Conns)
		}
		return fmt.Errorf("%w: pid %d has %d connections, the most one process may have (its connection limit per process)", ErrLimit, c.Cred.PID, c.s.lim.ConnsPerProcess)
	}
	c.admitted = true
	_ = c.SetDeadline(time.Time{}) // it fails only on a closed connection, which the next read or write reports
	return nil
}

// Close closes the listener and every connection (each handler's reads and writes
// then fail) and waits for the accept loop and the handlers to return.
func (s *Server) Close() {
	s.mu.Lock()
	s.closed = true
	for c := range s.live {
		_ = c.UnixConn.Close() // cleanup: closing it is what ends its service
	}
	s.mu.Unlock()
	_ = s.ln.Close() // cleanup: nothing is left to do if closing fails
	s.wg.Wait()
}
