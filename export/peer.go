package export

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"os"
	"slices"
	"sync"
	"time"

	"github.com/cudapool/cudapool/cudart"
	"github.com/cudapool/cudapool/internal/peercred"
	"github.com/cudapool/cudapool/pool"
)

// peer is the exporter's side of one admitted connection.
type peer struct {
	ex    *Exporter
	c     *conn
	id    uint32
	cred  *peercred.Cred // nil for a peer on a byte stream
	hello hello
	since time.Time

	// proc is the peer's process, opened at admission, whose exit ends the leases of a
	// connection lost without Bye; nil for a peer that takes no leases or is on a byte
	// stream, or where it could not be opened (procErr says why).
	proc    *peercred.Process
	procErr error
	// exitWait bounds the wait for proc's exit; stopExitWait (Close) ends it.
	exitWait     context.Context
	stopExitWait context.CancelFunc

	// poolLock, a one-slot semaphore, is held while a pool's handle is sent, so that
	// it goes once and first; waiting for it ends with the waiter's context, as a
	// peer that stopped reading can hold it for as long as it likes.
	poolLock chan struct{}
	sent     map[*pool.Pool]bool

	mu       sync.Mutex
	issued   uint64 // lease counter: ids 1..issued were given out
	leases   map[uint64]*grant
	byBuffer map[*pool.Buffer]*grant
	// release holds the peer's release event opened on each device it leased from.
	release map[int]cudart.Event
	// bye: the peer said it is done and released all it wanted to; what it still
	// holds is ended as of its release event.
	bye bool
	// closing: the exporter is shutting this connection.
	closing bool
	// awaitingExit: the connection was lost without Bye while the process lives on,
	// still mapping what it holds; its leases end when it exits.
	awaitingExit bool
	// left: cleanup has run; a lease granted now would never be ended.
	left bool
}

// grant is one lease id given to a connection: one pool lease per Open or Push that
// the id answered (a connection asking again for a buffer it holds gets the same id).
type grant struct {
	id    uint64
	buf   *pool.Buffer
	held  []*pool.Lease
	bytes uint64
}

// remote reports whether the peer is on a byte stream: no descriptors, no IPC events.
func (p *peer) remote() bool { return p.cred == nil }

func (p *peer) takesLeases() bool { return p.hello.Flags&helloLeases != 0 }

// servePeer admits nc and serves it until it closes.
func (ex *Exporter) servePeer(nc net.Conn) {
	p, err := ex.handshake(nc)
	if err != nil {
		level := slog.LevelWarn
		if errors.Is(err, io.EOF) {
			level = slog.LevelDebug // a liveness probe (Discover) hangs up without a word
		}
		ex.log.Log(context.Background(), level, "export: connection not admitted", "err", err)
		nc.Close()
		return
	}
	ex.log.Debug("export: peer admitted", "pid", p.pid(), "remote", p.remote())
	reason, clean := p.serve()
	if reason != nil {
		ex.log.Warn("export: closing peer connection", "pid", p.pid(), "reason", reason)
	}
	p.c.close()
	if p.lost() {
		clean = p.awaitExit(clean)
	}
	p.cleanup(clean)
}

// lost reports whether the peer's connection ended without Bye, and not because the
// exporter is closing, while it still holds leases: nothing says its imports are gone.
func (p *peer) lost() bool {
	p.mu.Lock()
	defer p.mu.Unlock()
	return !p.bye && !p.closing && len(p.leases) > 0
}

