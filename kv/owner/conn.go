package owner

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"time"

	"golang.org/x/sys/unix"

	"github.com/cudapool/cudapool/internal/peercred"
	"github.com/cudapool/cudapool/internal/printable"
	"github.com/cudapool/cudapool/internal/session"
	"github.com/cudapool/cudapool/kv"
	"github.com/cudapool/cudapool/kv/internal/kvwire"
	"github.com/cudapool/cudapool/kv/internal/pages"
)

// writeTimeout bounds a write to a replica that does not read its answers: past it,
// the connection is closed. A variable for tests alone (SetWriteTimeout), set while no
// owner serves.
var writeTimeout = 10 * time.Second

// conn is one replica's connection.
type conn struct {
	o    *Owner
	sc   *session.Conn
	nc   *net.UnixConn
	w    *session.Writer
	cred peercred.Cred
	proc *peercred.Process // nil where the process cannot be watched
	s    *slab             // the slab of the replica's device
	ns   string
	id   procID // the replica's process, as the index names it; zero if unknown
	// holder is the replica's process as the page table names it: id, or the pid
	// alone where its start is unknown.
	holder pages.Holder

	// Guarded by Owner.mu.
	welcomed bool
	ended    bool          // finish has begun ending its leases: no new lease is made
	lost     bool          // the connection ended without Bye; the process may live on
	idle     chan struct{} // set while Bye waits for the releases to settle
	stopWait func()        // ends a lost connection's wait for its process's exit
	returned bool          // it ended its list of leases re-declared (Reattach of lease 0)

	held    map[uint64]*lease // the connection's leases
	heldPgs int               // the pages of held

	// Written by the connection's goroutine under Owner.mu, read by it without.
	notifiers map[uint32]*notifier
	rd        *kvwire.Reader // what serve reads from: the frames and the notifiers' descriptors
	// The connection's goroutine alone.
	locked  bool        // it holds Owner.mu (lock)
	req     kvwire.Type // the request it serves
	scratch []uint32
	leaseID []uint64
	// tip is where the latest Match's run ended short of the hashes asked: the first
	// hash it did not find, which a Seal of the rest names first, and the run's last
	// page, that Seal's parent. Guarded by Owner.mu.
	tip struct {
		next kv.Hash
		last pages.Ref
	}
	seen    map[kv.Hash]int
	seenIDs map[uint64]struct{}
}

// lock takes Owner.mu for the connection's goroutine, the only caller of lock and
// unlock: a panic while it holds it lets it go (serveConn) before the connection's
// cleanup takes it, instead of hanging the owner.
func (c *conn) lock() {
	c.o.mu.Lock()
	c.locked = true
	if lockedHook != nil {
		lockedHook(c.req)
	}
}

// unlock lets Owner.mu go, taken by lock.
func (c *conn) unlock() {
	c.locked = false
	c.o.mu.Unlock()
}

// lockedHook, set by tests alone, is called with the request served each time a
// connection's goroutine has taken Owner.mu.
var lockedHook func(kvwire.Type)

// exited says whether the replica's process has exited; false where it cannot be
// watched.
func (c *conn) exited() bool {
	if c.proc == nil {
		return false
	}
	ok, err := c.proc.Exited()
	return err == nil && ok
}

// write sends the frame fill makes, within writeTimeout.
func (c *conn) write(fill func([]byte) ([]byte, error)) error {
	return c.w.Write(context.Background(), fill)
}

// sendSealed answers a Seal that waited; a replica that cannot be answered is cut off.
func (c *conn) sendSealed(id uint32, m kvwire.Sealed) {
	if err := c.write(func(b []byte) ([]byte, error) { return kvwire.AppendSealed(b, id, m) }); err != nil {
		_ = c.nc.Close() // cleanup: the write's failure is what ends the connection
	}
}

func (c *conn) sendError(id uint32, err error) error {
	return c.write(func(b []byte) ([]byte, error) {
		return kvwire.AppendError(b, kvwire.TypeError, id, kvwire.Code(err), err.Error())
	})
}

// serveConn admits sc and serves it until it ends, then ends what it held: the
// session server's handler. A panic while serving ends what the connection held as
// if it had hung up, and the server logs it.
func (o *Owner) serveConn(sc *session.Conn) {
	c := &conn{o: o, sc: sc, nc: sc.UnixConn, w: session.NewWriter(sc.UnixConn, writeTimeout), cred: sc.Cred,
		notifiers: map[uint32]*notifier{}, held: map[uint64]*lease{}}
	c.tip.last = pages.NoRef
	c.lock()
	if o.closed {
		c.unlock()
		return
	}
	o.conns[c] = struct{}{}
	c.unlock()
	rd := kvwire.NewHandshakeReader()
	var bye *kvwire.Bye
	defer func() { c.finish(bye) }()
	defer func() { // first, while a panic unwinds: the cleanup above takes the lock
		if c.locked {
			c.unlock()
		}
	}()
	err := c.admit(rd)
	if errors.Is(err, errObserved) {
		err = nil
	} else if err == nil {
		bye, err = c.serve(rd)
	}
	if err != nil && o.stopped.Err() == nil {
		o.log.Warn("kv: closing a replica's connection", "pid", c.cred.PID, "reason", err)
	}
}

