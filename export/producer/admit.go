package producer

import (
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"os"
	"time"

	"golang.org/x/sync/semaphore"

	"github.com/cudapool/cudapool/cudart"
	"github.com/cudapool/cudapool/export"
	"github.com/cudapool/cudapool/export/internal/wire"
	"github.com/cudapool/cudapool/internal/peercred"
	"github.com/cudapool/cudapool/pool"
)

// serveConn admits nc and serves it, as a peer or an observer, until it closes.
// detach takes a peer's goroutine out of what Close waits for.
func (ex *Exporter) serveConn(nc net.Conn, detach func()) {
	p, o, err := ex.admit(nc)
	if err != nil {
		level := slog.LevelWarn
		if errors.Is(err, io.EOF) {
			level = slog.LevelDebug // a liveness probe (Discover) hangs up without a word
		}
		ex.log.Log(context.Background(), level, "producer: connection not admitted", "err", err)
		_ = nc.Close() // cleanup: nothing is left to do if closing fails
		return
	}
	if o != nil {
		o.serve()
		return
	}
	p.detach = detach
	ex.log.Debug("producer: peer admitted", "pid", p.pid(), "remote", p.remote())
	reason, clean := p.serveContained()
	if reason != nil {
		ex.log.Warn("producer: closing peer connection", "pid", p.pid(), "reason", reason)
	}
	if p.lost() {
		_ = p.c.Close() // cleanup: nothing is left to do if closing fails
		clean = p.awaitExit(clean)
	}
	p.cleanup(clean)
}

// admit is the exporter's half of the handshake: it reads the Hello, applies the
// policy and answers Welcome or Refused (which carries the reason and nothing else).
// A Hello that takes leases makes a peer; one that does not, an observer.
func (ex *Exporter) admit(nc net.Conn) (*peer, *observer, error) {
	defer func() {
		ex.mu.Lock()
		if uid, ok := ex.greeting[nc]; ok {
			delete(ex.greeting, nc)
			ex.handshakes.Leave(uid)
		}
		ex.mu.Unlock()
	}()
	c := wire.NewConn(nc, false)
	_ = nc.SetDeadline(time.Now().Add(ex.opts.HandshakeTimeout)) // it fails only on a closed connection, which the next read or write reports
	var cred *peercred.Cred                                      // nil on a byte stream
	if c.Uc != nil {
		cr, err := peercred.Get(c.Uc)
		if err != nil {
			return nil, nil, err
		}
		cred = &cr
	}
	var h wire.HelloMsg
	pid := func() int {
		if cred != nil {
			return cred.PID
		}
		return int(h.PID) // what a remote peer says: not checked
	}
	refuse := func(reason string) (*peer, *observer, error) {
		_ = c.Send(context.Background(), &wire.RefusedMsg{Version: export.ProtocolVersion, Reason: wire.FitText(reason, wire.MaxPayload-4)}, -1) // the peer may be gone already; the connection closes next
		return nil, nil, fmt.Errorf("%w: pid %d: %s", export.ErrRefused, pid(), reason)
	}
	m, _, err := c.Recv()
	if errors.Is(err, export.ErrVersionMismatch) {
		return refuse(err.Error())
	}
	if err != nil {
		return nil, nil, fmt.Errorf("pid %d: before Hello: %w", pid(), err)
	}
	hm, ok := m.(*wire.HelloMsg)
	if !ok {
		return refuse(fmt.Sprintf("%v: the first message must be Hello, got %s", export.ErrProtocol, m.Kind()))
	}
	h = *hm
	if reason := admit(ex.opts.policy, cred); reason != "" {
		return refuse(reason)
	}
	if cred == nil && h.Flags&wire.HelloReleaseEvent != 0 {
		return refuse(fmt.Sprintf("%v: a peer on a byte stream cannot offer an IPC release event", export.ErrProtocol))
	}
	welcome := func(flags uint32) error {
		return c.Send(context.Background(), &wire.WelcomeMsg{Version: export.ProtocolVersion, PID: uint32(os.Getpid()), Flags: flags, Devices: ex.devices[:min(len(ex.devices), wire.MaxDevices)]}, -1)
	}

	if h.Flags&wire.HelloLeases == 0 {
		o := &observer{ex: ex, c: c, pid: pid()}
		ex.mu.Lock()
		if ex.closed {
			ex.mu.Unlock()
			return refuse("the exporter is closing")
		}
		ex.observers[o] = struct{}{}
		ex.mu.Unlock()
		if err := welcome(0); err != nil {
			o.leave()
			return nil, nil, err
		}
		_ = nc.SetDeadline(time.Time{}) // it fails only on a closed connection, which the next read or write reports
		return nil, o, nil
	}

	p := &peer{ex: ex, c: c, cred: cred, hello: h, since: time.Now(), sent: map[*pool.Pool]bool{}, poolLock: semaphore.NewWeighted(1),
		leases: map[uint64]*lease{}, byHeld: map[any]*lease{}, sentAllocs: map[*vmmAlloc]bool{}, releaseEvents: map[int]cudart.Event{},
		completions: map[*pool.Pool]*pool.Completion{},
		retained:    map[cudart.PtrExportData]*retention{}}
	// Retention needs the peer's release event to cover its work: a local peer's.
	p.retains = ex.opts.retain && cred != nil && h.Flags&wire.HelloReleaseEvent != 0
	p.exitWait, p.stopExitWait = context.WithCancel(context.Background())
	p.space, p.id = ex.connIDs.next()
	ex.mu.Lock()
	if ex.closed {
		ex.mu.Unlock()
		return refuse("the exporter is closing")
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
	if err := welcome(flags); err != nil {
		p.cleanup(false)
		return nil, nil, err
	}
	_ = nc.SetDeadline(time.Time{}) // it fails only on a closed connection, which the next read or write reports
	return p, nil, nil
}