// awaitExit keeps a lost peer's leases until its process has exited: until then the
// process may still map and read what it holds. It returns cleanup's clean: false once
// the process has exited (its imports went with it), true when Close stopped the wait
// (Close ends leases as of the peer's last release). For a process that cannot be
// watched it returns the connection's own verdict, clean, and logs why.
func (p *peer) awaitExit(clean bool) bool {
	if p.proc == nil {
		p.ex.log.Warn("export: cannot watch the process of a peer lost without Bye; ending its leases now",
			"pid", p.pid(), "err", p.procErr)
		return clean
	}
	p.mu.Lock()
	p.awaitingExit = true
	leases := len(p.leases)
	p.mu.Unlock()
	p.ex.log.Info("export: peer lost without Bye; its leases are held until its process exits",
		"pid", p.pid(), "leases", leases)
	err := p.proc.Wait(p.exitWait)
	switch {
	case err == nil:
		p.ex.log.Info("export: lost peer's process exited; ending its leases", "pid", p.pid(), "leases", leases)
		return false
	case p.exitWait.Err() != nil:
		return true
	}
	p.ex.log.Warn("export: cannot wait for the process of a peer lost without Bye; ending its leases now",
		"pid", p.pid(), "err", err)
	return clean
}

// handshake reads the peer's Hello, applies the policy and answers Welcome or
// Refused. The Refused frame carries the reason and nothing else.
func (ex *Exporter) handshake(nc net.Conn) (*peer, error) {
	defer func() {
		ex.mu.Lock()
		delete(ex.greeting, nc)
		ex.mu.Unlock()
	}()
	c := newConn(nc, false)
	nc.SetDeadline(time.Now().Add(ex.opts.handshake))
	p := &peer{ex: ex, c: c, since: time.Now(), sent: map[*pool.Pool]bool{}, poolLock: make(chan struct{}, 1),
		leases: map[uint64]*grant{}, byBuffer: map[*pool.Buffer]*grant{}, release: map[int]cudart.Event{}}
	p.exitWait, p.stopExitWait = context.WithCancel(context.Background())
	if c.uc != nil {
		cred, err := peercred.Get(c.uc)
		if err != nil {
			return nil, err
		}
		p.cred = &cred
	}
	refuse := func(reason string) (*peer, error) {
		c.send(context.Background(), &refused{Version: ProtocolVersion, Reason: reason}, -1)
		return nil, fmt.Errorf("%w: pid %d: %s", ErrRefused, p.pid(), reason)
	}
	m, _, err := c.recv()
	if errors.Is(err, ErrVersionMismatch) {
		return refuse(err.Error())
	}
	if err != nil {
		return nil, fmt.Errorf("pid %d: before Hello: %w", p.pid(), err)
	}
	h, ok := m.(*hello)
	if !ok {
		return refuse(fmt.Sprintf("%v: the first message must be Hello, got %s", ErrProtocol, m.kind()))
	}
	p.hello = *h
	if reason := ex.opts.policy.admit(p.cred); reason != "" {
		return refuse(reason)
	}
	if p.remote() && h.Flags&helloReleaseEvent != 0 {
		return refuse(fmt.Sprintf("%v: a peer on a byte stream cannot offer an IPC release event", ErrProtocol))
	}
	id := ex.lastConnID.Add(1)
	if id > maxConnID {
		return refuse("the exporter has run out of connection ids; restart it")
	}
	p.id = id
	ex.mu.Lock()
	if ex.closed {
		ex.mu.Unlock()
		return refuse("the exporter is closing")
	}
	ex.peers[p] = struct{}{}
	ex.mu.Unlock()
	switch {
	case !p.takesLeases():
	case p.remote():
		p.procErr = errors.New("a peer on a byte stream has no process on this host")
	default:
		// Opened while the peer is connected, so that it names the process that
		// connected even if that pid is reused later.
		p.proc, p.procErr = peercred.OpenProcess(p.cred.PID)
	}
	if err := c.send(context.Background(), &welcome{Version: ProtocolVersion, PID: uint32(os.Getpid()), Devices: ex.devices[:min(len(ex.devices), maxDevices)]}, -1); err != nil {
		p.cleanup(false)
		return nil, err
	}
	nc.SetDeadline(time.Time{})
	return p, nil
}