// admit reads the Hello, applies the policy and answers Welcome or Refused.
func (c *conn) admit(rd *kvwire.Reader) (err error) {
	o := c.o
	var h kvwire.Header
	refuse := func(code uint16, reason string) error {
		_ = c.write(func(b []byte) ([]byte, error) { return kvwire.AppendError(b, kvwire.TypeRefused, h.ID, code, reason) }) // the replica may be gone already; the refusal is the error returned
		return fmt.Errorf("refused pid %d: %s", c.cred.PID, reason)
	}
	h, p, err := rd.Next(c.nc)
	if err != nil {
		return fmt.Errorf("before Hello: %w", err)
	}
	if h.Type != kvwire.TypeHello {
		return refuse(kvwire.CodeRefused, fmt.Sprintf("the first frame must be Hello, got %s", h.Type))
	}
	hello, err := kvwire.DecodeHello(p)
	if err == nil {
		err = kvwire.CheckFlags(h)
	}
	if err != nil {
		return refuse(kvwire.CodeRefused, err.Error())
	}
	if hello.Namespace != "" {
		if err := printable.Check(hello.Namespace, kvwire.MaxNamespace); err != nil {
			return refuse(kvwire.CodeRefused, fmt.Sprintf("the namespace: %v", err))
		}
	}
	if reason := session.Admits(o.opts.Policy.AllowUIDs, o.opts.Policy.AllowGIDs, c.cred, "the owner"); reason != "" {
		return refuse(kvwire.CodeRefused, reason)
	}
	if hello.Version != kvwire.Version {
		return refuse(kvwire.CodeRefused, versionMismatch(hello.Version))
	}
	if err := c.sc.Admit(); err != nil {
		return refuse(kvwire.CodeLimit, err.Error())
	}
	rd.Grow()
	if hello.Device == kvwire.Observer {
		if err := c.write(func(b []byte) ([]byte, error) {
			return kvwire.AppendWelcome(b, h.ID, kvwire.Welcome{Geometry: o.geo})
		}); err != nil {
			return err
		}
		return c.observe(rd)
	}
	s := o.byDev[int(hello.Device)]
	if s == nil {
		return refuse(kvwire.CodeGeometry, fmt.Sprintf("%v: device %d is not served here (devices %v)", kv.ErrGeometry, hello.Device, o.opts.Devices))
	}
	c.s, c.ns = s, hello.Namespace
	// Opened while the replica is connected, so that it names the process that
	// connected even if its pid is reused later.
	if c.proc, err = peercred.OpenProcess(c.cred.PID); err != nil {
		c.proc = nil
		o.log.Warn("kv: cannot watch a replica's process; its leases end with its connection", "pid", c.cred.PID, "err", err)
	}
	if err := c.welcome(s, h.ID); err != nil {
		return err
	}
	id, err := procOf(c.cred.PID) // read before o.mu: /proc is no lock's
	c.holder = pages.Holder{PID: uint32(c.cred.PID)}
	if err == nil {
		c.holder = pages.Holder(id)
	}
	c.lock()
	c.welcomed = true
	seq := o.attachedLocked(c, id, err)
	c.unlock()
	// Served once the index has the replica: a restart waits for its leases then. An
	// index left behind broken (journaled's error) refuses writes, not the replica.
	if err := o.journaled(o.stopped, seq); errors.Is(err, kv.ErrClosed) {
		return err
	}
	return nil
}

// versionMismatch says why a Hello of version v is refused, naming both versions.
func versionMismatch(v uint32) string {
	if v == 3 {
		return fmt.Sprintf("protocol version 3 (the slab as pool segments on slab.sock); this owner speaks %d (the slab's chunks on kv.sock, the VMM route): upgrade the replica", kvwire.Version)
	}
	return fmt.Sprintf("protocol version %d; this owner speaks %d", v, kvwire.Version)
}

// frameHook, set by tests alone, sees each request's type before it is served.
var frameHook func(kvwire.Type)

// errObserved ends an observer's connection: it is served, and no replica.
var errObserved = errors.New("observed")

// observe serves an observer (cmd/poolstat, metrics): Stats until Bye or the end of
// the connection. Anything else closes it.
func (c *conn) observe(rd *kvwire.Reader) error {
	for {
		h, p, err := rd.Next(c.nc)
		switch {
		case err != nil && (errors.Is(err, net.ErrClosed) || isEOF(err)):
			return errObserved
		case err != nil:
			return err
		case h.Type == kvwire.TypeStats:
			if err := c.stats(h, p); err != nil {
				return err
			}
		case h.Type == kvwire.TypeBye:
			return errObserved
		default:
			return fmt.Errorf("%w: an observer sent %s", kvwire.ErrMalformed, h.Type)
		}
	}
}

