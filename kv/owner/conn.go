package owner

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"sync"
	"time"

	"github.com/cudapool/cudapool/cudart"
	"github.com/cudapool/cudapool/internal/peercred"
	"github.com/cudapool/cudapool/kv"
	"github.com/cudapool/cudapool/kv/internal/kvwire"
)

// handshakeTimeout bounds how long a connecting process may take to say Hello.
const handshakeTimeout = 10 * time.Second

// writeTimeout bounds a write to a replica that does not read its answers: past it,
// the connection is closed.
const writeTimeout = 10 * time.Second

// conn is one replica's connection.
type conn struct {
	o    *Owner
	nc   *net.UnixConn
	cred peercred.Cred
	proc *peercred.Process // nil where the process cannot be watched
	s    *slab             // the slab of the replica's device
	ns   string
	id   procID // the replica's process, as the index names it; zero if unknown

	// Guarded by Owner.mu.
	welcomed bool
	lost     bool          // the connection ended without Bye; the process may live on
	idle     chan struct{} // set while Bye waits for the releases to settle

	// Written by the connection's goroutine under Owner.mu, read by it without.
	events map[[kvwire.EventLen]byte]*event
	// The connection's goroutine alone.
	scratch []uint32
	leaseID []uint64

	wmu  sync.Mutex
	wbuf []byte
}

// exited says whether the replica's process has exited; false where it cannot be
// watched.
func (c *conn) exited() bool {
	if c.proc == nil {
		return false
	}
	ok, err := c.proc.Exited()
	return err == nil && ok
}

// write sends the frame in c.wbuf (filled by fill, under wmu).
func (c *conn) write(fill func([]byte) ([]byte, error)) error {
	c.wmu.Lock()
	defer c.wmu.Unlock()
	b, err := fill(c.wbuf[:0])
	c.wbuf = b[:0]
	if err != nil {
		return err
	}
	_ = c.nc.SetWriteDeadline(time.Now().Add(writeTimeout)) // it fails only on a closed connection, which the next read or write reports
	_, err = c.nc.Write(b)
	return err
}

// sendSealed answers a Seal that waited; a replica that cannot be answered is cut off.
func (c *conn) sendSealed(id uint32, m kvwire.Sealed) {
	if err := c.write(func(b []byte) ([]byte, error) { return kvwire.AppendSealed(b, id, m) }); err != nil {
		_ = c.nc.Close() // cleanup: the write's failure is what ends the connection
	}
}

func (c *conn) sendError(id uint32, err error) error {
	return c.write(func(b []byte) ([]byte, error) { return kvwire.AppendError(b, id, kvwire.Code(err), err.Error()) })
}

// serveConn admits nc and serves it until it ends, then ends what it held.
func (o *Owner) serveConn(nc *net.UnixConn) {
	c := &conn{o: o, nc: nc, events: map[[kvwire.EventLen]byte]*event{}}
	o.mu.Lock()
	if o.closed {
		o.mu.Unlock()
		_ = nc.Close() // cleanup: nothing was said on it
		return
	}
	o.conns[c] = struct{}{}
	o.mu.Unlock()
	rd := kvwire.NewReader()
	bye := false
	err := c.admit(rd)
	if errors.Is(err, errObserved) {
		err = nil
	} else if err == nil {
		bye, err = c.serve(rd)
	}
	if err != nil && o.stopped.Err() == nil {
		o.log.Warn("kv: closing a replica's connection", "pid", c.cred.PID, "reason", err)
	}
	c.finish(bye)
}