// goneErr is the error of a grant to a peer whose connection is gone.
func (p *peer) goneErr() error {
	return fmt.Errorf("%w: pid %d's connection is gone", ErrNoPeer, p.pid())
}

func (p *peer) pid() int {
	if p.cred != nil {
		return p.cred.PID
	}
	return int(p.hello.PID) // what a remote peer says: not checked
}

// serve answers the peer's requests in order until the connection ends. reason says
// why, nil for a peer that said Bye or an exporter that is closing; clean reports
// whether the peer's release event covers all it freed.
func (p *peer) serve() (reason error, clean bool) {
	for {
		m, _, err := p.c.recv()
		if err != nil {
			p.mu.Lock()
			bye, closing := p.bye, p.closing
			p.mu.Unlock()
			switch {
			case bye || closing:
				return nil, true
			case errors.Is(err, io.EOF):
				// Without Bye the peer exited, crashed or hung up; which, its process
				// tells (awaitExit).
				return errors.New("connection closed without Bye"), false
			case errors.Is(err, ErrProtocol):
				return err, true
			}
			return err, false
		}
		switch m := m.(type) {
		case *open:
			p.answer(m.ReqID, p.open(m))
		case *release:
			p.answer(m.ReqID, p.releaseLease(m))
		case *stateRequest:
			p.answer(m.ReqID, p.sendState(m.ReqID))
		case *bye:
			p.mu.Lock()
			p.bye = true
			p.mu.Unlock()
			return nil, true
		default:
			return protocolErr("unexpected %s from an importer", m.kind()), true
		}
	}
}

// answer sends an Error frame for a failed request; a request that succeeded has sent
// its own reply.
func (p *peer) answer(reqID uint64, err error) {
	if err == nil {
		return
	}
	p.c.send(context.Background(), &errorMsg{ReqID: reqID, Code: codeOf(err), Text: err.Error()}, -1)
}

func (p *peer) open(m *open) error {
	if !p.takesLeases() {
		return fmt.Errorf("%w: open %q", ErrNoLeases, m.Name)
	}
	pub, err := p.ex.lookup(m.Name)
	if err != nil {
		return err
	}
	l, pl, err := p.grant(context.Background(), pub, m.ReqID)
	if err != nil {
		return err
	}
	if err := p.c.send(context.Background(), &l, -1); err != nil {
		p.withdraw(l.LeaseID, pl)
		return err
	}
	return nil
}

// grant leases pub's buffer to the peer and returns the Lease message, its pool handle
// sent first if this peer has not had it. A buffer the peer already holds is granted
// under the same id once more, to be released as many times. The pool lease it took
// is returned for withdraw, should the message fail to go out.
func (p *peer) grant(ctx context.Context, pub *publication, reqID uint64) (lease, *pool.Lease, error) {
	if !p.takesLeases() {
		return lease{}, nil, ErrNoLeases
	}
	b := pub.buf
	// Each grant holds its own pool lease: taking it is also the check that b was not
	// freed, so a freed buffer's record is never handed out (FACTS 3).
	pl, err := b.Lease()
	if err != nil {
		if errors.Is(err, pool.ErrFreed) {
			p.ex.retire(pub)
			return lease{}, nil, fmt.Errorf("%w: %q: %w", ErrBufferGone, pub.name, err)
		}
		return lease{}, nil, fmt.Errorf("export: lease %q: %w", pub.name, err)
	}
	msg, err := p.prepare(ctx, pub)
	if err != nil {
		pl.End(0) // nothing was sent, so nothing was imported
		return lease{}, nil, err
	}
	msg.ReqID = reqID
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.left || p.awaitingExit {
		pl.End(0) // the Lease message was not sent, so nothing was imported
		return lease{}, nil, p.goneErr()
	}
	g := p.byBuffer[b]
	if g == nil {
		p.issued++
		g = &grant{id: p.ex.ids.seal(p.id, p.issued), buf: b}
		p.leases[g.id] = g
		p.byBuffer[b] = g
	}
	g.held = append(g.held, pl)
	g.bytes = b.Size()
	msg.LeaseID = g.id
	return msg, pl, nil
}