// serve answers requests until the connection ends; bye says it ended with Bye.
func (c *conn) serve(rd *kvwire.Reader) (bye *kvwire.Bye, err error) {
	c.rd = rd
	for {
		h, p, err := rd.Next(c.nc) // a descriptor with any frame but a Notifier is closed
		if err != nil {
			if errors.Is(err, net.ErrClosed) || isEOF(err) {
				return nil, nil
			}
			return nil, err
		}
		c.req = h.Type
		if frameHook != nil {
			frameHook(h.Type)
		}
		if err := kvwire.CheckFlags(h); err != nil {
			return nil, err
		}
		switch h.Type {
		case kvwire.TypeAlloc:
			err = c.alloc(h, p)
		case kvwire.TypeSeal:
			err = c.seal(h, p)
		case kvwire.TypeMatch:
			err = c.match(h, p)
		case kvwire.TypeRelease:
			err = c.release(h, p)
		case kvwire.TypeStats:
			err = c.stats(h, p)
		case kvwire.TypeReattach:
			err = c.reattach(h, p)
		case kvwire.TypeNotifier:
			err = c.registerNotifier(p, rd.TakeFD())
		case kvwire.TypeBye:
			m, err := kvwire.DecodeBye(p)
			if err != nil {
				return nil, err
			}
			return &m, nil
		default:
			return nil, fmt.Errorf("%w: unexpected %s frame", kvwire.ErrMalformed, h.Type)
		}
		if err != nil {
			return nil, err
		}
	}
}

func isEOF(err error) bool { return errors.Is(err, io.EOF) || errors.Is(err, os.ErrClosed) }

// refuse answers a request that fails for err: an error the frame layout cannot show
// (kv.ErrTooLarge) or a request the owner cannot grant. A malformed frame instead
// closes the connection.
func (c *conn) refuse(id uint32, err error) error {
	if errors.Is(err, kvwire.ErrMalformed) {
		return err
	}
	return c.sendError(id, err)
}

// alloc answers Alloc: n pages for writing, all or none. Sealed pages it evicts that
// the device's host tier has no copy of yet are copied there before the answer.
func (c *conn) alloc(h kvwire.Header, p []byte) error {
	o, s := c.o, c.s
	m, err := kvwire.DecodeAlloc(p)
	if err != nil {
		return err
	}
	n := int(m.Pages)
	switch {
	case n > kv.MaxBatch:
		return c.refuse(h.ID, fmt.Errorf("%w: %d pages, at most %d", kv.ErrTooLarge, n, kv.MaxBatch))
	case n < 1 || n > o.geo.Pages:
		return c.refuse(h.ID, fmt.Errorf("%w: %d pages asked, the slab has %d at most", kv.ErrGeometry, n, o.geo.Pages))
	}
	if !o.awaitResumed() {
		return c.refuse(h.ID, fmt.Errorf("%w: the owner is closing", kv.ErrClosed))
	}
	o.growFor(s, n)
	c.lock()
	if err := c.roomLocked(n); err != nil {
		c.unlock()
		return c.sendError(h.ID, err)
	}
	l, fx, err := c.takeLocked(n)
	if errors.Is(err, pages.ErrSettling) && !c.ended && !o.closed {
		// Pages that settle will do: wait for them off the connection's goroutine,
		// which serves the replica's other requests meanwhile.
		o.allocWaits.Add(1)
		o.waiters.Add(1)
		go func() {
			defer o.waiters.Done()
			c.allocLater(h.ID, n)
		}()
		c.unlock()
		return nil
	}
	if err != nil {
		err = c.noSpace(n, err)
		c.unlock()
		return c.refuse(h.ID, err)
	}
	seq := o.effectsLocked(s, fx)
	c.unlock()
	return c.answerAlloc(h.ID, l, fx, seq)
}

// takeLocked grants c a write lease of n pages of its slab, under o.mu: the table's
// Alloc, and the lease booked for c.
func (c *conn) takeLocked(n int) (*lease, pages.Effects, error) {
	id, pgs, fx, err := c.s.tab.Alloc(c.holder, n)
	if err != nil {
		return nil, fx, err
	}
	return c.o.grantLocked(c, c.s, id, true, pgs), fx, nil
}

// answerAlloc answers Alloc id with write lease l once what the table asked (the
// evicted pages copied out, the evictions journaled) is done; if that fails, l is
// abandoned and the error sent.
func (c *conn) answerAlloc(id uint32, l *lease, fx pages.Effects, seq uint64) error {
	if _, err := c.o.doEffects(c.s, fx, seq); err != nil {
		c.abandon(l)
		return c.sendError(id, err)
	}
	if l == nil { // the connection ended meanwhile
		return nil
	}
	return c.sendLeased(id, l)
}

// abandon ends write lease l (nil: none), unanswered, and frees its pages: an Alloc
// that cannot be answered with them.
func (c *conn) abandon(l *lease) {
	if l == nil {
		return
	}
	o := c.o
	o.mu.Lock()
	defer o.mu.Unlock()
	o.endNowLocked(l)
}

