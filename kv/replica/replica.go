// Package replica owns a replica's side of a KV page pool: the connection to the owner
// (package kv/owner, cmd/kvpoold), its device's slab mapped on the VMM route (one range
// of addresses per tensor, chunks mapped in place as the owner grows the slab), and the
// leases of pages by index.
//
//	r, err := replica.Dial(ctx, dir, rt, device, replica.WaitForOwner())
//	hashes := r.Hashes(tokens)
//	l, err := r.Match(ctx, hashes)    // the longest visible run, leased for reading
//	k, v := r.Layer(0)                   // layer 0's K and V tensors, [pages, tokens, heads, dim]
//	// ... read pages l.Pages() of every layer on s ...
//	w, err := r.Alloc(ctx, n)            // pages to write the rest into
//	// ... write w.Pages() on s ...
//	res, err := r.Seal(ctx, w, hashes[len(l.Pages()):], s)
//	err = r.Release(ctx, l, s)           // pages are reused only after s's work so far
//
// Seal and Release queue a point on the stream they are given (cudart.StreamNotify: a
// write to an eventfd of the stream's own, passed to the owner once per connection,
// once the work queued before it has completed), and the owner reads the eventfd on
// the host: the host of the replica never waits for the GPU, and a Match needs no
// stream wait, as the owner exposes only pages whose writes it has seen complete.
// Layer l's K tensor starts at the first address Layer(l) returns, and page p of it
// Geometry().PageBytes() * p further on (Addr(l, kv.K, p)); each tensor is one range of
// addresses whatever the slab's size (see package kv).
package replica

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"os"
	"path/filepath"
	"sync"
	"sync/atomic"
	"time"

	"github.com/cudapool/cudapool/cudart"
	"github.com/cudapool/cudapool/internal/peercred"
	"github.com/cudapool/cudapool/internal/session"
	"github.com/cudapool/cudapool/kv"
	"github.com/cudapool/cudapool/kv/internal/kvwire"
	"github.com/cudapool/cudapool/kv/internal/slabmap"
)

// Option configures [Dial].
type Option func(*options)

type options struct {
	ns        string
	wait      bool
	reconnect bool
	log       *slog.Logger
}

// WithNamespace sets the namespace of the replica's prefix hashes (Hashes). It is no
// boundary: every replica maps the whole slab read-write, whatever its namespace; one
// owner directory per trust domain is (package kv, Trust). A namespace other than ""
// is printable (no control or bidirectional character) and at most 256 bytes; the
// owner refuses another with [kv.ErrRefused].
func WithNamespace(ns string) Option { return func(o *options) { o.ns = ns } }

// WaitForOwner makes [Dial] wait, until its ctx ends, for an owner to serve the
// directory, dialing again with backoff from 5 ms up to 500 ms.
func WaitForOwner() Option { return func(o *options) { o.wait = true } }

// WithLogger sets where events no call returns are logged. The default logs nothing
// (as producer and consumer do).
func WithLogger(l *slog.Logger) Option { return func(o *options) { o.log = l } }

// SealOption configures Seal.
type SealOption func(*sealOptions)

type sealOptions struct{ wait bool }

// WaitVisible makes Seal return only once the pages are visible (the writes queued on
// its stream before it have completed), or with an error.
func WaitVisible() SealOption { return func(o *sealOptions) { o.wait = true } }

// SealResult says what became of a seal's pages: Visible are readable under their
// hashes, Duplicates had a hash visible already (their pages are freed), and Pending
// wait for the stream's work to complete (then they become visible, or duplicates).
type SealResult struct{ Visible, Duplicates, Pending int }

// Lease is a hold on pages of the replica's slab: a write lease (Alloc) or a read lease
// (Match). A Match that found nothing returns a Lease with no pages, which the owner
// does not hold.
type Lease struct {
	id     uint64
	pages  []uint32
	write  bool
	hashes []kv.Hash              // a read lease's, for its re-declaration after an owner's restart
	lost   atomic.Pointer[string] // why an owner's restart lost it; nil while held
}