// push grants pub's buffer to the peer unasked and sends it as a Push.
func (p *peer) push(ctx context.Context, pub *publication) error {
	l, pl, err := p.grant(ctx, pub, 0)
	if err != nil {
		return err
	}
	if err := p.c.send(ctx, &push{lease: l, Name: pub.name}, -1); err != nil {
		p.withdraw(l.LeaseID, pl)
		return err
	}
	return nil
}

// withdraw takes back pl, granted under lease id but whose message did not go out
// whole: the peer never learnt of it, so it will never release it, and imported
// nothing under it. Once cleanup has run it ended pl already. A peer that held the
// buffer under id before may have released, meanwhile, as many grants as it knew of,
// and releaseLease ends the newest, pl among them: then one of those the peer knew of
// is left, and goes instead, so that the lease keeps exactly the grants the peer holds.
func (p *peer) withdraw(id uint64, pl *pool.Lease) {
	p.mu.Lock()
	g := p.leases[id]
	i := -1
	if g != nil {
		i = slices.Index(g.held, pl)
		if i < 0 && len(g.held) > 0 {
			i = len(g.held) - 1
			pl = g.held[i]
		}
	}
	if i >= 0 {
		g.held = slices.Delete(g.held, i, i+1)
		if len(g.held) == 0 {
			delete(p.leases, g.id)
			delete(p.byBuffer, g.buf)
		}
	}
	p.mu.Unlock()
	if i < 0 {
		return
	}
	if err := pl.End(0); err != nil {
		p.ex.log.Error("export: taking back a lease that was never sent", "pid", p.pid(), "err", err)
	}
	p.ex.poke()
}

// prepare makes everything a Lease message for pub refers to: the record, the pool
// handle on the peer's side, the release event on this side. LeaseID and ReqID are
// left to the caller.
func (p *peer) prepare(ctx context.Context, pub *publication) (lease, error) {
	b := pub.buf
	rec, err := b.ExportRecord()
	if err != nil {
		if errors.Is(err, pool.ErrFreed) {
			return lease{}, fmt.Errorf("%w: %q: %w", ErrBufferGone, pub.name, err)
		}
		return lease{}, fmt.Errorf("export: %q: %w", pub.name, fabricErr(b.Pool(), err))
	}
	poolID, err := p.sendPool(ctx, b.Pool())
	if err != nil {
		return lease{}, err
	}
	msg := lease{PoolID: poolID, BufferID: b.ID(), Size: b.Size(), Record: rec}
	if p.remote() {
		// IPC events do not cross hosts: the producer's writes are waited for here.
		if err := p.ex.rt.EventSynchronize(pub.ready.dev, pub.ready.ev); err != nil {
			return lease{}, fmt.Errorf("export: %q: wait for the producer's writes: %w", pub.name, err)
		}
	} else {
		msg.Flags |= leaseReadyEvent
		msg.Ready = pub.ready.handle
	}
	if p.hello.Flags&helloReleaseEvent != 0 {
		if _, err := p.releaseEvent(b.Device()); err != nil {
			return lease{}, err
		}
	}
	return msg, nil
}