// endNowLocked ends lease l at once, under o.mu: its write pages are freed, its read
// pages let go (Table.Release and ReleaseDone).
func (o *Owner) endNowLocked(l *lease) {
	o.dropLocked(l)
	if err := l.s.tab.Release(l.holder, pages.LeaseID(l.id)); err != nil {
		return // the table ended it already (its holder declared dead)
	}
	fx, err := l.s.tab.ReleaseDone(pages.LeaseID(l.id))
	if err == nil {
		o.effectsLocked(l.s, fx)
	}
}

// AllocWait bounds how long an Alloc waits for pages that settle (released pages whose
// releases' points have not been reached) before it answers kv.ErrNoSpace.
const AllocWait = 10 * time.Second

// allocLater answers Alloc id of n pages once enough pages have settled, or with
// kv.ErrNoSpace once no settling page is left that could make up the difference, after
// AllocWait, or when the owner closes; a connection that ends meanwhile gets nothing.
func (c *conn) allocLater(id uint32, n int) {
	o, s := c.o, c.s
	timer := time.NewTimer(AllocWait)
	defer timer.Stop()
	fail := func(err error) {
		if err := c.sendError(id, err); err != nil {
			_ = c.nc.Close() // cleanup: the write's failure is what ends the connection
		}
	}
	for {
		o.mu.Lock()
		if c.ended || o.closed {
			o.mu.Unlock()
			return
		}
		if err := c.roomLocked(n); err != nil {
			o.mu.Unlock()
			fail(err)
			return
		}
		l, fx, err := c.takeLocked(n)
		if err == nil {
			seq := o.effectsLocked(s, fx)
			o.mu.Unlock()
			if err := c.answerAlloc(id, l, fx, seq); err != nil {
				_ = c.nc.Close() // cleanup: the write's failure is what ends the connection
			}
			return
		}
		if !errors.Is(err, pages.ErrSettling) {
			err = c.noSpace(n, err)
			o.mu.Unlock()
			fail(err)
			return
		}
		space := s.space
		o.mu.Unlock()
		select {
		case <-space:
		case <-timer.C:
			o.mu.Lock()
			err = c.noSpace(n, err)
			o.mu.Unlock()
			fail(fmt.Errorf("%w, after waiting %v for pages to settle", err, AllocWait))
			return
		case <-o.stopped.Done():
			return
		}
	}
}

// noSpace is the refusal of an Alloc of n pages that the table refused with err,
// under o.mu.
func (c *conn) noSpace(n int, err error) error {
	if !errors.Is(err, pages.ErrNoSpace) && !errors.Is(err, pages.ErrSettling) {
		return fmt.Errorf("%w: %w (device %d)", kv.ErrNoSpace, err, c.s.dev)
	}
	kept := ""
	if k := c.o.keptLocked(c.s); k > 0 {
		kept = fmt.Sprintf(", %d kept for the writers of before the restart", k)
	}
	t := c.s.tab
	return fmt.Errorf("%w: %d pages asked, %d free or evictable, %d once pages settle%s (device %d)", kv.ErrNoSpace, n, t.Evictable(), t.Reachable(), kept, c.s.dev)
}

// sendLeased answers Alloc id with write lease l.
func (c *conn) sendLeased(id uint32, l *lease) error {
	return c.write(func(b []byte) ([]byte, error) { return kvwire.AppendLease(b, kvwire.TypeLeased, id, l.id, l.pages) })
}

// grantLocked books lease id of s's table, of pgs, for c, under o.mu, and returns it;
// nil for no lease (id 0), or where c has ended meanwhile (the lease then ends at
// once).
func (o *Owner) grantLocked(c *conn, s *slab, id pages.LeaseID, write bool, pgs []uint32) *lease {
	if id == 0 {
		return nil
	}
	l := &lease{id: uint64(id), c: c, s: s, holder: c.holder, write: write, pages: pgs}
	o.issued = max(o.issued, l.id)
	o.leases[l.id] = l
	c.held[l.id] = l
	c.heldPgs += len(pgs)
	if c.ended {
		o.endNowLocked(l)
		return nil
	}
	return l
}

// roomLocked says why c may not take a lease of n more pages, under o.mu, or nil.
func (c *conn) roomLocked(n int) error {
	if max := c.o.opts.MaxLeases; len(c.held) >= max {
		return fmt.Errorf("%w: the connection holds %d leases, the most one may (WithMaxLeases)", kv.ErrLimit, max)
	}
	if max := c.o.opts.MaxLeasedPages; c.heldPgs+n > max {
		return fmt.Errorf("%w: the connection holds leases of %d pages; %d more is over the most one may (WithMaxLeasedPages, %d)", kv.ErrLimit, c.heldPgs, n, max)
	}
	return nil
}

// dropLocked removes lease l from the owner's books, under o.mu; the table's lease is
// the caller's.
func (o *Owner) dropLocked(l *lease) {
	if o.leases[l.id] != l {
		return
	}
	delete(o.leases, l.id)
	delete(l.c.held, l.id)
	l.c.heldPgs -= len(l.pages)
}

