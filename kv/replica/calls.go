package replica

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"github.com/cudapool/cudapool/export"
	"net"
	"slices"
	"time"

	"github.com/cudapool/cudapool/cudart"
	"github.com/cudapool/cudapool/internal/session"
	"github.com/cudapool/cudapool/kv"
	"github.com/cudapool/cudapool/kv/internal/kvwire"
)

// abandonTimeout bounds the release of a lease whose caller gave up before its reply.
const abandonTimeout = 30 * time.Second

// gone is the error of a request made once the replica stopped.
func (r *Replica) gone() error {
	r.mu.Lock()
	defer r.mu.Unlock()
	return r.err
}

// A replyHandler acts on a call's reply (roundTrip). claimed is false once the
// call's caller gave up on it (its ctx ended, abandon): the handler then touches
// nothing of the caller's and does only what the replica itself must, such as no
// longer holding a lease the reply ended; a lease the reply grants is given back.
type replyHandler func(h kvwire.Header, p []byte, claimed bool) error

// roundTrip sends the request build makes under a fresh id and has its reply handled
// by handle. The caller that sent a request reads replies itself while no other
// caller does (one reading role), handling the others' replies for them, so that a
// reply usually wakes the goroutine that waits for it directly. handle runs on the
// reading goroutine, with the role held, while the payload is valid; it must not
// block. What it records (a lease held, or ended) is so recorded before the role is
// free again, which a reconnection takes before it lists the leases held.
func (r *Replica) roundTrip(ctx context.Context, build func(b []byte, id uint32) ([]byte, error), handle replyHandler) error {
	id := r.nextID.Add(1)
	if id == 0 {
		id = r.nextID.Add(1)
	}
	c := &call{id: id, handle: handle, done: make(chan struct{})}
	r.mu.Lock()
	if err := r.err; err != nil {
		r.mu.Unlock()
		return err
	}
	r.calls[id] = c
	w, nc := r.w, r.nc // the connection the call is made on
	r.mu.Unlock()

	err := w.Write(ctx, func(b []byte) ([]byte, error) { return build(b, id) })
	if errors.Is(err, session.ErrBroken) {
		r.failConn(nc, err) // a frame cut short: the owner cannot read on
	}
	if err != nil {
		if !r.settle(c) {
			return c.err // failConn completed it first
		}
		if gone := r.gone(); gone != nil {
			return gone
		}
		return err
	}

	err = r.wait(ctx, c)
	if errors.Is(err, errGaveUp) {
		if !r.abandon(c) {
			<-c.done // its reply came as ctx ended, and was handled: what it grants is the caller's
			return c.err
		}
		// Someone must still read the answer, which may grant a lease or end one: a
		// waiter of its own does, and a lease granted is given back.
		go func() {
			bg, cancel := context.WithTimeout(context.Background(), abandonTimeout)
			defer cancel()
			if errors.Is(r.wait(bg, c), errGaveUp) {
				r.settle(c) // a reply that comes later is given back as unclaimed
			}
		}()
		return ctx.Err()
	}
	return err
}

// take removes call id from the calls waiting and returns it; nil if another took it
// first. The one that takes a call decides how it ends (see call): it completes it,
// or, if it is the call's own caller, ends its wait without a reply.
func (r *Replica) take(id uint32) *call {
	r.mu.Lock()
	defer r.mu.Unlock()
	c := r.calls[id]
	delete(r.calls, id)
	return c
}

// settle ends c's caller's wait for good: it takes c and says so (true: no reply or
// failure will come to it), or else waits until the one that took c first has
// completed it (false), which that one does without blocking.
func (r *Replica) settle(c *call) (taken bool) {
	if r.take(c.id) != nil {
		return true
	}
	<-c.done
	return false
}

// abandon makes c's reply, if it is still to come, be handled unclaimed (see
// replyHandler): c's caller gave up. False if c was taken already.
func (r *Replica) abandon(c *call) bool {
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.calls[c.id] != c {
		return false
	}
	c.abandoned = true
	return true
}