// sendPool sends p's handle to the peer unless it already has it, and returns the
// pool's wire id.
func (p *peer) sendPool(ctx context.Context, pl *pool.Pool) (uint64, error) {
	id := p.ex.poolID(pl)
	select {
	case p.poolLock <- struct{}{}:
	case <-ctx.Done():
		return 0, fmt.Errorf("export: send pool %s: %w", pl.Name(), ctx.Err())
	}
	defer func() { <-p.poolLock }()
	if p.sent[pl] {
		return id, nil
	}
	ht := pl.HandleType()
	switch {
	case ht == cudart.HandleTypePosixFD && !p.c.canPassFDs():
		return 0, fmt.Errorf("%w: a POSIX fd pool cannot travel on a byte stream; use a FABRIC pool", ErrHandleType)
	case p.hello.HandleTypes&uint32(ht) == 0:
		return 0, fmt.Errorf("%w: the peer imports %#x, the pool is %v", ErrHandleType, p.hello.HandleTypes, ht)
	}
	h, err := pl.ExportHandle()
	if err != nil {
		return 0, fmt.Errorf("export: pool %s: %w", pl.Name(), fabricErr(pl, err))
	}
	ph := &poolHandle{PoolID: id, HandleType: ht, Device: p.ex.deviceUUID(pl.Device()), MaxSize: pl.MaxSize()}
	fd := -1
	if ht == cudart.HandleTypeFabric {
		ph.Fabric = h.Fabric
	} else {
		fd = h.FD // the pool owns it; sendmsg duplicates it into the peer
	}
	if err := p.c.send(ctx, ph, fd); err != nil {
		return 0, err
	}
	p.sent[pl] = true
	return id, nil
}

func (ex *Exporter) deviceUUID(dev int) cudart.UUID {
	if dev >= 0 && dev < len(ex.devices) {
		return ex.devices[dev]
	}
	return cudart.UUID{}
}

// releaseEvent returns the peer's release event opened on dev, opening it the first
// time (0.29 ms on the measured host, so not on the release path). Once the peer's
// connection is gone it opens nothing: cleanup would never destroy it.
func (p *peer) releaseEvent(dev int) (cudart.Event, error) {
	p.mu.Lock()
	defer p.mu.Unlock()
	if ev, ok := p.release[dev]; ok {
		return ev, nil
	}
	if p.left || p.awaitingExit {
		// No grant follows (see grant), and an event opened after cleanup took the
		// peer's would never be destroyed.
		return 0, p.goneErr()
	}
	ev, err := p.ex.rt.IpcOpenEventHandle(dev, p.hello.ReleaseEvent)
	if err != nil {
		return 0, fmt.Errorf("export: open pid %d's release event: %w", p.pid(), err)
	}
	p.release[dev] = ev
	return ev, nil
}

// lookupLease finds the grant of id on this connection, or says why there is none.
// Call with p.mu held.
func (p *peer) lookupLease(id uint64) (*grant, error) {
	if g := p.leases[id]; g != nil {
		return g, nil
	}
	conn, ctr := p.ex.ids.open(id)
	switch {
	case conn == p.id && ctr >= 1 && ctr <= p.issued:
		return nil, fmt.Errorf("%w: lease %#x was released already", ErrStaleLease, id)
	case conn != p.id && conn >= 1 && conn <= p.ex.lastConnID.Load() && ctr >= 1:
		return nil, fmt.Errorf("%w: lease %#x", ErrForeignLease, id)
	}
	return nil, fmt.Errorf("%w: lease %#x", ErrForgedLease, id)
}

func (p *peer) releaseLease(m *release) error {
	p.mu.Lock()
	g, err := p.lookupLease(m.LeaseID)
	if err == nil && (m.Count == 0 || int(m.Count) > len(g.held)) {
		err = fmt.Errorf("%w: release of %d grants of lease %#x, which has %d", ErrBadRequest, m.Count, m.LeaseID, len(g.held))
	}
	if err != nil {
		p.mu.Unlock()
		return err
	}
	n := len(g.held) - int(m.Count)
	ending := g.held[n:]
	g.held = g.held[:n:n]
	if n == 0 {
		delete(p.leases, g.id)
		delete(p.byBuffer, g.buf)
	}
	completion := p.release[g.buf.Device()]
	p.mu.Unlock()
	if m.Flags&releaseNothingImported != 0 || p.hello.Flags&helloReleaseEvent == 0 {
		// Nothing to wait for: nothing imported, or a peer that synchronised its free
		// before it said Release.
		completion = 0
	}
	if completion != 0 && completed(p.ex.rt, g.buf.Device(), completion) {
		completion = 0 // the free is known to be done: the pool's stream need not wait
	}
	if err := p.end(g, ending, completion); err != nil {
		return err
	}
	p.ex.poke()
	return p.c.send(context.Background(), &released{ReqID: m.ReqID, LeaseID: m.LeaseID}, -1)
}

