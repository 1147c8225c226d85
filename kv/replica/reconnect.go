package replica

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"net"
	"path/filepath"
	"slices"
	"time"

	"github.com/cudapool/cudapool/internal/peercred"
	"github.com/cudapool/cudapool/internal/session"
	"github.com/cudapool/cudapool/kv"
	"github.com/cudapool/cudapool/kv/internal/kvwire"
)

// WithReconnect makes the replica reattach by itself to an owner restarted on the
// same directory (cmd/kvpoold over a keeper, owner.WithKeeper), keeping its
// process, its CUDA context and its mapping of the slab, which the keeper holds.
//
// When the owner is lost, Done closes and calls fail with [kv.ErrOwnerGone], as without
// it. The replica then waits for the work its streams queued before its last Seal
// and Release (so that no page it gave back is still read or written), redials the
// page socket with backoff (5 ms up to 100 ms), says Hello, and re-declares every
// lease it holds. The new owner keeps each lease whose pages are as they were (a
// write lease's still free, a read lease's still visible under the hashes matched)
// under the same id, and reports the others lost: their Lost() wraps [kv.ErrLeaseLost],
// and Seal or Release of them fails with it. Then the replica is attached again:
// Err is nil, Done is a new channel, Reattaches counts one more and WaitAttached
// returns. A lost lease's pages may be another replica's already: do not read or
// write them. A Seal or Release that failed with kv.ErrOwnerGone leaves its lease
// held, and re-declared: the restarted owner holds its pages until the call is made
// again once attached (WaitAttached), or until Close; a caller that drops such a
// lease leaks its pages until then. The leases re-declared are those the replies
// read before the owner was lost left held: a lease granted by a reply that was not
// read was never the caller's, and one whose release was answered is not declared.
//
// The restarted owner lets pages be allocated once every replica attached before has
// re-declared its leases, or after its grace (owner.WithReattachGrace, kvpoold's
// -reattach-grace): past it, a read lease whose pages were evicted meanwhile is lost;
// a write lease's pages are kept for this process while it lives, and re-declared late
// it is kept (docs/PROTOCOL.md, the restart contract).
//
// When the slab's keeper is gone, the slab is gone: the replica stays stopped.
func WithReconnect() Option { return func(o *options) { o.reconnect = true } }

// Reattaches counts the times the replica reattached to a restarted owner.
func (r *Replica) Reattaches() uint64 {
	r.mu.Lock()
	defer r.mu.Unlock()
	return r.reattaches
}

// WaitAttached waits until the replica is attached to a live owner: at once while it
// is, after a reconnection ([WithReconnect]) otherwise. It fails with ctx's error, with
// [kv.ErrClosed] after Close, and with [kv.ErrOwnerGone] where no reconnection can come
// (without WithReconnect, or once the slab's keeper is gone).
func (r *Replica) WaitAttached(ctx context.Context) error {
	for {
		r.mu.Lock()
		att, err, closed, hopeless := r.attached, r.err, r.closed, r.stranded || !r.opts.reconnect
		r.mu.Unlock()
		switch {
		case closed:
			return kv.ErrClosed
		case err == nil:
			return nil
		case hopeless:
			return err
		}
		// att closes once attached again, or once the reconnection gave up.
		select {
		case <-att:
		case <-ctx.Done():
			return ctx.Err()
		case <-r.closing:
		}
	}
}

// track records l as held, to re-declare after an owner's restart (WithReconnect). It
// runs as the reply granting l is handled, with the reading role held (roundTrip).
func (r *Replica) track(l *Lease) {
	if l.id == 0 || !r.opts.reconnect {
		return
	}
	r.mu.Lock()
	r.leases[l.id] = l
	r.mu.Unlock()
}

// untrack forgets leases that ended, as the reply ending them is handled.
func (r *Replica) untrack(ls ...*Lease) {
	if !r.opts.reconnect {
		return
	}
	r.mu.Lock()
	for _, l := range ls {
		if l != nil {
			delete(r.leases, l.id)
		}
	}
	r.mu.Unlock()
}

// reattachBackoffMin and reattachBackoffMax bound the backoff between reattaches.
const (
	reattachBackoffMin = 5 * time.Millisecond
	reattachBackoffMax = 100 * time.Millisecond
)

