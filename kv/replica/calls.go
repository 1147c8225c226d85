package replica

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"github.com/cudapool/cudapool/export"
	"math"
	"net"
	"slices"

	"github.com/cudapool/cudapool/cudart"
	"github.com/cudapool/cudapool/internal/session"
	"github.com/cudapool/cudapool/kv"
	"github.com/cudapool/cudapool/kv/internal/kvwire"
)

// abandonTimeout bounds the release of a lease whose caller gave up before its reply.
const abandonTimeout = session.AbandonTimeout

// gone is the error of a request made once the replica stopped.
func (r *Replica) gone() error {
	r.mu.Lock()
	defer r.mu.Unlock()
	return r.err
}

// reply is a reply frame: its header, and its payload, valid while it is handled.
type reply struct {
	kvwire.Header
	p []byte
}

// A replyHandler acts on a call's reply (roundTrip). claimed is false once the
// call's caller gave up on it (its ctx ended): the handler then touches nothing of
// the caller's and does only what the replica itself must, such as no longer holding
// a lease the reply ended, or giving back (releaseUnclaimed) a lease it grants.
type replyHandler = func(h reply, claimed bool) error

// roundTrip sends the request build makes under a fresh id and has its reply handled
// by handle, on the present connection's [session.Client]: the caller that sent a
// request reads replies itself while no other caller does, handling the others'
// replies for them, so that a reply usually wakes the goroutine that waits for it
// directly. handle runs on the reading goroutine, with the role held, while the
// payload is valid; it must not block. What it records (a lease held, or ended) is so
// recorded before the role is free again, which a reconnection takes before it lists
// the leases held.
func (r *Replica) roundTrip(ctx context.Context, build func(b []byte, id uint64) ([]byte, error), handle replyHandler) error {
	r.mu.Lock()
	err, cl := r.err, r.cl
	r.mu.Unlock()
	if err != nil {
		return err
	}
	return cl.Call(ctx, build, session.HandlerFunc[reply](handle))
}

// newClient is the request client on connection nc, whose frames ln reads. The
// watcher reads what arrives while no caller does (session.WatchArrivals): the owner's
// Grow and Shrink frames come unasked, and an idle replica maps a growth as it comes.
func (r *Replica) newClient(nc *net.UnixConn, ln *link, w *session.Writer) *session.Client[reply] {
	return session.NewClient[reply](nc, &frames{r: r, ln: ln}, session.Protocol[reply]{
		ReplyTo: func(f reply) (uint64, bool) { return uint64(f.ID), true },
		Push:    func(f reply) error { r.releaseUnclaimed(f); return nil },
		Writer:  w,
		Gone: func(why error) error {
			if err := r.gone(); errors.Is(err, kv.ErrClosed) {
				return err
			}
			return fmt.Errorf("%w: %w", kv.ErrOwnerGone, why)
		},
		Down:  func(why error) { r.failConn(nc, why) },
		Watch: session.WatchArrivals,
		MaxID: math.MaxUint32,
	})
}

// frames reads the page protocol's frames for a [session.Client], mapping the
// slab's growths (and unmapping what a Shrink gives back) as they come.
type frames struct {
	r  *Replica
	ln *link
}

// Next reads the next frame that is neither a Grow nor a Shrink, waiting for it or not
// ([session.ErrNoFrame]).
func (f *frames) Next(wait bool) (reply, error) {
	h, p, err := f.ln.next(f.r.m, wait)
	if err != nil {
		return reply{}, err
	}
	if f.r.readHook != nil {
		f.r.readHook(h)
	}
	return reply{h, p}, nil
}

// Buffered reports whether a whole frame is buffered.
func (f *frames) Buffered() bool { return f.ln.rd.Whole() }

// replied runs the test's hook (export_test.go) as a method has its reply.
func (r *Replica) replied() {
	if r.replyHook != nil {
		r.replyHook()
	}
}

// releaseUnclaimed handles an answer whose caller gave up: a lease it grants is released.
func (r *Replica) releaseUnclaimed(h reply) {
	if h.Type == kvwire.TypeLeased || h.Type == kvwire.TypeMatched {
		if m, err := kvwire.DecodeLease(h.Type, h.p, nil); err == nil && m.ID != 0 {
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
		func(b []byte, id uint64) ([]byte, error) {
			return kvwire.AppendU32(b, kvwire.TypeAlloc, uint32(id), uint32(n))
		},
		func(h reply, claimed bool) error {
			if !claimed {
				r.releaseUnclaimed(h)
				return nil
			}
			if err := l.parse(h.Header, h.p, kvwire.TypeLeased, make([]uint32, 0, n), n, r.mappedPages()); err != nil {
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
		func(b []byte, id uint64) ([]byte, error) {
			return kvwire.AppendSeal(b, uint32(id), so.wait, l.id, at, hashes)
		},
		func(h reply, claimed bool) error {
			if h.Type != kvwire.TypeSealed {
				err := replyErr(h.Header, h.p, kvwire.TypeSealed)
				if errors.Is(err, kv.ErrStaleLease) {
					r.untrack(l) // the owner holds it no more
				}
				return err
			}
			m, err := kvwire.DecodeSealed(h.p)
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
		func(b []byte, id uint64) ([]byte, error) { return kvwire.AppendMatch(b, uint32(id), hashes) },
		func(h reply, claimed bool) error {
			if !claimed {
				r.releaseUnclaimed(h)
				return nil
			}
			if err := l.parse(h.Header, h.p, kvwire.TypeMatched, make([]uint32, 0, len(hashes)), len(hashes), r.mappedPages()); err != nil {
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
		func(b []byte, id uint64) ([]byte, error) { return kvwire.AppendRelease(b, uint32(id), at, ids) },
		func(h reply, _ bool) error {
			if h.Type != kvwire.TypeReleased {
				return replyErr(h.Header, h.p, kvwire.TypeReleased)
			}
			if _, err := kvwire.DecodeReleased(h.p); err != nil {
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
		func(b []byte, id uint64) ([]byte, error) { return kvwire.AppendEmpty(b, kvwire.TypeStats, uint32(id)) },
		func(h reply, claimed bool) error {
			if h.Type != kvwire.TypeStatsReply {
				return replyErr(h.Header, h.p, kvwire.TypeStatsReply)
			}
			if !claimed {
				return nil
			}
			return json.Unmarshal(h.p, &st)
		})
	return st, err
}
