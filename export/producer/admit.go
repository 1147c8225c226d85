package producer

import (
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"os"
	"time"

	"golang.org/x/sync/semaphore"

	"github.com/cudapool/cudapool/cudart"
	"github.com/cudapool/cudapool/export"
	"github.com/cudapool/cudapool/export/internal/wire"
	"github.com/cudapool/cudapool/internal/peercred"
	"github.com/cudapool/cudapool/internal/session"
	"github.com/cudapool/cudapool/pool"
)

// writeTimeout bounds a write to a peer that does not read its answers: past it, the
// exporter stops writing to it and drops it (wire.Conn.Send aborts the connection). A
// variable for tests alone (SetWriteTimeout), set while no exporter serves.
var writeTimeout = 10 * time.Second

// bounded is the context of the writes of one answer to a peer: it ends writeTimeout
// from now.
func bounded() (context.Context, context.CancelFunc) {
	return context.WithTimeout(context.Background(), writeTimeout)
}

// serveConn admits sc and serves it, as a peer or an observer, until it closes: the
// session server's handler, which closes sc when it returns. A panic while serving a
// peer ends the peer as one that hung up (its leases kept until its process exits);
// the server logs it with its stack and serves the others on.
func (ex *Exporter) serveConn(sc *session.Conn) {
	p, o, err := ex.admit(sc)
	if err != nil {
		level := slog.LevelWarn
		if errors.Is(err, io.EOF) {
			level = slog.LevelDebug // a liveness probe (Discover) hangs up without a word
		}
		ex.log.Log(context.Background(), level, "producer: connection not admitted", "err", err)
		return
	}
	if o != nil {
		o.serve()
		return
	}
	ex.log.Debug("producer: peer admitted", "pid", p.pid(), "remote", p.remote())
	served := false
	var reason error
	clean := false
	defer func() {
		if !served { // a panic, which the server logs; the peer ends as one that hung up
			reason, clean = errors.New("a panic while serving it"), false
			_ = p.c.Close() // cleanup: the panic is what ends the connection
		}
		if reason != nil {
			ex.log.Warn("producer: closing peer connection", "pid", p.pid(), "reason", reason)
		}
		if p.lost() {
			_ = p.c.Close() // cleanup: nothing is left to do if closing fails
			clean = p.awaitExit(clean)
		}
		p.cleanup(clean)
	}()
	reason, clean = p.serve()
	served = true
}

// handshake is a connection in its handshake, as admit knows it.
type handshake struct {
	ex    *Exporter
	sc    *session.Conn
	c     *wire.Conn
	cred  *peercred.Cred // nil on a byte stream
	hello wire.HelloMsg
}

// pid is the peer's process: the kernel's word on a Unix socket, the Hello's on a byte
// stream (not checked).
func (hs *handshake) pid() int {
	if hs.cred != nil {
		return hs.cred.PID
	}
	return int(hs.hello.PID)
}

// refuse answers Refused with reason, which is all it carries, and returns the error
// that says so.
func (hs *handshake) refuse(reason string) error {
	_ = hs.c.Send(context.Background(), &wire.RefusedMsg{Version: export.ProtocolVersion, Reason: wire.FitText(reason, wire.MaxPayload-4)}, -1) // the peer may be gone already; the connection closes next
	return fmt.Errorf("%w: pid %d: %s", export.ErrRefused, hs.pid(), reason)
}

// welcome answers Welcome with flags.
func (hs *handshake) welcome(flags uint32) error {
	ctx, cancel := bounded()
	defer cancel()
	devices := hs.ex.devices[:min(len(hs.ex.devices), wire.MaxDevices)]
	return hs.c.Send(ctx, &wire.WelcomeMsg{Version: export.ProtocolVersion, PID: uint32(os.Getpid()), Flags: flags, Devices: devices}, -1)
}