// reconnectLocked starts a reconnection after connection cl failed, under r.mu.
func (r *Replica) reconnectLocked(cl *session.Client[reply]) {
	if !r.opts.reconnect || r.closed || r.stranded {
		return
	}
	r.attached = make(chan struct{})
	r.reconnWG.Add(1)
	go r.reconnect(cl, r.owner, r.stopW)
	r.owner = nil // the reconnection ends it
}

// reconnect redials until it reattaches, the keeper goes or Close; it first ends what
// watched the lost connection, cl.
func (r *Replica) reconnect(cl *session.Client[reply], owner *peercred.Process, stopW chan struct{}) {
	defer r.reconnWG.Done()
	installed := false
	defer func() {
		if !installed { // WaitAttached returns the replica's error
			r.mu.Lock()
			r.stranded = true
			close(r.attached)
			r.mu.Unlock()
		}
	}()
	close(stopW)
	if owner != nil {
		_ = owner.Close() // cleanup: the process is gone
	}
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	go func() {
		select {
		case <-r.closing:
		case <-r.keeperGone:
		case <-ctx.Done():
		}
		cancel()
	}()
	if err := r.drainEvents(ctx); err != nil {
		r.log.Warn("kv: cannot wait for this replica's streams; it does not reattach", "err", err)
		return
	}
	last, ctxErr := session.Retry(ctx, reattachBackoffMin, reattachBackoffMax, kv.ErrOwnerGone, func() (bool, error) {
		err := r.reattach(ctx, cl)
		if err == nil || errors.Is(err, kv.ErrGeometry) {
			return false, err
		}
		r.log.Debug("kv: reattaching", "err", err)
		return true, err
	})
	switch {
	case ctxErr != nil:
	case last != nil:
		r.log.Warn("kv: the restarted owner serves another slab; this replica does not reattach", "err", last)
	default:
		installed = true
	}
}

// drainEvents waits until the last record of every stream's event (after its latest
// point) has completed: then no Seal's writes and no Release's reads are still running.
func (r *Replica) drainEvents(ctx context.Context) error {
	r.evMu.Lock()
	evs := r.allNotifiers()
	r.evMu.Unlock()
	return r.awaitEvents(ctx, evs)
}

// awaitEvents waits until the last record of each of evs' events has completed, or
// ctx ends.
func (r *Replica) awaitEvents(ctx context.Context, evs []*streamNotifier) error {
	for _, e := range evs {
		wait := 50 * time.Microsecond
		for {
			done, err := r.rt.EventQuery(r.dev, e.ev)
			if err != nil {
				return err
			}
			if done {
				break
			}
			select {
			case <-time.After(wait):
			case <-ctx.Done():
				return ctx.Err()
			}
			wait = min(2*wait, 5*time.Millisecond)
		}
	}
	return nil
}

