package keep

import (
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"os"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"golang.org/x/sys/unix"

	"github.com/cudapool/cudapool/internal/printable"
	"github.com/cudapool/cudapool/internal/session"
	"github.com/cudapool/cudapool/kv/internal/kvwire"
)

// writeTimeout bounds each of the keeper's answers: a client that does not read them
// is cut off.
const writeTimeout = 10 * time.Second

// Server is the keeper's side of the protocol: the descriptors kept, by name, and the
// handler that serves one connection (Serve, for session.Serve). It answers only its
// own user (and root), judged by the kernel's credentials. Its methods are safe for
// concurrent use.
type Server struct {
	log *slog.Logger
	// uidOf, set by tests alone, replaces the uid the kernel names for a peer (tests
	// run as root, which the keeper admits).
	uidOf atomic.Pointer[func(uint32) uint32]

	mu      sync.Mutex
	kept    map[string]Entry // by name; Entry.Size is Put's
	fds     map[string]int
	clients map[Role]int // admitted connections now, by role
	closed  bool
}

// NewServer returns a [Server] that keeps nothing yet; log nil logs nothing.
func NewServer(log *slog.Logger) *Server {
	if log == nil {
		log = slog.New(slog.DiscardHandler)
	}
	return &Server{log: log, kept: map[string]Entry{}, fds: map[string]int{}, clients: map[Role]int{}}
}

// Clients counts the connections admitted and not yet ended, of every role: the page
// servers and the holders (replicas that map what the descriptors name).
func (s *Server) Clients() int {
	s.mu.Lock()
	defer s.mu.Unlock()
	n := 0
	for _, c := range s.clients {
		n += c
	}
	return n
}

// Holders counts the connections of [RoleHolder] admitted and not yet ended.
func (s *Server) Holders() int {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.clients[RoleHolder]
}

// Kept lists what the server keeps, by name.
func (s *Server) Kept() []Entry {
	s.mu.Lock()
	defer s.mu.Unlock()
	es := make([]Entry, 0, len(s.kept))
	for _, e := range s.kept {
		es = append(es, e)
	}
	slices.SortFunc(es, func(a, b Entry) int { return strings.Compare(a.Name, b.Name) })
	return es
}

// Close closes every descriptor kept: the memory each names lives on while another
// process holds or maps it. A request served after it fails with CodeInternal. Close
// the session.Server first, so that none is served.
func (s *Server) Close() {
	s.mu.Lock()
	s.closed = true
	fds := s.fds
	s.fds, s.kept = map[string]int{}, map[string]Entry{}
	s.mu.Unlock()
	for _, fd := range fds {
		_ = unix.Close(fd) // cleanup: nothing is left to do if closing fails
	}
}

// Serve serves one connection until it ends: the Hello, then requests, each answered
// once, in order. A malformed frame closes the connection alone; the reason is logged.
func (s *Server) Serve(c *session.Conn) {
	if err := s.serve(c); err != nil {
		s.log.Warn("kv/keep: a connection to the keeper closed", "pid", c.Cred.PID, "uid", c.Cred.UID, "err", err)
	}
}

func (s *Server) serve(c *session.Conn) error {
	f := newFrames(c.UnixConn, kvwire.NewHandshakeReader())
	defer f.close()
	w := session.NewWriter(c.UnixConn, writeTimeout)
	ctx := context.Background()
	role, admitted, err := s.admit(ctx, c, f, w)
	if !admitted {
		return err
	}
	defer s.count(role, -1)
	for {
		h, p, fd, err := f.next(true)
		switch {
		case errors.Is(err, io.EOF) || errors.Is(err, net.ErrClosed):
			return nil
		case err != nil:
			return err
		}
		m, err := Decode(h, p)
		if err != nil {
			closeFD(fd)
			return err
		}
		if role == RoleHolder {
			err = s.refuseRequest(ctx, w, h, fd)
		} else {
			err = s.answer(ctx, w, h, m, fd)
		}
		if err != nil {
			return err
		}
	}
}