// Pages are the leased pages' indices, in the order of the hashes (for a read lease).
// They are the [Lease]'s own: do not modify them.
func (l *Lease) Pages() []uint32 { return l.pages }

// ID is the owner's id of the lease; 0 for a lease with no pages.
func (l *Lease) ID() uint64 { return l.id }

// Lost is nil while the lease is held (or was ended by Seal or Release), and an error
// wrapping [kv.ErrLeaseLost] once an owner's restart lost it ([WithReconnect]): its pages
// may have been reused since, and Seal and Release of it fail with that error.
func (l *Lease) Lost() error {
	if why := l.lost.Load(); why != nil {
		return fmt.Errorf("%w: %s: %s", kv.ErrLeaseLost, l, *why)
	}
	return nil
}

// Writable says whether it is a write lease.
func (l *Lease) Writable() bool { return l.write }

func (l *Lease) String() string {
	kind := "read"
	if l.write {
		kind = "write"
	}
	return fmt.Sprintf("%s lease %d of %d pages", kind, l.id, len(l.pages))
}

// Replica is a process's connection to the owner of one directory, for pages of one
// device. Its methods are safe for concurrent use.
type Replica struct {
	rt     cudart.Runtime
	dev    int
	ns     string
	geo    kv.Geometry
	log    *slog.Logger
	dir    string
	slab   string // the slab's name
	opts   options
	layout kv.SlabLayout
	m      *slabmap.Map  // the slab, mapped
	stream cudart.Stream // the replica's own: the unmapping waits on it for every stream's work
	nc     *net.UnixConn
	owner  *peercred.Process // nil where the owner's process cannot be watched
	// keeperGone is closed once the keeper of the slab's chunks (the Welcome named
	// it) has hung up the replica's connection to it: no restarted owner serves this
	// slab any more.
	keeperGone chan struct{}
	stopKeeper func()    // closes the connection to the keeper (slab.go holdKeeper)
	host       *HostTier // the device's host tier, mapped (hosttier.go); nil: none

	w  *session.Writer        // every write bounded by its caller's ctx
	cl *session.Client[reply] // the requests on nc; nil until Dial has made it
	ln *link                  // nc's reading side
	// readHook, where a test set it (export_test.go), runs as the reader has read a
	// reply frame, before it hands the reply on: the seam where a test makes the
	// connection fail at an exact point.
	readHook func(h kvwire.Header)
	// replyHook, where a test set it, runs as Alloc, Seal, Match or Release has its
	// reply and has acted on it.
	replyHook func()

	mu    sync.Mutex
	err   error // why the replica stopped: ErrOwnerGone or ErrClosed
	done  chan struct{}
	stopW chan struct{} // stops the watcher
	// tornDown is closed once Close's teardown has completed.
	tornDown chan struct{}

	// Reconnecting (reconnect.go), guarded by mu.
	leases     map[uint64]*Lease // the leases held, to re-declare
	closing    chan struct{}     // closed by Close: a reconnection gives up
	closed     bool
	stranded   bool // no reconnection can help: the slab's keeper is gone, or one gave up
	reattaches uint64
	attached   chan struct{} // closed while attached; replaced when the owner is lost
	reconnWG   sync.WaitGroup

	evMu         sync.Mutex
	notifiers    map[cudart.Stream]*streamNotifier // notify.go
	retired      []*streamNotifier                 // of streams given to Forget: notified no more, waited on by Close
	lastNotifier uint32                            // the id of the latest eventfd registered
	openFDs      atomic.Int64                      // eventfds made and not closed
	evClosed     bool
}