// reattach dials the page socket, says Hello, re-declares the leases held on lost, the
// lost connection's client, and installs the connection.
func (r *Replica) reattach(ctx context.Context, lost *session.Client[reply]) (err error) {
	nc, err := dialPages(ctx, filepath.Join(r.dir, kvwire.PageSocket), false)
	if err != nil {
		return err
	}
	defer func() {
		if errors.Is(err, kv.ErrClosed) { // a Bye, so that the owner ends the leases re-declared at once
			b, _ := kvwire.AppendEmpty(nil, kvwire.TypeBye, 0)
			_, _ = nc.Write(b) // best effort: an owner that misses it ends them when this process exits
		}
		if err != nil {
			_ = nc.Close() // cleanup: the reattach's error is the one returned
		}
	}()
	ln := newLink(nc)
	w, err := r.hello(ctx, nc, ln)
	if err != nil {
		return err
	}
	if w.Geometry != r.geo || w.Slab != r.slab || w.ChunkBytes != r.layout.ChunkBytes() || int(w.Chunks) > r.layout.Chunks() {
		return fmt.Errorf("%w: the owner serves %s of %v in chunks of %d bytes; this replica maps %s of %v in chunks of %d bytes",
			kv.ErrGeometry, w.Slab, w.Geometry, w.ChunkBytes, r.slab, r.geo, r.layout.ChunkBytes())
	}
	if int(w.Chunks) < r.m.Chunks() { // the owner gave chunks back meanwhile
		if err := keepChunks(r.m, int(w.Chunks)); err != nil {
			return err
		}
	}
	if err := awaitOn(ctx, nc, func() error { return ln.await(r.m, int(w.Chunks)) }); err != nil {
		return fmt.Errorf("%w: the slab's chunks: %w", kv.ErrOwnerGone, err)
	}
	var owner *peercred.Process
	if cred, err := peercred.Get(nc); err == nil {
		if owner, err = peercred.OpenProcess(cred.PID); err != nil {
			owner = nil
		}
	}
	defer func() {
		if err != nil && owner != nil {
			_ = owner.Close() // cleanup: the reattach's error is the one returned
		}
	}()
	// With the lost connection's reading role, no reply is being handled: every lease a
	// reply read on it granted is listed, and none it ended. (ctx ends with Close.)
	release, err := lost.Hold(ctx)
	if err != nil {
		return err
	}
	defer release()
	r.mu.Lock()
	held := make([]*Lease, 0, len(r.leases))
	for _, l := range r.leases {
		held = append(held, l)
	}
	r.mu.Unlock()
	slices.SortFunc(held, func(a, b *Lease) int { return cmp.Compare(a.id, b.id) })
	gone, err := r.redeclare(ctx, nc, ln, held)
	if err != nil {
		return err
	}
	return r.install(nc, ln, owner, gone)
}

// redeclare sends a Reattach for each lease and then the end of the list, and reads
// the answers; it returns the leases lost and why.
func (r *Replica) redeclare(ctx context.Context, nc *net.UnixConn, ln *link, held []*Lease) (map[*Lease]string, error) {
	stop := context.AfterFunc(ctx, func() { _ = nc.SetDeadline(time.Unix(1, 0)) }) // it only wakes the read; on a closed connection the read fails anyway
	defer stop()
	lost := map[*Lease]string{}
	var b []byte
	ask := func(id uint32, m kvwire.Reattach) (string, error) {
		var err error
		if b, err = kvwire.AppendReattach(b[:0], id, m); err != nil {
			return "", err
		}
		if _, err := nc.Write(b); err != nil {
			return "", fmt.Errorf("%w: %w", kv.ErrOwnerGone, err)
		}
		h, p, err := ln.next(r.m, true)
		if err != nil {
			return "", fmt.Errorf("%w: %w", kv.ErrOwnerGone, err)
		}
		if h.Type != kvwire.TypeReattached || h.ID != id {
			return "", replyErr(h, p, kvwire.TypeReattached)
		}
		pr := kvwire.NewParser(h.Type, p)
		status, why := pr.U32(), pr.Text()
		if err := pr.Done(); err != nil {
			return "", err
		}
		if status != kvwire.ReattachKept {
			return why, nil
		}
		return "", nil
	}
	for i, l := range held {
		why, err := ask(uint32(i+1), kvwire.Reattach{Lease: l.id, Write: l.write, Pages: l.pages, Hashes: l.hashes})
		if err != nil {
			return nil, err
		}
		if why != "" {
			lost[l] = why
		}
	}
	if _, err := ask(uint32(len(held)+1), kvwire.Reattach{}); err != nil {
		return nil, err
	}
	return lost, nil
}

// install makes nc the replica's connection, attached, on a client of its own;
// kv.ErrClosed (nc to be closed by the caller) if Close came first.
func (r *Replica) install(nc *net.UnixConn, ln *link, owner *peercred.Process, lost map[*Lease]string) error {
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.closed {
		return kv.ErrClosed
	}
	stopW := make(chan struct{})
	for l, why := range lost {
		l.lost.Store(&why)
		delete(r.leases, l.id)
		r.log.Warn("kv: a lease was lost in the owner's restart", "lease", l.String(), "why", why)
	}
	r.nc, r.w, r.ln, r.owner, r.stopW = nc, session.NewWriter(nc, 0), ln, owner, stopW
	r.cl = r.newClient(nc, ln, r.w)
	r.cl.Start()
	r.err = nil
	r.done = make(chan struct{})
	r.reattaches++
	close(r.attached)
	go r.watch(nc, owner, stopW)
	return nil
}