// admit reads the Hello and answers it: Welcome and the connection's role, or Refused
// (and false) for a first frame that is not Hello, another user, another version (read
// before the rest of the Hello, whose layout may be another version's), a role not
// known, or a full cap.
func (s *Server) admit(ctx context.Context, c *session.Conn, f *frames, w *session.Writer) (Role, bool, error) {
	h, p, fd, err := f.next(true)
	if err != nil {
		return 0, false, fmt.Errorf("no Hello: %w", err)
	}
	closeFD(fd) // a Hello carries none
	refuse := func(code uint16, why string) (Role, bool, error) {
		werr := w.Write(ctx, func(b []byte) ([]byte, error) { return Append(b, TypeRefused, h.ID, Problem{Code: code, Text: why}) })
		return 0, false, errors.Join(errors.New("refused: "+why), werr)
	}
	if h.Type != TypeHello {
		return refuse(CodeRefused, fmt.Sprintf("the first frame is %s, not Hello", h.Type))
	}
	if len(p) >= 4 {
		if v := binary.LittleEndian.Uint32(p); v != Version {
			return refuse(CodeRefused, fmt.Sprintf("keeper protocol version %d; this keeper speaks %d", v, Version))
		}
	}
	m, err := Decode(h, p)
	if err != nil {
		return refuse(CodeRefused, err.Error())
	}
	hello := m.(Hello)
	uid := c.Cred.UID
	if f := s.uidOf.Load(); f != nil {
		uid = (*f)(uid)
	}
	if own := uint32(os.Getuid()); uid != own && uid != 0 {
		return refuse(CodeRefused, fmt.Sprintf("uid %d is not the keeper's (%d): it answers only its own user", uid, own))
	}
	if hello.Role != RoleServer && hello.Role != RoleHolder {
		return refuse(CodeRefused, fmt.Sprintf("%s is no role of keeper protocol version %d", hello.Role, Version))
	}
	if err := c.Admit(); err != nil {
		return refuse(CodeLimit, err.Error())
	}
	s.count(hello.Role, 1)
	err = w.Write(ctx, func(b []byte) ([]byte, error) {
		return Append(b, TypeWelcome, h.ID, Welcome{Version: Version, PID: uint32(os.Getpid())})
	})
	if err != nil {
		s.count(hello.Role, -1)
		return 0, false, err
	}
	return hello.Role, true, nil
}

// count adds n to the connections of role.
func (s *Server) count(role Role, n int) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.clients[role] += n
}

// refuseRequest answers a holder's request, h (fd: Put's descriptor, which it
// closes), with an Error: a holder asks for nothing. A frame a client does not send
// ends the connection.
func (s *Server) refuseRequest(ctx context.Context, w *session.Writer, h Header, fd int) error {
	closeFD(fd)
	switch h.Type {
	case TypePut, TypeTake, TypeDrop, TypeList:
	default:
		return fmt.Errorf("%w: a client sent %s", ErrMalformed, h.Type)
	}
	return w.Write(ctx, func(b []byte) ([]byte, error) {
		return Append(b, TypeError, h.ID, Problem{Code: CodeRefused, Text: fmt.Sprintf("a %s makes no requests: %s refused", RoleHolder, h.Type)})
	})
}

// answer serves one request, m of header h (fd: Put's descriptor, which it takes).
// An error ends the connection: a frame a client does not send, or a write that
// failed.
func (s *Server) answer(ctx context.Context, w *session.Writer, h Header, m any, fd int) error {
	fail := func(err error) error {
		return w.Write(ctx, func(b []byte) ([]byte, error) {
			return Append(b, TypeError, h.ID, Problem{Code: codeOf(err), Text: err.Error()})
		})
	}
	done := func() error {
		return w.Write(ctx, func(b []byte) ([]byte, error) { return Append(b, TypeDone, h.ID, Empty{}) })
	}
	switch h.Type {
	case TypePut:
		if err := s.put(m.(Put), fd); err != nil {
			return fail(err)
		}
		return done()
	case TypeTake:
		dup, e, err := s.take(m.(Name).Name)
		if err != nil {
			return fail(err)
		}
		defer closeFD(dup)
		return w.WriteFD(ctx, dup, func(b []byte) ([]byte, error) { return Append(b, TypeTaken, h.ID, Taken{Size: e.Size}) })
	case TypeDrop:
		if err := s.drop(m.(Name).Name); err != nil {
			return fail(err)
		}
		return done()
	case TypeList:
		return s.list(ctx, w, h.ID, m.(Name).Name)
	}
	return fmt.Errorf("%w: a client sent %s", ErrMalformed, h.Type)
}