// Dial connects to the owner serving dir, reserves the regions of the slab of device
// (kv.SlabLayout, for the slab's bound) and maps the chunks the owner's Welcome counts,
// whose descriptors follow it on the connection; later growths are mapped as they are
// read. It fails with an error wrapping [kv.ErrOwnerGone] if no owner serves dir
// ([WaitForOwner] waits for one), [kv.ErrGeometry] if the owner does not serve device,
// and the owner's reason if it refuses this process (kv.ErrRefused for another
// protocol version, naming both). A process may hold several Replicas of one owner,
// each mapping the slab at addresses of its own. On failure nothing is left behind.
func Dial(ctx context.Context, dir string, rt cudart.Runtime, device int, opts ...Option) (_ *Replica, err error) {
	o := options{log: slog.New(slog.DiscardHandler)}
	for _, opt := range opts {
		if opt != nil {
			opt(&o)
		}
	}
	r := &Replica{rt: rt, dev: device, ns: o.ns, log: o.log,
		done: make(chan struct{}), stopW: make(chan struct{}), tornDown: make(chan struct{}), notifiers: map[cudart.Stream]*streamNotifier{},
		dir: dir, opts: o, leases: map[uint64]*Lease{}, closing: make(chan struct{}), attached: make(chan struct{}), keeperGone: make(chan struct{}), stopKeeper: func() {}}
	close(r.attached)
	defer func() {
		if err != nil {
			if r.w != nil { // a Bye, so that the owner does not wait for this process's exit
				_ = r.w.Write(ctx, func(b []byte) ([]byte, error) { return kvwire.AppendEmpty(b, kvwire.TypeBye, 0) }) // best effort: an owner that misses it waits for this process's exit
			}
			_ = r.teardown(context.Background()) // cleanup: the first error is the one returned
		}
	}()
	if r.nc, err = dialPages(ctx, filepath.Join(dir, kvwire.PageSocket), o.wait); err != nil {
		return nil, err
	}
	r.w = session.NewWriter(r.nc, 0)
	r.ln = newLink(r.nc)
	welcome, err := r.hello(ctx, r.nc, r.ln)
	if err != nil {
		return nil, err
	}
	r.geo, r.slab = welcome.Geometry, welcome.Slab
	if r.layout, err = r.geo.SlabLayout(welcome.ChunkBytes); err != nil {
		return nil, fmt.Errorf("kv/replica: the owner's slab: %w", err)
	}
	if int64(welcome.Chunks) > int64(r.layout.Chunks()) {
		return nil, fmt.Errorf("%w: the owner maps %d chunks of a slab of %d", kvwire.ErrMalformed, welcome.Chunks, r.layout.Chunks())
	}
	if welcome.Keeper != 0 {
		if err := r.holdKeeper(ctx, int(welcome.Keeper)); err != nil {
			return nil, err
		}
	}
	if cred, err := peercred.Get(r.nc); err == nil {
		if r.owner, err = peercred.OpenProcess(cred.PID); err != nil {
			r.log.Debug("kv: cannot watch the owner's process; its connection tells", "pid", cred.PID, "err", err)
			r.owner = nil
		}
	}
	if r.host, err = dialHostTier(ctx, dir, device); err != nil {
		return nil, err
	}
	if r.stream, err = rt.StreamCreate(device, cudart.StreamNonBlocking); err != nil {
		return nil, err
	}
	if r.m, err = slabmap.New(rt, device, r.layout); err != nil {
		return nil, fmt.Errorf("kv/replica: %w", err)
	}
	if err := r.awaitChunks(ctx, int(welcome.Chunks)); err != nil {
		return nil, err
	}
	r.mu.Lock()
	r.cl = r.newClient(r.nc, r.ln, r.w)
	r.mu.Unlock()
	r.cl.Start()
	go r.watch(r.nc, r.owner, r.stopW)
	return r, nil
}

// awaitChunks maps the n chunks the Welcome counted, as their Grow frames come, until
// ctx ends.
func (r *Replica) awaitChunks(ctx context.Context, n int) error {
	if err := awaitOn(ctx, r.nc, func() error { return r.ln.await(r.m, n) }); err != nil {
		if ctx.Err() != nil {
			return fmt.Errorf("%w: the slab's chunks: %w", kv.ErrOwnerGone, ctx.Err())
		}
		return fmt.Errorf("kv/replica: the slab's chunks: %w", err)
	}
	return nil
}