// end ends pool leases of g after completion. A lease whose end failed before it
// ended (waiting for completion failed) goes back to g, so it can be ended later.
func (p *peer) end(g *grant, ls []*pool.Lease, completion cudart.Event) error {
	var errs []error
	for _, l := range ls {
		err := l.End(completion)
		if err == nil {
			continue
		}
		errs = append(errs, err)
		if !errors.Is(err, pool.ErrFreeFailed) && !errors.Is(err, pool.ErrLeaseEnded) {
			p.mu.Lock()
			g.held = append(g.held, l)
			p.leases[g.id], p.byBuffer[g.buf] = g, g
			p.mu.Unlock()
		}
	}
	return errors.Join(errs...)
}

// cleanup ends what the peer still holds once its connection is over, and forgets it.
// clean: the peer said Bye or the exporter is closing, so its release event covers what
// it freed; otherwise its process is gone and its imports with it, so nothing is
// waited for.
func (p *peer) cleanup(clean bool) {
	p.c.close()
	p.stopExitWait()
	if p.proc != nil {
		p.proc.Close()
	}
	p.mu.Lock()
	grants := make([]*grant, 0, len(p.leases))
	for _, g := range p.leases {
		grants = append(grants, g)
	}
	p.leases, p.byBuffer = map[uint64]*grant{}, map[*pool.Buffer]*grant{}
	p.left = true
	release := p.release
	p.release = map[int]cudart.Event{}
	p.mu.Unlock()
	for _, g := range grants {
		completion := cudart.Event(0)
		if clean {
			completion = release[g.buf.Device()]
		}
		for _, l := range g.held {
			if err := l.End(completion); err != nil {
				p.ex.log.Error("export: ending a lease of a departed peer", "pid", p.pid(), "err", err)
			}
		}
	}
	for dev, ev := range release {
		p.ex.rt.EventDestroy(dev, ev)
	}
	p.ex.mu.Lock()
	delete(p.ex.peers, p)
	p.ex.mu.Unlock()
	p.ex.poke()
}

// shut closes the connection from the exporter's side; serve then returns, and so does
// a wait for a lost peer's exit.
func (p *peer) shut() {
	p.mu.Lock()
	p.closing = true
	p.mu.Unlock()
	p.c.close()
	p.stopExitWait()
}

func (p *peer) info() PeerInfo {
	i := PeerInfo{PID: p.pid(), Remote: p.remote(), ConnectedSince: p.since}
	if p.cred != nil {
		i.UID, i.GID = p.cred.UID, p.cred.GID
	}
	if p.takesLeases() {
		i.Device = p.hello.Device
	}
	p.mu.Lock()
	defer p.mu.Unlock()
	i.AwaitingExit = p.awaitingExit
	for _, g := range p.leases {
		i.Leases++
		i.Grants += len(g.held)
		i.BytesLeased += g.bytes
	}
	return i
}

// sendState sends the exporter's State as JSON, in as many frames as it takes.
func (p *peer) sendState(reqID uint64) error {
	st, err := p.ex.State()
	if err != nil {
		return err
	}
	body, err := json.Marshal(st)
	if err != nil {
		return fmt.Errorf("export: state: %w", err)
	}
	const chunk = maxPayload - 12
	for {
		n := min(len(body), chunk)
		m := &stateChunk{ReqID: reqID, JSON: body[:n]}
		if n < len(body) {
			m.Flags = stateMore
		}
		if err := p.c.send(context.Background(), m, -1); err != nil {
			return err
		}
		if body = body[n:]; len(body) == 0 {
			return nil
		}
	}
}