// findLocked returns c's lease id, or why there is none, under o.mu.
func (o *Owner) findLocked(c *conn, id uint64) (*lease, error) {
	l, ok := o.leases[id]
	switch {
	case ok && l.c == c:
		return l, nil
	case ok && o.adoptLocked(c, l):
		return l, nil
	case ok:
		return nil, fmt.Errorf("%w: lease %d belongs to another replica", kv.ErrStaleLease, id)
	case id == 0 || id > o.issued || id == o.epoch<<40:
		return nil, fmt.Errorf("%w: lease %d was never issued", kv.ErrStaleLease, id)
	}
	return nil, fmt.Errorf("%w: lease %d has ended", kv.ErrStaleLease, id)
}

// adoptLocked moves lease l to c, under o.mu, if l's connection was lost (cut off,
// or hung up without Bye) while its process, which is c's, lives on: a replica the
// owner cut off redials and releases (or seals) the leases it held, instead of their
// pinning pages until its exit. A lost connection left holding nothing ends then.
func (o *Owner) adoptLocked(c *conn, l *lease) bool {
	old := l.c
	if !old.lost || old.cred.PID != c.cred.PID || old.s != c.s || c.proc == nil || l.holder != c.holder || old.exited() {
		return false
	}
	delete(old.held, l.id)
	old.heldPgs -= len(l.pages)
	l.c = c
	c.held[l.id] = l
	c.heldPgs += len(l.pages)
	if len(old.held) == 0 && !old.pendingLocked() && old.stopWait != nil {
		old.stopWait()
	}
	return true
}

// notifier returns the notifier at names, nil for none (the work had completed).
func (c *conn) notifier(at kvwire.Point) (*notifier, error) {
	if at.Notifier == 0 {
		return nil, nil
	}
	if n, ok := c.notifiers[at.Notifier]; ok {
		return n, nil
	}
	if max := c.o.opts.MaxNotifiers; len(c.notifiers) >= max {
		return nil, fmt.Errorf("%w: notifier %d is not registered: the connection has registered %d notifiers, the most the owner reads for one (WithMaxNotifiers): make one per stream", kv.ErrLimit, at.Notifier, max)
	}
	return nil, fmt.Errorf("%w: notifier %d was never registered on this connection", kv.ErrGeometry, at.Notifier)
}

// registerNotifier registers the notifier of a Notifier frame (payload p) with fd,
// the eventfd that came with it (-1 none), and starts its watcher. A Notifier without an eventfd, of id 0 or of an id registered already ends
// the connection (the error wraps kvwire.ErrMalformed); one past the connection's cap
// is dropped, and the Seal or Release that names it refused.
func (c *conn) registerNotifier(p []byte, fd int) error {
	o := c.o
	m, err := kvwire.DecodeNotifier(p)
	ok := fd >= 0
	switch {
	case err != nil:
	case !ok:
		err = fmt.Errorf("%w: Notifier %d came without its eventfd", kvwire.ErrMalformed, m.ID)
	case c.notifiers[m.ID] != nil:
		err = fmt.Errorf("%w: notifier %d is registered already", kvwire.ErrMalformed, m.ID)
	case len(c.notifiers) >= o.opts.MaxNotifiers:
		_ = unix.Close(fd) // cleanup: a notifier past the cap is dropped, and its use refused
		o.log.Debug("kv: a replica's notifier past the cap is dropped", "pid", c.cred.PID, "notifier", m.ID, "max", o.opts.MaxNotifiers)
		return nil
	}
	if err != nil {
		if ok {
			_ = unix.Close(fd) // cleanup: the frame's error is the one returned
		}
		return err
	}
	n, err := newNotifier(c, m.ID, fd)
	if err != nil {
		return fmt.Errorf("%w: %w", kvwire.ErrMalformed, err)
	}
	c.lock()
	if o.closed {
		c.unlock()
		_ = n.f.Close() // cleanup: the owner is closing
		return kv.ErrClosed
	}
	c.notifiers[m.ID] = n
	o.waiters.Add(1)
	c.unlock()
	go o.watch(n)
	return nil
}

// seal answers Seal: the write lease ends; its first n pages are published under the
// hashes once the writer's point is reached, the rest are freed then.
func (c *conn) seal(h kvwire.Header, p []byte) error {
	o := c.o
	m, err := kvwire.DecodeSeal(h, p)
	if err != nil {
		return c.refuse(h.ID, err)
	}
	id, hashes := m.Lease, m.Hashes
	check := func() (*lease, error) {
		l, err := o.findLocked(c, id)
		if err == nil && !l.write {
			err = fmt.Errorf("%w: lease %d is a read lease; only a write lease is sealed", kv.ErrStaleLease, id)
		}
		if err == nil && len(hashes) > len(l.pages) {
			err = fmt.Errorf("%w: %d hashes for a lease of %d pages", kv.ErrGeometry, len(hashes), len(l.pages))
		}
		return l, err
	}
	n, err := c.notifier(m.Point)
	if err != nil {
		return c.sendError(h.ID, err)
	}
	c.lock()
	l, err := check()
	if err == nil {
		var fx pages.Effects
		if fx, err = l.s.tab.Seal(l.holder, pages.LeaseID(l.id), hashes, c.parentLocked(hashes)); err != nil {
			err = fmt.Errorf("%w: %w", kv.ErrStaleLease, err)
		}
		o.effectsLocked(l.s, fx)
	}
	if err != nil {
		c.unlock()
		return c.sendError(h.ID, err)
	}
	o.dropLocked(l)
	rec := &record{s: l.s, target: m.Target, seal: pages.LeaseID(l.id)}
	o.submitLocked(n, rec)
	ans := kvwire.Sealed{Pending: uint32(len(hashes))}
	if rec.done {
		ans = kvwire.Sealed{Visible: uint32(rec.visible), Duplicates: uint32(rec.duplicate)}
	}
	wait := !rec.done && h.Flags&kvwire.FlagWait != 0
	if wait {
		rec.waiting, rec.wait = true, h.ID
	}
	var seq uint64 // a seal waited for is in the index once answered (settleReachedLocked's too)
	if rec.done && h.Flags&kvwire.FlagWait != 0 {
		seq = o.ix.Queued()
	}
	c.unlock()
	if wait {
		return nil
	}
	_ = o.journaled(o.stopped, seq) // visible already: an index that failed, or a close, was said elsewhere
	return c.write(func(b []byte) ([]byte, error) { return kvwire.AppendSealed(b, h.ID, ans) })
}