// admit reads the Hello, applies the policy and answers Welcome or Refused.
func (c *conn) admit(rd *kvwire.Reader) (err error) {
	o := c.o
	_ = c.nc.SetDeadline(time.Now().Add(handshakeTimeout)) // it fails only on a closed connection, which the next read or write reports
	if c.cred, err = peercred.Get(c.nc); err != nil {
		return err
	}
	refuse := func(reason string) error {
		_ = c.write(func(b []byte) ([]byte, error) { return kvwire.AppendText(b, kvwire.TypeRefused, 0, reason) }) // the replica may be gone already; the refusal is the error returned
		return fmt.Errorf("refused pid %d: %s", c.cred.PID, reason)
	}
	h, p, err := rd.Next(c.nc)
	if err != nil {
		return fmt.Errorf("before Hello: %w", err)
	}
	if h.Type != kvwire.TypeHello {
		return refuse(fmt.Sprintf("the first frame must be Hello, got %s", h.Type))
	}
	pr := kvwire.NewParser(h.Type, p)
	hello := kvwire.Hello{Version: pr.U32(), PID: pr.U32(), Device: pr.U32(), Namespace: pr.Text()}
	if err := pr.Done(); err != nil {
		return refuse(err.Error())
	}
	if reason := admits(o.opts.Policy, c.cred); reason != "" {
		return refuse(reason)
	}
	if hello.Version != kvwire.Version {
		return refuse(fmt.Sprintf("protocol version %d; this owner speaks %d", hello.Version, kvwire.Version))
	}
	if hello.Device == kvwire.Observer {
		if err := c.write(func(b []byte) ([]byte, error) {
			return kvwire.AppendWelcome(b, h.ID, kvwire.Welcome{Geometry: o.geo})
		}); err != nil {
			return err
		}
		_ = c.nc.SetDeadline(time.Time{}) // it fails only on a closed connection, which the next read or write reports
		return c.observe(rd)
	}
	s := o.byDev[int(hello.Device)]
	if s == nil {
		return refuse(fmt.Sprintf("%v: device %d is not served here (devices %v)", kv.ErrGeometry, hello.Device, o.opts.Devices))
	}
	c.s, c.ns = s, hello.Namespace
	// Opened while the replica is connected, so that it names the process that
	// connected even if its pid is reused later.
	if c.proc, err = peercred.OpenProcess(c.cred.PID); err != nil {
		c.proc = nil
		o.log.Warn("kv: cannot watch a replica's process; its leases end with its connection", "pid", c.cred.PID, "err", err)
	}
	if err := c.write(func(b []byte) ([]byte, error) {
		return kvwire.AppendWelcome(b, h.ID, kvwire.Welcome{Geometry: o.geo, Slab: s.name})
	}); err != nil {
		return err
	}
	_ = c.nc.SetDeadline(time.Time{}) // it fails only on a closed connection, which the next read or write reports
	o.mu.Lock()
	c.welcomed = true
	o.attachedLocked(c)
	o.mu.Unlock()
	return nil
}

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
func (c *conn) serve(rd *kvwire.Reader) (bye bool, err error) {
	for {
		h, p, err := rd.Next(c.nc)
		if err != nil {
			if errors.Is(err, net.ErrClosed) || isEOF(err) {
				return false, nil
			}
			return false, err
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
		case kvwire.TypeBye:
			if len(p) != 0 {
				return false, fmt.Errorf("%w: Bye with %d bytes of payload", kvwire.ErrMalformed, len(p))
			}
			return true, nil
		default:
			return false, fmt.Errorf("%w: unexpected %s frame", kvwire.ErrMalformed, h.Type)
		}
		if err != nil {
			return false, err
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
	pr := kvwire.NewParser(h.Type, p)
	n := int(pr.U32())
	if err := pr.Done(); err != nil {
		return err
	}
	switch {
	case n > kv.MaxBatch:
		return c.refuse(h.ID, fmt.Errorf("%w: %d pages, at most %d", kv.ErrTooLarge, n, kv.MaxBatch))
	case n < 1 || n > len(s.pages):
		return c.refuse(h.ID, fmt.Errorf("%w: %d pages asked, the slab has %d", kv.ErrGeometry, n, len(s.pages)))
	}
	if !o.awaitResumed() {
		return c.refuse(h.ID, fmt.Errorf("%w: the owner is closing", kv.ErrClosed))
	}
	o.mu.Lock()
	pages, ok, evicted := o.takeLocked(s, n)
	if !ok {
		free := len(s.free)
		o.mu.Unlock()
		return c.refuse(h.ID, fmt.Errorf("%w: %d pages asked, %d free and not enough evictable (device %d)", kv.ErrNoSpace, n, free, s.dev))
	}
	l := o.newLeaseLocked(c, true, pages)
	o.mu.Unlock()
	// Evicted pages the host tier has no copy of go there before they are written.
	if err := o.copyEvicted(s, evicted, nil); err != nil {
		o.log.Error("kv: spilling evicted pages to the host tier failed; they are gone", "device", s.dev, "err", err)
	}
	return c.write(func(b []byte) ([]byte, error) { return kvwire.AppendLease(b, kvwire.TypeLeased, h.ID, l.id, l.pages) })
}

// newLeaseLocked makes a lease of pages for c, under o.mu.
func (o *Owner) newLeaseLocked(c *conn, write bool, pages []uint32) *lease {
	o.nextLease++
	l := &lease{id: o.nextLease, c: c, s: c.s, write: write, pages: pages}
	o.leases[l.id] = l
	return l
}

// findLocked returns c's lease id, or why there is none, under o.mu.
func (o *Owner) findLocked(c *conn, id uint64) (*lease, error) {
	l, ok := o.leases[id]
	switch {
	case ok && l.c == c:
		return l, nil
	case ok:
		return nil, fmt.Errorf("%w: lease %d belongs to another replica", kv.ErrStaleLease, id)
	case id == 0 || id > o.nextLease:
		return nil, fmt.Errorf("%w: lease %d was never issued", kv.ErrStaleLease, id)
	}
	return nil, fmt.Errorf("%w: lease %d has ended", kv.ErrStaleLease, id)
}

// event returns c's event for handle h, opening it the first time.
func (c *conn) event(h *[kvwire.EventLen]byte) (*event, error) {
	if e, ok := c.events[*h]; ok {
		return e, nil
	}
	e := &event{c: c}
	if *h != ([kvwire.EventLen]byte{}) {
		ev, err := c.o.rt.IpcOpenEventHandle(c.s.dev, cudart.IpcEventHandle(*h))
		if err != nil {
			return nil, fmt.Errorf("opening the replica's event: %w", err)
		}
		e.ev = ev
	}
	c.o.mu.Lock() // the poller reads c.events under it
	c.events[*h] = e
	c.o.mu.Unlock()
	return e, nil
}

// seal answers Seal: the write lease ends; its first n pages are published under the
// hashes once the writer's event has completed, the rest are freed then.
func (c *conn) seal(h kvwire.Header, p []byte) error {
	o := c.o
	pr := kvwire.NewParser(h.Type, p)
	id := pr.U64()
	evh := pr.Event()
	hashes := pr.Hashes()
	if err := pr.Done(); err != nil {
		return c.refuse(h.ID, err)
	}
	e, err := c.event(&evh)
	if err != nil {
		return c.sendError(h.ID, err)
	}
	o.mu.Lock()
	l, err := o.findLocked(c, id)
	if err == nil && !l.write {
		err = fmt.Errorf("%w: lease %d is a read lease; only a write lease is sealed", kv.ErrStaleLease, id)
	}
	if err == nil && len(hashes) > len(l.pages) {
		err = fmt.Errorf("%w: %d hashes for a lease of %d pages", kv.ErrGeometry, len(hashes), len(l.pages))
	}
	if err != nil {
		o.mu.Unlock()
		return c.sendError(h.ID, err)
	}
	delete(o.leases, id)
	rec := &record{s: l.s, seal: l.pages[:len(hashes)], hashes: append([]kv.Hash(nil), hashes...), free: l.pages[len(hashes):]}
	for _, pg := range rec.seal {
		l.s.pages[pg].state = pageSealing
	}
	for _, pg := range rec.free {
		l.s.pages[pg].state = pageSettling
	}
	owed := c.submitLocked(e, rec)
	ans := kvwire.Sealed{Pending: uint32(len(rec.seal))}
	if rec.done {
		ans = kvwire.Sealed{Visible: uint32(rec.visible), Duplicates: uint32(rec.duplicate)}
	}
	wait := !rec.done && h.Flags&kvwire.FlagWait != 0
	if wait {
		rec.waiting, rec.wait = true, h.ID
	}
	o.unlockAfterSubmit(e, rec, owed)
	if wait {
		return nil
	}
	return c.write(func(b []byte) ([]byte, error) { return kvwire.AppendSealed(b, h.ID, ans) })
}

// release answers Release: every lease named ends (or, if one is not c's, none does),
// its pages settling until the event has completed.
func (c *conn) release(h kvwire.Header, p []byte) error {
	o := c.o
	pr := kvwire.NewParser(h.Type, p)
	evh := pr.Event()
	c.leaseID = pr.U64s(c.leaseID[:0])
	if err := pr.Done(); err != nil {
		return c.refuse(h.ID, err)
	}
	if len(c.leaseID) == 0 {
		return c.sendError(h.ID, fmt.Errorf("%w: a release of no lease", kv.ErrGeometry))
	}
	e, err := c.event(&evh)
	if err != nil {
		return c.sendError(h.ID, err)
	}
	o.mu.Lock()
	for i, id := range c.leaseID {
		_, err := o.findLocked(c, id)
		if err == nil && slicesContains(c.leaseID[:i], id) {
			err = fmt.Errorf("%w: lease %d is listed twice", kv.ErrStaleLease, id)
		}
		if err != nil {
			o.mu.Unlock()
			return c.sendError(h.ID, err)
		}
	}
	rec := &record{s: c.s}
	for _, id := range c.leaseID {
		l := o.leases[id]
		delete(o.leases, id)
		if l.write {
			for _, pg := range l.pages {
				l.s.pages[pg].state = pageSettling
			}
			rec.free = append(rec.free, l.pages...)
			continue
		}
		for _, pg := range l.pages {
			pp := &l.s.pages[pg]
			pp.readers--
			pp.releasing++
		}
		rec.released = append(rec.released, l.pages...)
	}
	owed := c.submitLocked(e, rec)
	o.unlockAfterSubmit(e, rec, owed)
	n := uint32(len(c.leaseID))
	return c.write(func(b []byte) ([]byte, error) { return kvwire.AppendU32(b, kvwire.TypeReleased, h.ID, n) })
}

// submitLocked queues rec behind e and asks e at once, with o.mu held on entry and
// on return (not during the query): if e has completed, rec is settled when it
// returns. It returns the answers owed to Seals that waited.
func (c *conn) submitLocked(e *event, rec *record) []answer {
	o := c.o
	upTo := e.append(rec)
	o.mu.Unlock()
	done, dead := o.query(e)
	o.mu.Lock()
	switch {
	case dead:
		return o.exitedLocked(c, nil)
	case done:
		return o.settleUpTo(e, upTo, true, nil)
	}
	return nil
}

// unlockAfterSubmit leaves rec, submitted, to the poller if it has not settled,
// releases o.mu and sends owed.
func (o *Owner) unlockAfterSubmit(e *event, rec *record, owed []answer) {
	pending := !rec.done
	if pending {
		o.enqueue(e)
	}
	o.mu.Unlock()
	o.send(owed)
	if pending {
		o.wake()
	}
}

func slicesContains(s []uint64, v uint64) bool {
	for _, x := range s {
		if x == v {
			return true
		}
	}
	return false
}

// match answers Match: the longest run of the hashes visible on c's device, copied in
// from another device's slab where only that one has them, or restored from the
// device's host tier (restore.go), leased for reading.
func (c *conn) match(h kvwire.Header, p []byte) error {
	o, s := c.o, c.s
	pr := kvwire.NewParser(h.Type, p)
	hashes := pr.Hashes()
	if err := pr.Done(); err != nil {
		return c.refuse(h.ID, err)
	}
	o.mu.Lock()
	pages := s.lookup(hashes, c.scratch[:0])
	c.scratch = pages[:0]
	if len(pages) < len(hashes) && len(o.slabs) > 1 && o.elsewhereLocked(s, hashes[len(pages)]) {
		o.mu.Unlock()
		return c.matchAcross(h, hashes)
	}
	if len(pages) < len(hashes) && c.inHostLocked(hashes[len(pages)]) {
		o.mu.Unlock()
		return c.matchRestore(h, hashes)
	}
	ans := o.leaseRunLocked(c, pages, len(hashes))
	o.mu.Unlock()
	return c.write(func(b []byte) ([]byte, error) {
		return kvwire.AppendLease(b, kvwire.TypeMatched, h.ID, ans.id, ans.pages)
	})
}

// leaseRunLocked leases sealed pages of c's slab for reading (no lease if none), under
// o.mu, and counts the hits and misses of a match of asked hashes.
func (o *Owner) leaseRunLocked(c *conn, pages []uint32, asked int) (l lease) {
	s := c.s
	s.stats.Hits += uint64(len(pages))
	s.stats.Misses += uint64(asked - len(pages))
	if len(pages) == 0 {
		return lease{}
	}
	for _, pg := range pages {
		s.pages[pg].readers++
	}
	s.touch(pages)
	return *o.newLeaseLocked(c, false, append([]uint32(nil), pages...))
}

// stats answers Stats with the owner's Stats as JSON.
func (c *conn) stats(h kvwire.Header, p []byte) error {
	if len(p) != 0 {
		return fmt.Errorf("%w: Stats with %d bytes of payload", kvwire.ErrMalformed, len(p))
	}
	js, err := json.Marshal(c.o.Stats())
	if err != nil {
		return c.sendError(h.ID, err)
	}
	if len(js) > kvwire.MaxFrame-kvwire.HeaderLen {
		return c.sendError(h.ID, fmt.Errorf("%w: the stats take %d bytes", kv.ErrTooLarge, len(js)))
	}
	return c.write(func(b []byte) ([]byte, error) {
		start := len(b)
		return kvwire.End(append(kvwire.Begin(b, kvwire.TypeStatsReply, 0, h.ID), js...), start)
	})
}

// finish ends the connection. After Bye the leases still held end at once, and the
// connection closes once its releases have settled. A connection lost without Bye
// keeps its leases until its process has exited; one whose process cannot be watched,
// or whose owner is closing, ends them at once.
func (c *conn) finish(bye bool) {
	o := c.o
	switch {
	case !c.isWelcomed():
	case bye:
		o.mu.Lock()
		o.endLeasesLocked(c)
		idle := make(chan struct{})
		c.idle = idle
		if !c.pendingLocked() {
			close(idle)
			c.idle = nil
		}
		o.mu.Unlock()
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
		o.mu.Lock()
		c.lost = true
		o.mu.Unlock()
		_ = c.nc.Close() // cleanup: the connection is lost already
		ctx, stop := context.WithCancel(o.stopped)
		c.awaitExit(ctx)
		stop()
	}
	_ = c.nc.Close() // cleanup: nothing is left to do if closing fails
	var owed []answer
	o.mu.Lock()
	owed = o.exitedLocked(c, owed)
	if c.welcomed {
		o.detachedLocked(c)
	}
	delete(o.conns, c)
	o.dead = append(o.dead, c)
	o.mu.Unlock()
	o.send(owed)
	o.wake()
}

func (c *conn) isWelcomed() bool {
	c.o.mu.Lock()
	defer c.o.mu.Unlock()
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

// pendingLocked says whether records wait for any of c's events, under o.mu.
func (c *conn) pendingLocked() bool {
	for _, e := range c.events {
		if len(e.pending) > 0 {
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
	for id, l := range o.leases {
		if l.c != c {
			continue
		}
		delete(o.leases, id)
		for _, pg := range l.pages {
			if l.write {
				l.s.release(pg)
			} else {
				l.s.pages[pg].readers--
			}
		}
	}
}

// exitedLocked ends everything of c's, under o.mu, once its process has exited (or it
// cannot be watched, or the owner closes): its leases end, its pending seals publish
// nothing and their pages are freed, its pending releases settle. It returns owed
// with the answers to Seals that waited, marked dead (nobody to send them to).
func (o *Owner) exitedLocked(c *conn, owed []answer) []answer {
	o.endLeasesLocked(c)
	for _, e := range c.events {
		owed = o.settleUpTo(e, e.appended, false, owed)
	}
	for i := range owed {
		if owed[i].c == c {
			owed[i].dead = true
		}
	}
	return owed
}