// awaitOn runs read, which reads nc, cut short when ctx ends.
func awaitOn(ctx context.Context, nc *net.UnixConn, read func() error) error {
	stop := context.AfterFunc(ctx, func() { _ = nc.SetReadDeadline(time.Unix(1, 0)) }) // it only wakes the read; on a closed connection the read fails anyway
	defer stop()
	err := read()
	_ = nc.SetReadDeadline(time.Time{}) // it fails only on a closed connection, which the next read reports
	return err
}

// dialPages connects to the page socket, waiting for it if wait.
func dialPages(ctx context.Context, path string, wait bool) (*net.UnixConn, error) {
	nc, err := session.Dial(ctx, path, wait)
	switch {
	case err == nil:
		return nc, nil
	case wait && ctx.Err() != nil:
		return nil, fmt.Errorf("%w: waiting for an owner at %s: %w", kv.ErrOwnerGone, filepath.Dir(path), err)
	}
	return nil, fmt.Errorf("%w: no owner serves %s: %w", kv.ErrOwnerGone, filepath.Dir(path), err)
}

// hello is the handshake: it learns the geometry, the slab's name and its chunks.
func (r *Replica) hello(ctx context.Context, nc *net.UnixConn, ln *link) (kvwire.Welcome, error) {
	stop := context.AfterFunc(ctx, func() { _ = nc.SetDeadline(time.Unix(1, 0)) }) // it only wakes the read; on a closed connection the read fails anyway
	defer stop()
	b, err := kvwire.AppendHello(nil, 0, kvwire.Hello{Version: kvwire.Version, PID: uint32(os.Getpid()), Device: uint32(r.dev), Namespace: r.ns})
	if err != nil {
		return kvwire.Welcome{}, err
	}
	if _, err := nc.Write(b); err != nil {
		return kvwire.Welcome{}, fmt.Errorf("%w: %w", kv.ErrOwnerGone, err)
	}
	h, p, _, err := ln.frame(true)
	if err != nil {
		if ctx.Err() != nil {
			return kvwire.Welcome{}, fmt.Errorf("%w: the handshake: %w", kv.ErrOwnerGone, ctx.Err())
		}
		return kvwire.Welcome{}, fmt.Errorf("%w: the handshake: %w", kv.ErrOwnerGone, err)
	}
	switch h.Type {
	case kvwire.TypeWelcome:
		m, err := kvwire.DecodeWelcome(p)
		if err != nil {
			return kvwire.Welcome{}, err
		}
		if err := m.Geometry.Validate(); err != nil {
			return kvwire.Welcome{}, fmt.Errorf("kv/replica: the owner's geometry: %w", err)
		}
		return m, nil
	case kvwire.TypeRefused:
		// Its code says why: kv.ErrRefused (the policy, the version), kv.ErrGeometry
		// (the device), kv.ErrLimit.
		return kvwire.Welcome{}, kvwire.ParseError(h.Type, p)
	}
	return kvwire.Welcome{}, fmt.Errorf("%w: the owner answered Hello with %s", kvwire.ErrMalformed, h.Type)
}

// watch marks the owner of connection nc gone when its process (owner) exits, until
// stop closes.
func (r *Replica) watch(nc *net.UnixConn, owner *peercred.Process, stop chan struct{}) {
	exited := make(chan struct{})
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	if owner != nil {
		go func() {
			if owner.Wait(ctx) == nil {
				close(exited)
			}
		}()
	}
	select {
	case <-exited:
		r.failConn(nc, errors.New("its process exited"))
	case <-stop:
	}
}

// failConn marks the owner gone for why, once per connection, if nc is the present
// connection, and fails every call made on it. With WithReconnect, a reconnection
// starts (reconnect.go).
func (r *Replica) failConn(nc *net.UnixConn, why error) {
	r.mu.Lock()
	if r.err != nil || nc != r.nc {
		r.mu.Unlock()
		return
	}
	r.err = fmt.Errorf("%w: %w", kv.ErrOwnerGone, why)
	cl := r.cl
	close(r.done)
	r.reconnectLocked(cl)
	r.mu.Unlock()
	if cl != nil {
		cl.Fail(why) // its calls fail as r.err says
	} else {
		_ = nc.Close() // cleanup: the owner is gone already
	}
}