// release answers Release: every lease named ends (or, if one is not c's, none does),
// its pages settling until the point is reached.
func (c *conn) release(h kvwire.Header, p []byte) error {
	o := c.o
	m, err := kvwire.DecodeRelease(p, c.leaseID[:0])
	c.leaseID = m.Leases
	if err != nil {
		return c.refuse(h.ID, err)
	}
	if len(c.leaseID) == 0 {
		return c.sendError(h.ID, fmt.Errorf("%w: a release of no lease", kv.ErrGeometry))
	}
	if err := c.distinctIDs(c.leaseID); err != nil { // outside the lock: O(n), with a map
		return c.sendError(h.ID, err)
	}
	n, err := c.notifier(m.Point)
	if err != nil {
		return c.sendError(h.ID, err)
	}
	c.lock()
	if err := o.ownsLocked(c, c.leaseID); err != nil {
		c.unlock()
		return c.sendError(h.ID, err)
	}
	rec := &record{s: c.s, target: m.Target}
	for _, id := range c.leaseID {
		o.endBehindLocked(rec, o.leases[id])
	}
	o.submitLocked(n, rec)
	c.unlock()
	count := uint32(len(c.leaseID))
	return c.write(func(b []byte) ([]byte, error) { return kvwire.AppendU32(b, kvwire.TypeReleased, h.ID, count) })
}

// endBehindLocked ends lease l into rec, under o.mu: its pages settle once rec's point
// is reached (Table.Release; write-leased pages are then freed, read-leased ones
// evictable).
func (o *Owner) endBehindLocked(rec *record, l *lease) {
	o.dropLocked(l)
	if l.s.tab.Release(l.holder, pages.LeaseID(l.id)) == nil {
		rec.released = append(rec.released, pages.LeaseID(l.id))
	}
}

// releaseHeld ends c's leases after its final point at (a Bye's), as a Release of all
// of them would; if at names no notifier of c's, they are left for finish to end at
// once, logged.
func (c *conn) releaseHeld(at kvwire.Point) {
	o := c.o
	n, err := c.notifier(at)
	if err != nil {
		o.log.Warn("kv: a replica's final point; its leases end at once", "pid", c.cred.PID, "err", err)
		return
	}
	c.lock()
	if len(c.held) == 0 {
		c.unlock()
		return
	}
	rec := &record{s: c.s, target: at.Target}
	for _, l := range c.held {
		o.endBehindLocked(rec, l)
	}
	o.submitLocked(n, rec)
	c.unlock()
}

// submitLocked settles rec at once, under o.mu, if its point is reached (n is nil: it
// named none, or n's total has reached it), and else queues it behind n, whose
// watcher settles it.
func (o *Owner) submitLocked(n *notifier, rec *record) {
	if n == nil || rec.target <= n.total {
		o.settle(rec, true)
		return
	}
	n.pending = append(n.pending, rec)
}

// distinctIDs says which lease of ids is listed twice, if one is.
func (c *conn) distinctIDs(ids []uint64) error {
	if len(ids) < 2 {
		return nil
	}
	if c.seenIDs == nil {
		c.seenIDs = make(map[uint64]struct{}, len(ids))
	}
	defer clear(c.seenIDs)
	for _, id := range ids {
		if _, ok := c.seenIDs[id]; ok {
			return fmt.Errorf("%w: lease %d is listed twice", kv.ErrStaleLease, id)
		}
		c.seenIDs[id] = struct{}{}
	}
	return nil
}

// ownsLocked says why one of ids is not c's lease, under o.mu, or nil.
func (o *Owner) ownsLocked(c *conn, ids []uint64) error {
	for _, id := range ids {
		if _, err := o.findLocked(c, id); err != nil {
			return err
		}
	}
	return nil
}