// admit is the exporter's half of the handshake: it reads the Hello, applies the
// policy and the connection caps, and answers Welcome or Refused (which carries the
// reason and nothing else). A Hello that takes leases makes a peer; one that does
// not, an observer. The session server bounds it by the handshake timeout.
func (ex *Exporter) admit(sc *session.Conn) (*peer, *observer, error) {
	hs := &handshake{ex: ex, sc: sc, c: wire.NewConn(sc.Conn, false)}
	if !sc.Remote {
		hs.cred = &sc.Cred
	}
	if err := hs.readHello(); err != nil {
		return nil, nil, err
	}
	if hs.hello.Flags&wire.HelloLeases == 0 {
		o, err := ex.admitObserver(hs)
		return nil, o, err
	}
	p, err := ex.admitPeer(hs)
	return p, nil, err
}

// readHello reads the Hello and admits the connection, or refuses it: another
// version, another first message, a process the policy does not admit, a release
// event offered on a byte stream, a connection cap full.
func (hs *handshake) readHello() error {
	m, _, err := hs.c.Recv()
	if errors.Is(err, export.ErrVersionMismatch) {
		return hs.refuse(err.Error())
	}
	if err != nil {
		return fmt.Errorf("pid %d: before Hello: %w", hs.pid(), err)
	}
	hm, ok := m.(*wire.HelloMsg)
	if !ok {
		return hs.refuse(fmt.Sprintf("%v: the first message must be Hello, got %s", export.ErrProtocol, m.Kind()))
	}
	hs.hello = *hm
	pol := hs.ex.opts.policy
	if reason := hs.sc.Admits(pol.AllowUIDs, pol.AllowGIDs, pol.AllowRemote, "the exporter"); reason != "" {
		return hs.refuse(reason)
	}
	if hs.cred == nil && hs.hello.Flags&wire.HelloReleaseEvent != 0 {
		return hs.refuse(fmt.Sprintf("%v: a peer on a byte stream cannot offer an IPC release event", export.ErrProtocol))
	}
	if err := hs.sc.Admit(); err != nil {
		return hs.refuse(err.Error())
	}
	return nil
}

// admitObserver welcomes a connection that takes no leases.
func (ex *Exporter) admitObserver(hs *handshake) (*observer, error) {
	o := &observer{ex: ex, c: hs.c, pid: hs.pid()}
	ex.mu.Lock()
	if ex.closed {
		ex.mu.Unlock()
		return nil, hs.refuse("the exporter is closing")
	}
	ex.observers[o] = struct{}{}
	ex.mu.Unlock()
	if err := hs.welcome(0); err != nil {
		o.leave()
		return nil, err
	}
	return o, nil
}

// admitPeer welcomes a connection that takes leases.
func (ex *Exporter) admitPeer(hs *handshake) (*peer, error) {
	c, cred, h, sc := hs.c, hs.cred, hs.hello, hs.sc
	p := &peer{ex: ex, c: c, cred: cred, hello: h, since: time.Now(), sent: map[*pool.Pool]bool{}, poolLock: semaphore.NewWeighted(1),
		leases: map[uint64]*lease{}, byHeld: map[any]*lease{}, sentAllocs: map[*vmmAlloc]bool{}, releaseEvents: map[int]cudart.Event{},
		completions: map[*pool.Pool]*pool.Completion{},
		retained:    map[cudart.PtrExportData]*retention{},
		// Close waits for every connection but a peer it abandons, which it detaches:
		// that one is served on until it has released all or its process exited.
		detach: sc.Detach}
	// Retention needs the peer's release event to cover its work: a local peer's.
	p.retains = ex.opts.retain && cred != nil && h.Flags&wire.HelloReleaseEvent != 0
	p.exitWait, p.stopExitWait = context.WithCancel(context.Background())
	p.space, p.id = ex.connIDs.next()
	ex.mu.Lock()
	if ex.closed {
		ex.mu.Unlock()
		return nil, hs.refuse("the exporter is closing")
	}
	ex.peers[p] = struct{}{}
	ex.mu.Unlock()
	if p.remote() {
		p.procErr = errors.New("a peer on a byte stream has no process on this host")
	} else {
		// Opened while the peer is connected, so that it names the process that
		// connected even if that pid is reused later.
		p.proc, p.procErr = peercred.OpenProcess(p.cred.PID)
	}
	var flags uint32
	if p.retains {
		flags |= wire.WelcomeRetain
	}
	if err := hs.welcome(flags); err != nil {
		p.cleanup(false)
		return nil, err
	}
	return p, nil
}