// complete ends c, taken from the calls waiting, with err (its reply's handling, or
// the failure of its connection), and wakes its caller.
func (c *call) complete(err error) {
	c.err = err
	close(c.done)
}

// errGaveUp says that wait's ctx ended before the answer came; the call is still
// registered, for another wait to take over.
var errGaveUp = errors.New("kv/replica: gave up waiting")

// wait waits until call c is completed and returns how: it reads replies itself while
// no other caller does, handling the others'. If ctx ends first it returns errGaveUp,
// leaving the call registered; if the replica stops, its error.
func (r *Replica) wait(ctx context.Context, c *call) error {
	done := r.Done()
	for {
		select {
		case <-c.done:
			return c.err
		case r.role <- struct{}{}:
			err := r.readFor(ctx, c)
			<-r.role
			select {
			case <-c.done:
				return c.err
			default:
			}
			if err != nil && ctx.Err() == nil {
				if r.settle(c) {
					return err
				}
				return c.err
			}
		case <-ctx.Done():
		case <-done:
		}
		if gone := r.gone(); gone != nil {
			if r.settle(c) {
				return gone
			}
			// The answer came meanwhile: it was handled, so nothing it grants is lost.
			return c.err
		}
		if ctx.Err() != nil {
			return errGaveUp
		}
	}
}

// readFor reads replies, with the reading role held, handling each for its call,
// until c is completed, ctx ends or the connection fails.
func (r *Replica) readFor(ctx context.Context, c *call) error {
	select {
	case <-c.done: // completed while this caller waited for the role
		return nil
	default:
	}
	id := c.id
	nc := r.nc // the present connection: it changes only while no one holds the role
	if ctx.Done() != nil {
		r.dlMu.Lock()
		r.dlBy = id
		r.dlMu.Unlock()
		stop := context.AfterFunc(ctx, func() {
			r.dlMu.Lock()
			if r.dlBy == id {
				_ = nc.SetReadDeadline(time.Unix(1, 0)) // it only wakes the read; on a closed connection the read fails anyway
			}
			r.dlMu.Unlock()
		})
		defer func() {
			stop()
			r.dlMu.Lock()
			r.dlBy = 0
			_ = nc.SetReadDeadline(time.Time{}) // it fails only on a closed connection, which the next read or write reports
			r.dlMu.Unlock()
		}()
	}
	for {
		h, p, err := r.ln.next(r.m)
		if err != nil {
			var ne net.Error
			if errors.As(err, &ne) && ne.Timeout() && r.gone() == nil {
				if ctx.Err() != nil {
					return ctx.Err()
				}
				// A stale cut meant for an earlier reader. Clearing it fails only on a
				// closed connection, which the next read reports.
				_ = nc.SetReadDeadline(time.Time{})
				continue
			}
			r.failConn(nc, err)
			if gone := r.gone(); gone != nil {
				return gone
			}
			return fmt.Errorf("%w: %w", kv.ErrOwnerGone, err)
		}
		if r.readHook != nil {
			r.readHook(h)
		}
		r.deliver(h, p)
		select {
		case <-c.done:
			return nil
		default:
		}
	}
}

// deliver hands a reply to its call's handle and completes the call; a reply nobody
// waits for any more (its call failed with its connection, or its caller gave up)
// releases the lease it grants.
func (r *Replica) deliver(h kvwire.Header, p []byte) {
	if c := r.take(h.ID); c != nil {
		if c.abandoned {
			r.releaseUnclaimed(h, p)
		}
		c.complete(c.handle(h, p, !c.abandoned))
		return
	}
	r.releaseUnclaimed(h, p)
}

// replied runs the test's hook (export_test.go) as a method has its reply.
func (r *Replica) replied() {
	if r.replyHook != nil {
		r.replyHook()
	}
}