// match answers Match: the longest run of the hashes visible on c's device, copied in
// from another device's slab where only that one has them, or restored from the
// device's host tier, leased for reading. It waits for the reattach window as an
// Alloc does.
func (c *conn) match(h kvwire.Header, p []byte) error {
	o := c.o
	m, err := kvwire.DecodeMatch(p)
	if err != nil {
		return c.refuse(h.ID, err)
	}
	hashes := m.Hashes
	if err := c.distinct(hashes); err != nil {
		return c.sendError(h.ID, err)
	}
	if !o.awaitResumed() {
		return c.refuse(h.ID, fmt.Errorf("%w: the owner is closing", kv.ErrClosed))
	}
	c.lock()
	run := c.runLocked(hashes)
	if run < len(hashes) && len(o.slabs) > 1 && o.elsewhereLocked(c.s, hashes[run]) {
		c.unlock()
		return c.matchAcross(h, hashes)
	}
	return c.matchLocked(h.ID, hashes, run)
}

// runLocked is how long a run of hashes, from the first, c's slab holds in either
// tier, under o.mu.
func (c *conn) runLocked(hashes []kv.Hash) int {
	t := c.s.tab
	for i, hh := range hashes {
		if _, ok := t.Lookup(hh); ok {
			continue
		}
		if _, ok := t.HostLookup(hh); !ok {
			return i
		}
	}
	return len(hashes)
}

// matchLocked ends a Match whose run in c's slab is run pages long, with o.mu held on
// entry and released on return: it leases the run (no lease if none), within c's
// caps, restoring what is in the host tier (Table.Match, the copies, CopyDone), and
// answers request id with that lease once the index has it.
func (c *conn) matchLocked(id uint32, hashes []kv.Hash, run int) error {
	o, s := c.o, c.s
	if err := c.roomLocked(run); err != nil && run > 0 {
		c.unlock()
		return c.sendError(id, err)
	}
	res, fx, err := s.tab.Match(c.holder, hashes)
	if err != nil {
		c.unlock()
		return c.sendError(id, fmt.Errorf("%w: %w", kv.ErrClosed, err))
	}
	seq := o.effectsLocked(s, fx)
	var l *lease
	if !res.Pending {
		l = o.grantLocked(c, s, res.Lease, false, res.Pages)
		c.noteTipLocked(hashes, res.Pages)
	}
	c.unlock()
	if res.Pending {
		res, err = o.doEffects(s, fx, seq)
		c.lock()
		l = o.grantLocked(c, s, res.Lease, false, res.Pages)
		c.noteTipLocked(hashes, res.Pages)
		c.unlock()
	} else {
		err = o.journaled(o.stopped, seq)
	}
	if err != nil {
		c.abandon(l)
		return c.sendError(id, err)
	}
	var lid uint64
	var pgs []uint32
	if l != nil {
		lid, pgs = l.id, l.pages
	}
	return c.write(func(b []byte) ([]byte, error) {
		return kvwire.AppendLease(b, kvwire.TypeMatched, id, lid, pgs)
	})
}

// noteTipLocked remembers where a match of hashes that found the run pages ended, under
// o.mu: a run short of the hashes is usually continued by a Seal of the rest.
func (c *conn) noteTipLocked(hashes []kv.Hash, pgs []uint32) {
	c.tip.last = pages.NoRef
	if len(pgs) > 0 && len(pgs) < len(hashes) {
		c.tip.next, c.tip.last = hashes[len(pgs)], c.s.tab.Ref(pgs[len(pgs)-1])
	}
}

// parentLocked is the page that a seal of hashes continues, if it continues the latest
// match's run, under o.mu.
func (c *conn) parentLocked(hashes []kv.Hash) pages.Ref {
	if len(hashes) > 0 && c.tip.last != pages.NoRef && hashes[0] == c.tip.next {
		return c.tip.last
	}
	return pages.NoRef
}

// distinct says which hash of hashes repeats an earlier one, if one does.
func (c *conn) distinct(hashes []kv.Hash) error {
	if len(hashes) < 2 {
		return nil
	}
	if c.seen == nil {
		c.seen = make(map[kv.Hash]int, len(hashes))
	}
	defer clear(c.seen)
	for i, h := range hashes {
		if j, ok := c.seen[h]; ok {
			return fmt.Errorf("%w: hash %d repeats hash %d: a prefix's hashes are distinct", kv.ErrGeometry, i, j)
		}
		c.seen[h] = i
	}
	return nil
}

// stats answers Stats with the owner's Stats as JSON.
func (c *conn) stats(h kvwire.Header, p []byte) error {
	if len(p) != 0 {
		return fmt.Errorf("%w: Stats with %d bytes of payload", kvwire.ErrMalformed, len(p))
	}
	js, err := encodeStats(c.o.Stats())
	if err != nil {
		return c.sendError(h.ID, err)
	}
	return c.write(func(b []byte) ([]byte, error) {
		start := len(b)
		return kvwire.End(append(kvwire.Begin(b, kvwire.TypeStatsReply, 0, h.ID), js...), start)
	})
}