// checkName says why name breaks the rule, wrapping [ErrName], or nil.
func checkName(name string) error {
	if err := printable.Check(name, MaxName); err != nil {
		return fmt.Errorf("%w: %w", ErrName, err)
	}
	return nil
}

// put keeps fd under e.Name, closing the descriptor kept under it before; on failure
// it closes fd.
func (s *Server) put(m Put, fd int) error {
	if err := checkName(m.Name); err != nil {
		closeFD(fd)
		return err
	}
	s.mu.Lock()
	old, had := s.fds[m.Name]
	var err error
	switch {
	case s.closed:
		err = fmt.Errorf("%w: the keeper is stopping", ErrInternal)
	case !had && len(s.fds) >= MaxKept:
		err = fmt.Errorf("%w: the keeper keeps %d names, the most it keeps", ErrLimit, MaxKept)
	default:
		s.fds[m.Name], s.kept[m.Name] = fd, Entry(m)
	}
	s.mu.Unlock()
	if err != nil {
		closeFD(fd)
		return err
	}
	if had {
		closeFD(old) // replaced: its memory lives on while another process holds or maps it
	}
	return nil
}

// take returns a duplicate of the descriptor kept under name, which the caller
// closes, and its entry.
func (s *Server) take(name string) (int, Entry, error) {
	if err := checkName(name); err != nil {
		return -1, Entry{}, err
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	fd, ok := s.fds[name]
	if !ok {
		return -1, Entry{}, fmt.Errorf("%w: %q", ErrNotKept, name)
	}
	// A duplicate, so that a Drop on another connection cannot close the descriptor
	// (and its number be reused) while this one is sent. dup does not block.
	dup, err := unix.FcntlInt(uintptr(fd), unix.F_DUPFD_CLOEXEC, 0)
	if err != nil {
		return -1, Entry{}, fmt.Errorf("%w: duplicating the descriptor of %q: %w", ErrInternal, name, err)
	}
	return dup, s.kept[name], nil
}

// drop closes the descriptor kept under name.
func (s *Server) drop(name string) error {
	if err := checkName(name); err != nil {
		return err
	}
	s.mu.Lock()
	fd, ok := s.fds[name]
	delete(s.fds, name)
	delete(s.kept, name)
	s.mu.Unlock()
	if !ok {
		return fmt.Errorf("%w: %q", ErrNotKept, name)
	}
	closeFD(fd)
	return nil
}

// list answers a List: the entries whose names begin with prefix, in Listed frames
// as full as the frame bound allows, FlagMore on all but the last.
func (s *Server) list(ctx context.Context, w *session.Writer, id uint32, prefix string) error {
	var es []Entry
	for _, e := range s.Kept() {
		if strings.HasPrefix(e.Name, prefix) {
			es = append(es, e)
		}
	}
	for {
		n, room := 0, kvwire.MaxFrame-kvwire.HeaderLen-4
		for n < len(es) && entryLen(es[n]) <= room {
			room -= entryLen(es[n])
			n++
		}
		l := Listed{More: n < len(es), Entries: es[:n]}
		if err := w.Write(ctx, func(b []byte) ([]byte, error) { return Append(b, TypeListed, id, l) }); err != nil {
			return err
		}
		if es = es[n:]; len(es) == 0 {
			return nil
		}
	}
}

// closeFD closes fd if it is one.
func closeFD(fd int) {
	if fd >= 0 {
		_ = unix.Close(fd) // cleanup: nothing is left to do if closing fails
	}
}