// releaseUnclaimed handles an answer whose caller gave up: a lease it grants is released.
func (r *Replica) releaseUnclaimed(h kvwire.Header, p []byte) {
	if h.Type == kvwire.TypeLeased || h.Type == kvwire.TypeMatched {
		if m, err := kvwire.DecodeLease(h.Type, p, nil); err == nil && m.ID != 0 {
			go r.releaseAbandoned(m.ID)
		}
	}
}

// releaseAbandoned releases a lease whose caller gave up before its reply: nothing was
// queued on its pages, so the release waits for no point.
func (r *Replica) releaseAbandoned(id uint64) {
	ctx, cancel := context.WithTimeout(context.Background(), abandonTimeout)
	defer cancel()
	if err := r.releaseIDs(ctx, kvwire.Now, []uint64{id}, nil); err != nil && r.gone() == nil {
		r.log.Warn("kv: releasing a lease whose caller gave up", "lease", id, "err", err)
	}
}

// giveBackBreach returns err, the failure of a call that may have parsed a lease the
// owner granted against the protocol (too many pages, a page past the slab): such a
// lease, which the caller never sees, is released before it returns, so that the owner
// holds nothing for it.
func (r *Replica) giveBackBreach(ctx context.Context, l *Lease, err error) error {
	if l.id == 0 || !errors.Is(err, export.ErrProtocol) {
		return err
	}
	return errors.Join(err, r.releaseIDs(ctx, kvwire.Now, []uint64{l.id}, nil))
}

// replyErr is the error of a reply that is not of type want.
func replyErr(h kvwire.Header, p []byte, want kvwire.Type) error {
	if h.Type == kvwire.TypeError {
		return kvwire.ParseError(h.Type, p)
	}
	return fmt.Errorf("%w: the owner answered with %s, not %s", kvwire.ErrMalformed, h.Type, want)
}

// Alloc leases n free pages for writing, evicting the least recently used sealed pages
// nobody reads where it must. It leases all n or none ([kv.ErrNoSpace]). Where pages
// still settle (released, their release events not yet complete) and would make up
// the difference, the owner waits for them (up to owner.AllocWait), and so does
// Alloc, until ctx ends.
func (r *Replica) Alloc(ctx context.Context, n int) (*Lease, error) {
	if n > kv.MaxBatch {
		return nil, fmt.Errorf("%w: %d pages, at most %d", kv.ErrTooLarge, n, kv.MaxBatch)
	}
	if n < 1 || n > r.geo.Pages {
		return nil, fmt.Errorf("%w: %d pages asked, the slab has %d at most", kv.ErrGeometry, n, r.geo.Pages)
	}
	l := &Lease{write: true}
	err := r.roundTrip(ctx,
		func(b []byte, id uint32) ([]byte, error) { return kvwire.AppendU32(b, kvwire.TypeAlloc, id, uint32(n)) },
		func(h kvwire.Header, p []byte, claimed bool) error {
			if !claimed {
				return nil
			}
			if err := l.parse(h, p, kvwire.TypeLeased, make([]uint32, 0, n), n, r.mappedPages()); err != nil {
				return err
			}
			r.track(l)
			return nil
		})
	if err != nil {
		return nil, r.giveBackBreach(ctx, l, err)
	}
	r.replied()
	return l, nil
}

// parse fills l from a Leased or Matched reply to a request of asked pages (a Leased
// one has all of them) on a slab of slabPages.
func (l *Lease) parse(h kvwire.Header, p []byte, want kvwire.Type, pages []uint32, asked, slabPages int) error {
	if h.Type != want {
		return replyErr(h, p, want)
	}
	m, err := kvwire.DecodeLease(h.Type, p, pages)
	if err != nil {
		return err
	}
	l.id, l.pages = m.ID, m.Pages
	if (l.id == 0) != (len(l.pages) == 0) {
		return fmt.Errorf("%w: %w: lease %d of %d pages", export.ErrProtocol, kvwire.ErrMalformed, l.id, len(l.pages))
	}
	if len(l.pages) > asked || (want == kvwire.TypeLeased && len(l.pages) != asked) {
		return fmt.Errorf("%w: %w: %s of %d pages for a request of %d", export.ErrProtocol, kvwire.ErrMalformed, want, len(l.pages), asked)
	}
	for i, pg := range l.pages {
		if int64(pg) >= int64(slabPages) {
			return fmt.Errorf("%w: %w: %s page %d is %d, past the slab's %d pages mapped", export.ErrProtocol, kvwire.ErrMalformed, want, i, pg, slabPages)
		}
	}
	return nil
}