// Geometry is the slab's geometry.
func (r *Replica) Geometry() kv.Geometry { return r.geo }

// Device is the device the replica's slab is on.
func (r *Replica) Device() int { return r.dev }

// Layer is where layer's K and V tensors begin in this process, on the replica's
// device: each [Pages, TokensPerPage, KVHeads, HeadDim], contiguous, its first
// Mapped() pages mapped. layer must be in [0, Geometry().Layers).
func (r *Replica) Layer(layer int) (k, v cudart.DevicePtr) {
	return r.Addr(layer, kv.K, 0), r.Addr(layer, kv.V, 0)
}

// Addr is the address of page's block of layer's part in this process
// (Geometry().PageBytes() bytes). layer and page must be in range.
func (r *Replica) Addr(layer int, p kv.Part, page int) cudart.DevicePtr {
	return r.layout.Addr(r.m.Bases(), layer, p, page)
}

// Hashes is [kv.PrefixHashes] of tokens with the replica's namespace and page size.
func (r *Replica) Hashes(tokens []int32) []kv.Hash {
	return kv.PrefixHashes(r.ns, tokens, r.geo.TokensPerPage)
}

// Done is closed once the replica cannot make requests any more: the owner is gone
// (Err wraps [kv.ErrOwnerGone]) or Close was called ([kv.ErrClosed]). With [WithReconnect],
// a replica that reattaches to a restarted owner is attached again: Err is nil, and
// Done is a new channel, closed when that owner is gone (see WaitAttached).
func (r *Replica) Done() <-chan struct{} {
	r.mu.Lock()
	defer r.mu.Unlock()
	return r.done
}

// Err is nil while the replica works, and afterwards says why it stopped.
func (r *Replica) Err() error {
	r.mu.Lock()
	defer r.mu.Unlock()
	return r.err
}

// Close ends the replica: it tells the owner goodbye, the leases still held ending
// after the work queued so far on every stream the replica has sealed or released on
// (Bye carries a point queued after it), so that no page a kernel still writes goes
// to another replica; work on a stream never given to Seal or Release is not covered:
// release such leases first. Such a stream must not be destroyed before Close (the
// driver does not survive a record on a destroyed stream) unless given to
// [Replica.Forget] first. It then waits, until ctx ends, for the owner to close the
// connection (its releases have settled), and unmaps the slab after the work queued
// so far on those streams and disconnects from the slab's exporter. If ctx ends before
// the owner has closed the connection (a release still waits for a busy stream, or the
// owner does not read), Close gives up on it and returns. An eventfd that a stream
// may still write to is left open, to the process's exit.
// The slab is unmapped after the work queued on the streams the replica used; if ctx
// ends while that waits (a stream that does not run), Close returns an error wrapping
// ctx's, and the unmapping completes on its own once the work has run (bounded by 30 s
// more for what waits on the slab's exporter). With the owner gone Close still
// completes, and returns nil. A second Close returns [kv.ErrClosed].
func (r *Replica) Close(ctx context.Context) error {
	r.mu.Lock()
	if r.closed {
		r.mu.Unlock()
		return kv.ErrClosed
	}
	r.closed = true
	close(r.closing)
	r.mu.Unlock()
	r.reconnWG.Wait() // a reconnection gives up, or has installed its connection
	r.mu.Lock()
	alive := r.err == nil
	if alive {
		r.err = kv.ErrClosed
		close(r.done)
	}
	r.mu.Unlock()
	if alive {
		r.bye(ctx)
	}
	r.mu.Lock()
	r.err = kv.ErrClosed
	r.mu.Unlock()
	done := make(chan error, 1)
	go func() {
		defer close(r.tornDown)
		bg, cancel := context.WithTimeout(context.WithoutCancel(ctx), abandonTimeout)
		defer cancel()
		done <- r.teardown(bg)
	}()
	select {
	case err := <-done:
		return err
	case <-ctx.Done():
		return fmt.Errorf("kv/replica: close: the slab's unmapping waits for the streams' work, and completes once it has run: %w", ctx.Err())
	}
}