// encodeStats is st as the JSON of a Stats frame: at most kv.MaxListed replicas
// listed, fewer where their entries would not fit the frame, ReplicasOmitted counting
// the rest.
func encodeStats(st Stats) ([]byte, error) {
	all := st.Replicas
	n := min(len(all), kv.MaxListed)
	for {
		st.Replicas, st.ReplicasOmitted = all[:n], len(all)-n
		js, err := json.Marshal(st)
		switch {
		case err != nil:
			return nil, err
		case len(js) <= kvwire.MaxFrame-kvwire.HeaderLen:
			return js, nil
		case n == 0:
			return nil, fmt.Errorf("%w: the stats take %d bytes without replicas", kv.ErrTooLarge, len(js))
		}
		n /= 2
	}
}

// finish ends the connection. After Bye the leases still held end at once, and the
// connection closes once its releases have settled. A connection lost without Bye
// that holds leases, or releases still to settle, keeps them until its process has
// exited (it may still use the pages); one that holds nothing ends at once, and so
// does one whose process cannot be watched, or whose owner is closing.
func (c *conn) finish(bye *kvwire.Bye) {
	o := c.o
	switch {
	case !c.isWelcomed():
	case bye == nil && c.holdsNothing():
	case bye != nil:
		if bye.Final {
			c.releaseHeld(bye.Point)
		}
		c.lock()
		o.endLeasesLocked(c)
		idle := make(chan struct{})
		c.idle = idle
		if !c.pendingLocked() {
			close(idle)
			c.idle = nil
		}
		c.unlock()
		ctx, stop := context.WithCancel(o.stopped)
		exited := c.waitExit(ctx)
		select {
		case <-idle:
		case <-ctx.Done():
		case <-exited:
		}
		stop()
		<-exited
	case c.proc != nil && o.stopped.Err() == nil:
		ctx, stop := context.WithCancel(o.stopped)
		c.lock()
		c.lost, c.stopWait = true, stop
		c.unlock()
		_ = c.nc.Close() // cleanup: the connection is lost already
		c.awaitExit(ctx)
		stop()
	}
	if c.s != nil {
		c.unreach(c.s)
	}
	_ = c.sc.Close() // cleanup: nothing is left to do if closing fails
	var owed []answer
	c.lock()
	c.ended = true
	owed = o.exitedLocked(c, owed)
	if c.welcomed {
		o.detachedLocked(c)
	}
	delete(o.conns, c)
	ns := c.notifiers
	c.notifiers = map[uint32]*notifier{}
	c.unlock()
	o.send(owed)
	closeNotifiers(ns)
	if c.rd != nil {
		c.rd.Close()
	}
	if c.proc != nil {
		_ = c.proc.Close() // cleanup: nothing is left to do if closing fails
	}
}

// holdsNothing says whether c holds no lease and no record waits for its notifiers.
func (c *conn) holdsNothing() bool {
	c.lock()
	defer c.unlock()
	return len(c.held) == 0 && !c.pendingLocked()
}

func (c *conn) isWelcomed() bool {
	c.lock()
	defer c.unlock()
	return c.welcomed
}

// waitExit returns a channel closed once c's process has exited or ctx has ended (at
// once if the process cannot be watched: then nothing can tell).
func (c *conn) waitExit(ctx context.Context) <-chan struct{} {
	ch := make(chan struct{})
	if c.proc == nil {
		close(ch)
		return ch
	}
	go func() {
		defer close(ch)
		c.awaitExit(ctx)
	}()
	return ch
}

// awaitExit waits until c's process has exited or ctx has ended; a wait that fails
// otherwise is logged, and returns as if the process had exited.
func (c *conn) awaitExit(ctx context.Context) {
	if err := c.proc.Wait(ctx); err != nil && ctx.Err() == nil {
		c.o.log.Warn("kv: cannot wait for a replica's process; its connection ends now", "pid", c.cred.PID, "err", err)
	}
}

// pendingLocked says whether records wait for any of c's notifiers, under o.mu.
func (c *conn) pendingLocked() bool {
	for _, n := range c.notifiers {
		if len(n.pending) > 0 {
			return true
		}
	}
	return false
}

// signalIdle tells finish, waiting after Bye, that c's releases have settled.
func (o *Owner) signalIdle(c *conn) {
	if c.idle != nil && !c.pendingLocked() {
		close(c.idle)
		c.idle = nil
	}
}

// endLeasesLocked ends c's leases at once, under o.mu: write-leased pages are freed,
// read-leased pages lose a reader.
func (o *Owner) endLeasesLocked(c *conn) {
	for _, l := range c.held {
		o.endNowLocked(l)
	}
}

// exitedLocked ends everything of c's, under o.mu, once its process has exited (or it
// cannot be watched, or the owner closes): its leases end, its pending seals publish
// nothing and their pages are freed, its pending releases settle. It returns owed
// with the answers to Seals that waited, marked dead (nobody to send them to).
func (o *Owner) exitedLocked(c *conn, owed []answer) []answer {
	o.endLeasesLocked(c)
	for _, n := range c.notifiers {
		owed = o.settleReachedLocked(n, false, owed)
	}
	for i := range owed {
		if owed[i].c == c {
			owed[i].dead = true
		}
	}
	return owed
}