// Seal ends write lease l: its first len(hashes) pages become visible under hashes
// once the work queued on s before the call (their writes) has completed, and the
// rest are freed then. A hash visible already makes its page a duplicate, freed.
// Without [WaitVisible] it returns at once, with the pages still pending counted; with
// it, once they are visible. At most [kv.MaxBatch] hashes.
func (r *Replica) Seal(ctx context.Context, l *Lease, hashes []kv.Hash, s cudart.Stream, opts ...SealOption) (SealResult, error) {
	var so sealOptions
	for _, o := range opts {
		if o != nil {
			o(&so)
		}
	}
	switch {
	case len(hashes) > kv.MaxBatch:
		return SealResult{}, fmt.Errorf("%w: %d hashes, at most %d", kv.ErrTooLarge, len(hashes), kv.MaxBatch)
	case l == nil || !l.write:
		return SealResult{}, fmt.Errorf("%w: only a write lease is sealed", kv.ErrStaleLease)
	case len(hashes) > len(l.pages):
		return SealResult{}, fmt.Errorf("%w: %d hashes for a lease of %d pages", kv.ErrGeometry, len(hashes), len(l.pages))
	}
	if err := l.Lost(); err != nil {
		return SealResult{}, err
	}
	if err := r.gone(); err != nil {
		return SealResult{}, err // no record while the owner is gone: a reconnection waits for the last one
	}
	at, err := r.point(ctx, s)
	if err != nil {
		return SealResult{}, err
	}
	var res SealResult
	err = r.roundTrip(ctx,
		func(b []byte, id uint32) ([]byte, error) {
			return kvwire.AppendSeal(b, id, so.wait, l.id, at, hashes)
		},
		func(h kvwire.Header, p []byte, claimed bool) error {
			if h.Type != kvwire.TypeSealed {
				err := replyErr(h, p, kvwire.TypeSealed)
				if errors.Is(err, kv.ErrStaleLease) {
					r.untrack(l) // the owner holds it no more
				}
				return err
			}
			m, err := kvwire.DecodeSealed(p)
			if err != nil {
				return err
			}
			r.untrack(l)
			if claimed {
				res = SealResult{Visible: int(m.Visible), Duplicates: int(m.Duplicates), Pending: int(m.Pending)}
			}
			return nil
		})
	r.replied()
	return res, err
}

// Match leases for reading the longest run of hashes, from the first, that is visible
// on the replica's device (copied there from another device's slab where only that
// one has them). A [Lease] with no pages means none was visible; the owner holds nothing
// for it. Match takes no stream: it queues nothing, since the pages' writes have
// completed before the owner made them visible; the stream the caller reads on is the
// one it gives Release.
func (r *Replica) Match(ctx context.Context, hashes []kv.Hash) (*Lease, error) {
	if len(hashes) > kv.MaxBatch {
		return nil, fmt.Errorf("%w: %d hashes, at most %d", kv.ErrTooLarge, len(hashes), kv.MaxBatch)
	}
	l := &Lease{}
	if len(hashes) == 0 {
		return l, nil
	}
	err := r.roundTrip(ctx,
		func(b []byte, id uint32) ([]byte, error) { return kvwire.AppendMatch(b, id, hashes) },
		func(h kvwire.Header, p []byte, claimed bool) error {
			if !claimed {
				return nil
			}
			if err := l.parse(h, p, kvwire.TypeMatched, make([]uint32, 0, len(hashes)), len(hashes), r.mappedPages()); err != nil {
				return err
			}
			if r.opts.reconnect && l.id != 0 {
				l.hashes = slices.Clone(hashes[:len(l.pages)])
			}
			r.track(l)
			return nil
		})
	if err != nil {
		return nil, r.giveBackBreach(ctx, l, err)
	}
	r.replied()
	return l, nil
}