// bye sends Bye and reads, with the reading role, until the owner closes the
// connection or ctx ends; it says whether the owner closed it (or is gone).
func (r *Replica) bye(ctx context.Context) (ownerDone bool) {
	final := kvwire.Bye{Final: true}
	if at, err := r.finalPoint(ctx); err == nil {
		final.Point = at
	} else {
		final.Final = false
		r.log.Warn("kv: queueing the final point of Close; the leases still held end at once", "err", err)
	}
	err := r.w.Write(ctx, func(b []byte) ([]byte, error) { return kvwire.Append(b, kvwire.TypeBye, 0, final) })
	if err != nil {
		return ctx.Err() == nil && !errors.Is(err, session.ErrBroken) // the owner hung up already
	}
	return r.cl.Drain(ctx) == nil
}

// Forget ends the replica's use of stream s, to be called before s is destroyed:
// the replica records s's event on s one last time (unless s's work has all
// completed) and never names s to the runtime again, so that [Replica.Close] still covers the work queued on s so far (through
// that record) without touching a destroyed stream, which the driver does not survive.
// A stream the replica never sealed or released on, or a closed replica, is left as it
// is and Forget returns nil. On failure (the record failed) s is forgotten all the
// same, and Close no longer covers its work: release the leases it writes first.
func (r *Replica) Forget(s cudart.Stream) error {
	r.evMu.Lock()
	defer r.evMu.Unlock()
	n, ok := r.notifiers[s]
	if !ok || r.evClosed || s == r.stream {
		return nil
	}
	delete(r.notifiers, s)
	r.retired = append(r.retired, n)
	if q, ok := r.rt.(cudart.StreamQuerier); ok {
		if done, err := q.StreamQuery(r.dev, s); err == nil && done {
			return nil // s's work has all completed, its event's last record included
		}
	}
	return r.rt.EventRecord(r.dev, n.ev, s)
}

// allNotifiers is every notifier the replica holds: of its streams and of those it
// forgot. r.evMu is held.
func (r *Replica) allNotifiers() []*streamNotifier {
	ns := make([]*streamNotifier, 0, len(r.notifiers)+len(r.retired))
	for _, n := range r.notifiers {
		ns = append(ns, n)
	}
	return append(ns, r.retired...)
}

// teardown undoes what Dial made, whatever it got to.
func (r *Replica) teardown(ctx context.Context) error {
	select {
	case <-r.stopW:
	default:
		close(r.stopW)
	}
	var errs []error
	r.mu.Lock()
	cl, nc := r.cl, r.nc
	r.mu.Unlock()
	switch {
	case cl != nil:
		cl.Fail(kv.ErrClosed)
		<-cl.ReaderDone()
	case nc != nil:
		_ = nc.Close() // cleanup: nothing is left to do if closing fails
	}
	r.evMu.Lock()
	r.evClosed = true
	events := r.allNotifiers()
	r.notifiers, r.retired = map[cudart.Stream]*streamNotifier{}, nil
	r.evMu.Unlock()
	mapped := false
	if r.m != nil {
		// The slab is unmapped once the last seal and release of every stream have
		// completed; if ctx ends first, it stays mapped, to the process's exit, and
		// the connection to its keeper stays held with it.
		if err := r.awaitEvents(ctx, events); err != nil {
			mapped = true
			errs = append(errs, fmt.Errorf("kv/replica: the slab stays mapped: its streams' work has not completed: %w", err))
		} else if err := r.m.Close(); err != nil {
			errs = append(errs, err)
		}
	}
	// A stream's wait on an event, and work queued on a stream, outlive their
	// destruction: nothing here waits for the GPU.
	errs = append(errs, r.endNotifiers(events)...)
	if r.stream != 0 {
		if err := r.rt.StreamDestroy(r.dev, r.stream); err != nil {
			errs = append(errs, err)
		}
	}
	if r.owner != nil {
		_ = r.owner.Close() // cleanup: nothing is left to do if closing fails
	}
	if !mapped {
		r.stopKeeper()
	}
	if err := r.host.unmap(); err != nil {
		errs = append(errs, err)
	}
	return errors.Join(errs...)
}