// Release ends lease l once the work queued on s before the call has completed, as
// [Replica.ReleaseAll] does for several.
func (r *Replica) Release(ctx context.Context, l *Lease, s cudart.Stream) error {
	return r.ReleaseAll(ctx, []*Lease{l}, s)
}

// ReleaseAll ends leases ls once the work queued on s before the call has completed:
// their pages are not reused (nor, for read leases, evicted) before. A lease with no
// pages (or nil) is skipped. At most [kv.MaxBatch] leases. On success the replica
// holds none of them. If the owner holds one of them no more for this replica
// (released already, another replica's), it fails with [kv.ErrStaleLease] and ends
// none. A lease lost in an owner's restart ([WithReconnect]) is skipped: the others
// are released, and the error wraps [kv.ErrLeaseLost]. If the owner is gone
// ([kv.ErrOwnerGone]) the leases are still held; with [WithReconnect] they are
// re-declared to the restarted owner, which holds their pages until they are
// released: call ReleaseAll again once attached ([Replica.WaitAttached]), or
// [Replica.Close]. If ctx ends first it returns ctx's error; the leases are then
// ended or not, as the owner got the request or not, and naming them again fails
// with [kv.ErrStaleLease] where it had.
func (r *Replica) ReleaseAll(ctx context.Context, ls []*Lease, s cudart.Stream) error {
	ids := make([]uint64, 0, len(ls))
	var lost []error
	for _, l := range ls {
		if l != nil && l.id != 0 {
			if err := l.Lost(); err != nil {
				lost = append(lost, err)
				continue
			}
			ids = append(ids, l.id)
		}
	}
	if len(ids) == 0 {
		return errors.Join(lost...)
	}
	if len(ids) > kv.MaxBatch {
		return fmt.Errorf("%w: %d leases, at most %d", kv.ErrTooLarge, len(ids), kv.MaxBatch)
	}
	if err := r.gone(); err != nil {
		return err // no record while the owner is gone: a reconnection waits for the last one
	}
	at, err := r.point(ctx, s)
	if err != nil {
		return err
	}
	if err := r.releaseIDs(ctx, at, ids, ls); err != nil {
		return err
	}
	r.replied()
	return errors.Join(lost...)
}

// releaseIDs releases the leases ids after at; once the owner has, the replica holds
// ended no more.
func (r *Replica) releaseIDs(ctx context.Context, at kvwire.Point, ids []uint64, ended []*Lease) error {
	return r.roundTrip(ctx,
		func(b []byte, id uint32) ([]byte, error) { return kvwire.AppendRelease(b, id, at, ids) },
		func(h kvwire.Header, p []byte, _ bool) error {
			if h.Type != kvwire.TypeReleased {
				return replyErr(h, p, kvwire.TypeReleased)
			}
			if _, err := kvwire.DecodeReleased(p); err != nil {
				return err
			}
			r.untrack(ended...)
			return nil
		})
}

// Stats asks the owner for its Stats.
func (r *Replica) Stats(ctx context.Context) (kv.Stats, error) {
	var st kv.Stats
	err := r.roundTrip(ctx,
		func(b []byte, id uint32) ([]byte, error) { return kvwire.AppendEmpty(b, kvwire.TypeStats, id) },
		func(h kvwire.Header, p []byte, claimed bool) error {
			if h.Type != kvwire.TypeStatsReply {
				return replyErr(h, p, kvwire.TypeStatsReply)
			}
			if !claimed {
				return nil
			}
			return json.Unmarshal(p, &st)
		})
	return st, err
}
