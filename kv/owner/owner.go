// Package owner owns the owner of a KV page pool: one slab per GPU on the VMM route
// (chunks mapped into one range of addresses per tensor, [kv.SlabLayout], growing as
// pages are needed: growth.go), carved into pages of one [kv.Geometry], and the page
// server on dir/kv.sock that passes the chunks to replicas (package kv/replica), leases
// them the pages and keeps their states.
//
// # Pages
//
// Each slab's pages are its page table's (kv/internal/pages, one Table per device:
// the pages of both tiers, one LRU, the hash index, the leases), a pure state machine
// the owner drives under its lock: a request is one table operation, and what the
// operation returns (records for the index, copies into and out of the host tier) is
// done outside the lock (slab.go, hosttier.go). A page is free, writing (under a write
// lease), sealing (sealed, its writer's point not yet reached), sealed (visible, read by
// any number of read leases) or settling (to be freed once a release's point is
// reached). Alloc takes free pages first, then evicts the least recently used sealed
// pages that no reader holds and whose releases have settled; where that is not enough
// and settling pages would make up the rest, it waits for them (up to [AllocWait]) off
// the connection's goroutine, and answers NoSpace only when none is left to wait for.
// A replica that must read what it sealed holds it by a match first. A seal that
// continues the run of the connection's latest match (its first hash is the first one
// that match did not find) links its first page to that run's last, so that a chain
// grown by match and seal is evicted leaf first. A seal of a hash already visible frees
// its page (a duplicate). Every lease is journaled in the index before it is answered,
// and its end once its pages settled.
//
// # Notifiers
//
// A replica tells the owner that its stream's work has completed through an eventfd
// per stream (a notifier), sent once per connection in a Notifier frame (SCM_RIGHTS):
// at each seal and release it queues [cudart.Runtime.StreamNotify] on the stream (a host
// function in C that adds 1 to the eventfd once the work queued before it has
// completed) and names the notifier and the count its eventfd will then have reached
// (the point). Host functions run in stream order, so the eventfd's running total is
// the number of the stream's points that have completed. The owner reads each
// eventfd on a goroutine of its own through Go's netpoller (watch): while a seal is
// pending it sleeps, makes no driver call and spins nothing (the IPC event it waited
// for before spun a CPU in cudaEventSynchronize, docs/FACTS.md 24), and it makes the
// pages visible, and answers a Seal with the wait flag, as soon as the count arrives.
// A seal or release whose stream had completed its work names no notifier and settles
// at once. A release's pages are neither evicted nor reused until its point is reached.
//
// A replica's death cannot race this (it could race the event query that this
// replaced, N8): the count only ever reports work that completed, written by the
// replica's own stream, and no driver call of the owner's touches the dead process's
// objects. When the process has exited (its pidfd, as the connection watches it), its
// points will never be reached: its pending seals publish nothing and their pages go
// back to free, and its pending releases settle, its work on the GPU having ended with
// its context. A bogus notifier or a target never reached holds only the replica's own
// pages, and only until its process exits.
//
// # Connections
//
// The kernel names the process at the other end of each connection (SO_PEERCRED), and
// an [export.Policy] admits it (the zero Policy: this user's processes). A connection
// that ends without Bye keeps its leases until its process has exited (it may still
// read or write the pages), or until a new connection of that process releases or
// seals them (a replica the owner cut off, redialled); one that holds nothing ends at
// once, and so does one whose process cannot be watched.
// Bye ends the leases still held after the point it carries (a replica's Close
// queues one after its streams' work; at once if it carries none) and closes the
// connection once the replica's releases have settled. Every malformed frame closes the connection it came on, and only
// that one; so does a panic while serving it. The connections are served by
// internal/session, within [WithHandshakeTimeout], [WithHandshakeLimit] and
// [WithConnLimit], and what one holds within [WithMaxLeases], [WithMaxLeasedPages] and
// [WithMaxNotifiers].
//
// # Devices
//
// A match on device B of hashes visible only in device A's slab allocates pages on B,
// copies each page (every layer's K and V, one copy per tensor for a run of pages that
// follow each other in both slabs) with MemcpyDtoDAsync on a stream of device A, the
// source (a copy through the source's stream outlives that device's failures, FACTS
// 14), waits for it on the host (asking an event it records after the copies,
// without holding the source's copy lock, and no longer than until the owner closes),
// seals the pages in B's index and then answers.
//
// # Restarts
//
// [Keep] makes a keeper: the slabs and their exporter alone, in a process of their own.
// [Listen] given [WithKeeper] serves the pages of a keeper's slabs, journals the visible
// pages in [WithIndex]'s file, and, started again after its predecessor died, adopts the
// live keeper's slabs, makes the journaled pages visible again and takes back the
// leases that replicas re-declare (Reattach) before it answers any Alloc or Match
// ([WithReattachGrace]). The index journals each lease's grant, to the process it was
// granted to, until it ends: a restarted owner hands no page of such a lease to
// anyone else (a write lease's) nor evicts it (a read lease's) while that process
// lives, the grace over or not, unless the process gives it back (re-declares and
// releases it, ends its lists of leases without it, or exits). A lease is taken back
// only by the process it was granted to, within its connection's caps, and ends with
// that connection. [Recovery] says what it took back, and why not what it dropped. See
// restart.go, journal.go and docs/PROTOCOL.md.
//
// # Host tiers
//
// Given [WithHostBytes], each device also has a host tier (hosttier.go): pinned host
// memory, a memfd handed to every replica on dir/host.sock, that keeps the sealed pages
// the slab evicts. A spiller copies the least recently used pages there ahead of their
// eviction; a match that runs into the host tier gets its pages back into the slab in
// the same reply. LRU runs across both tiers, and a leased page leaves neither.
package owner

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"math"
	"net"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"github.com/dustin/go-humanize"

	"github.com/cudapool/cudapool/cudart"
	"github.com/cudapool/cudapool/export"
	"github.com/cudapool/cudapool/internal/session"
	"github.com/cudapool/cudapool/kv"
	"github.com/cudapool/cudapool/kv/internal/index"
	"github.com/cudapool/cudapool/kv/internal/keep"
	"github.com/cudapool/cudapool/kv/internal/kvwire"
	"github.com/cudapool/cudapool/kv/internal/pages"
)

// PageSocket is the page server's socket in the owner's directory: the pages, and the
// slabs' chunks.
const PageSocket = kvwire.PageSocket

// Stats is a snapshot of an owner.
type Stats = kv.Stats

// Option configures [Listen] and [Keep]. A nil Option is skipped.
type Option func(*options)

// options are what the Option values set; the zero value is every default. The fields keep
// the names of the settings they hold.
type options struct {
	Geometry       kv.Geometry // Listen's and Keep's argument
	Devices        []int
	ChunkBytes     uint64
	InitialPages   int
	Fabric         bool
	Policy         export.Policy
	Logger         *slog.Logger
	Keeper         bool
	StartKeeper    func(ctx context.Context) error
	Index          string
	ReattachGrace  time.Duration
	HostBytes      uint64
	Limits         session.Limits // WithHandshakeTimeout, WithHandshakeLimit, WithConnLimit
	MaxLeases      int
	MaxLeasedPages int
	MaxNotifiers   int
	MinFree        uint64 // WithMinFree (giveback.go)
}

// WithDevices sets the GPUs to serve, a slab on each; by default, and with none
// listed, device 0. A device the runtime does not have, or one listed twice, makes
// [Listen] fail with an error wrapping [kv.ErrGeometry].
func WithDevices(devices ...int) Option {
	devices = slices.Clone(devices) // the caller's slice may change after
	return func(o *options) { o.Devices = devices }
}

// WithChunkBytes sets the size of the chunks a slab maps ([kv.SlabLayout]): a multiple
// of the device's granularity (vmm.Granularity), else [Listen] fails with an error
// wrapping [kv.ErrGeometry]. The default (and 0) is [kv.DefaultChunkBytes].
func WithChunkBytes(n uint64) Option { return func(o *options) { o.ChunkBytes = n } }

// WithInitialPages sets how many pages each slab maps at its start: the fewest whole
// steps of chunks that hold n ([kv.SlabLayout.ChunksFor]), at most the geometry's
// Pages. The slab then grows, a step or more at a time, as an Alloc finds fewer free
// pages than it asks for, up to the geometry's Pages, before it evicts. The default
// (and n <= 0) is one page: one step, a chunk per tensor, where a page fits a chunk.
func WithInitialPages(n int) Option { return func(o *options) { o.InitialPages = n } }

// WithFabric makes the slabs' chunks exportable as FABRIC handles too (vmm.WithFabric),
// for replicas across the nodes of an NVLink fabric. Where the driver refuses them (no
// IMEX channel), [Listen] fails with an error wrapping vmm.ErrFabricNotPermitted. By
// default chunks are exported as POSIX descriptors alone.
func WithFabric() Option { return func(o *options) { o.Fabric = true } }

// WithPolicy sets which processes may connect, as export's Policy does; the default,
// the zero Policy, admits this user's processes.
func WithPolicy(p export.Policy) Option { return func(o *options) { o.Policy = p } }

// WithLogger sets where what no call returns goes: connections refused or closed for
// malformed frames, a handler's panic, cleanup that failed. The default (and nil)
// logs nothing, as producer and consumer do.
func WithLogger(l *slog.Logger) Option { return func(o *options) { o.Logger = l } }

// WithKeeper makes [Listen] give each chunk it makes to a keeper ([Keep], on
// dir/keep.sock) before any page in it is granted, and take the keeper's chunks back
// at its start: they outlive this owner, and the next one maps them again (chunks of
// another geometry or chunk size are dropped, the slab made anew, Recovery saying
// why). [Listen] calls start where no keeper is alive; with a nil start that fails
// instead. By default an owner's chunks die with it. [Keep] ignores it.
func WithKeeper(start func(ctx context.Context) error) Option {
	return func(o *options) { o.Keeper, o.StartKeeper = true, start }
}

// WithIndex sets the file the visible pages are journaled in; by default (and with
// "") no index is kept. A [Listen] finding one of the same slabs (their keeper,
// geometry and devices) makes its pages visible again; any other, or a corrupt one,
// is dropped, and [Recovery] says why. Something other than a regular file at path (a
// named pipe, a device, a directory, a link) makes [Listen] fail, saying what is there.
// The index is written off the owner's lock (journal.go): a Seal that waits for
// visibility is answered once its pages are in the index (a restart after it finds
// them), an Alloc once the pages it evicted are out of it, and WaitSpills returns
// once the host pages spilled are in it.
func WithIndex(path string) Option { return func(o *options) { o.Index = path } }

// WithReattachGrace bounds how long allocations wait, after a restart, for the
// replicas attached before to re-declare their leases; the default (and 0) is
// [DefaultReattachGrace].
func WithReattachGrace(d time.Duration) Option { return func(o *options) { o.ReattachGrace = d } }

// WithHostBytes gives each device a host tier of n bytes of pinned host memory
// (hosttier.go), rounded down to whole pages; by default (and with 0) there is none.
// A tier smaller than a page is refused with an error wrapping [kv.ErrGeometry]; tiers
// larger, over every device, than the host's available memory, with one wrapping
// [kv.ErrHostMemory].
func WithHostBytes(n uint64) Option { return func(o *options) { o.HostBytes = n } }

// WithHandshakeTimeout bounds how long a connection to the page socket (or the slab
// socket, or the host tier's) may take from its accept to its admission: past it, the
// owner closes it. The default (and d <= 0) is 10 s.
func WithHandshakeTimeout(d time.Duration) Option {
	return func(o *options) { o.Limits.HandshakeTimeout = d }
}

// WithHandshakeLimit caps the connections still in their handshake (connected, not yet
// admitted): total in all, perUID from any one user. One past a cap is closed at once,
// without a word, and logged, so that no local user can hold all the handshakes. The
// defaults are 1024 and 128; a value below 1 keeps the default.
func WithHandshakeLimit(total, perUID int) Option {
	return func(o *options) { o.Limits.Handshakes, o.Limits.HandshakesPerUID = total, perUID }
}

// WithConnLimit caps the admitted connections of each of the owner's sockets (the page
// socket, the slab socket, the host tier's): total in all, perProcess from any one
// process. A connection past a cap is refused with an error wrapping [kv.ErrLimit]
// that names the cap. The defaults are 4096 and 64; a value below 1 keeps the default.
func WithConnLimit(total, perProcess int) Option {
	return func(o *options) { o.Limits.Conns, o.Limits.ConnsPerProcess = total, perProcess }
}

// WithMaxLeases caps the leases one connection holds; the default (and n <= 0) is
// [DefaultMaxLeases]. A request past it is refused with an error wrapping [kv.ErrLimit]
// that names it, and changes nothing. With the connection caps it bounds a page's
// reader count, which cannot wrap: [Listen] refuses a MaxLeases × [WithConnLimit]'s
// total of 2^32 or more.
func WithMaxLeases(n int) Option { return func(o *options) { o.MaxLeases = n } }

// WithMaxLeasedPages caps the pages of one connection's leases (a page counted once a
// lease); the default (and n <= 0) is [DefaultMaxLeasedPages]. A request past it is
// refused with an error wrapping [kv.ErrLimit] that names it, and changes nothing.
func WithMaxLeasedPages(n int) Option { return func(o *options) { o.MaxLeasedPages = n } }

// WithMaxNotifiers caps the notifiers one connection registers (each an eventfd the
// owner reads until the connection ends); the default (and n <= 0) is
// [DefaultMaxNotifiers]. A notifier past it is dropped, and the Seal or Release that
// names it refused with an error wrapping [kv.ErrLimit] that names the cap; nothing
// changes.
func WithMaxNotifiers(n int) Option { return func(o *options) { o.MaxNotifiers = n } }

// Defaults of the per-connection caps ([WithMaxLeases], [WithMaxLeasedPages],
// [WithMaxNotifiers]).
const (
	DefaultMaxLeases      = 16384
	DefaultMaxLeasedPages = 1 << 20
	DefaultMaxNotifiers   = 256
)

// Owner serves the pages of its slabs. Its methods are safe for concurrent use.
type Owner struct {
	dir    string
	rt     cudart.Runtime
	geo    kv.Geometry
	layout kv.SlabLayout
	opts   options
	log    *slog.Logger

	lock  *os.File // dir/owner.lock (the keeper's: dir/keeper.lock), held
	ln    *net.UnixListener
	host  hostSide // the host tiers' spillers and socket (hostsock.go)
	srv   *session.Server
	slabs []*slab
	byDev map[int]*slab

	// keeper is the keeper's dir/keep.sock, held for the page server's life
	// (WithKeeper): the chunks' descriptors and the host tiers' memfds; keeperGone is
	// closed once it ends (keeptier.go).
	keeper     *keep.Client
	keeperGone chan struct{}

	mu     sync.Mutex
	conns  map[*conn]struct{}
	leases map[uint64]*lease
	issued uint64       // the latest lease id granted (or epoch<<40): a later one was never issued
	self   pages.Holder // this process, the holder of its own copies' leases
	closed bool

	wakes      atomic.Uint64  // Pace's
	allocWaits atomic.Uint64  // Pace's
	waiters    sync.WaitGroup // the notifiers' watchers (watch), the Allocs that wait (allocLater), the give-back (giveback.go)

	// A cache that survives its owner (restart.go).
	ix       *index.Index          // nil: no index
	hdr      index.Header          // the index's header, once restore has read the old one
	keeperID procID                // the process whose slabs these are
	epoch    uint64                // the index's epoch: lease ids start at epoch<<40
	recovery Recovery              // set by Listen
	recState *index.State          // the index taken back, for makeTables; nil: none
	prior    map[pages.Holder]bool // the live processes the owner before a restart served
	kept     []pages.LeaseID       // the write leases of before the restart, kept for their writers
	resumed  chan struct{}         // closed once every table's reattach window has closed

	stop    context.CancelFunc
	stopped context.Context // ends when Close begins
}

// lease is a replica's hold on pages of one slab: a lease of the slab's table, booked
// for the connection that holds it (its caps, its end).
type lease struct {
	id     uint64
	c      *conn
	s      *slab
	holder pages.Holder
	write  bool
	pages  []uint32
}

// Listen creates dir (mode 0700, 0711 where the policy admits others), holds
// dir/owner.lock, makes a slab of geometry geo on each device ([WithDevices]; geo is
// required: it has no default, every replica of dir maps slabs of it, and its Pages is
// the bound a slab grows to), its regions reserved and its first chunks mapped
// ([WithInitialPages], [WithChunkBytes]), and serves the page socket dir/kv.sock. A
// live owner on dir makes it fail with an error wrapping [producer.ErrAddressInUse];
// chunks off the device's granularity, with one wrapping [kv.ErrGeometry]; a start
// larger than a device's free memory (MemGetInfo), with one wrapping
// [cudart.ErrOutOfMemory] that names both sizes. On failure nothing is left behind.
func Listen(dir string, rt cudart.Runtime, geo kv.Geometry, opts ...Option) (*Owner, error) {
	o := optionsOf(geo, opts)
	r := roleWhole
	if o.Keeper {
		r = rolePages
	}
	return listen(dir, rt, o, r)
}

// optionsOf applies opts, nil ones skipped, over the defaults.
func optionsOf(geo kv.Geometry, opts []Option) options {
	o := options{Geometry: geo}
	for _, f := range opts {
		if f != nil {
			f(&o)
		}
	}
	return o
}

// listen is [Listen] in role r: it checks rt, o and the devices, then makes dir,
// takes its lock and starts the owner. On failure nothing is left behind.
func listen(dir string, rt cudart.Runtime, o options, r role) (_ *Owner, err error) {
	if rt == nil {
		return nil, errors.New("kv/owner: Listen needs a runtime")
	}
	if len(o.Devices) == 0 {
		o.Devices = []int{0}
	}
	if err := checkHostBytes(o); err != nil {
		return nil, err
	}
	layout, err := checkDevices(rt, o)
	if err != nil {
		return nil, err
	}
	if err := settleLimits(&o); err != nil {
		return nil, err
	}
	made, err := makeDir(dir, opensToOthers(o.Policy))
	if err != nil {
		return nil, err
	}
	defer func() {
		if err != nil && made != "" {
			_ = os.RemoveAll(made) // cleanup: what Listen made goes; the first error is the one returned
		}
	}()
	ow := &Owner{dir: dir, rt: rt, geo: o.Geometry, layout: layout, opts: o, log: o.Logger,
		byDev: map[int]*slab{}, conns: map[*conn]struct{}{}, leases: map[uint64]*lease{},
		resumed: make(chan struct{}), epoch: 1}
	ow.stopped, ow.stop = context.WithCancel(context.Background())
	defer func() {
		if err != nil {
			_ = ow.teardown(context.Background()) // cleanup: the first error is the one returned
		}
	}()
	// The lock first: it tells a live owner from a dead one.
	if ow.lock, err = lockDir(dir, LockFile, "an owner"); err != nil {
		return nil, err
	}
	if err = ow.start(r); err != nil {
		return nil, err
	}
	if ow.ln, err = listenPages(filepath.Join(dir, PageSocket), opensToOthers(o.Policy)); err != nil {
		return nil, err
	}
	var ln net.Listener = ow.ln
	if wrapListener != nil {
		ln = wrapListener(ln)
	}
	ow.srv = session.Serve(ln, o.Logger, "kv/owner", o.Limits, ow.serveConn)
	return ow, nil
}

// start, with the lock held, makes the slabs (in role rolePages: adopts the
// keeper's), takes the index back ([WithIndex]), makes the tiers and tables and
// starts the tiers and the give-back. On failure what it made is left to
// [Owner.teardown].
func (o *Owner) start(r role) error {
	var err error
	if r == rolePages {
		if err := o.adoptSlabs(); err != nil {
			return err
		}
		if o.keeperID, err = procOf(o.recovery.KeeperPID); err != nil {
			return fmt.Errorf("kv/owner: the keeper (pid %d): %w", o.recovery.KeeperPID, err)
		}
	} else if err := o.makeSlabs(); err != nil {
		return err
	}
	if r == roleWhole {
		o.keeperID, _ = procOf(os.Getpid()) // its own slabs, new at each start; without /proc no index is taken back
	}
	self, _ := procOf(os.Getpid())
	o.self = pages.Holder(self)
	if o.opts.Index != "" {
		if err := o.restore(); err != nil {
			return err
		}
	}
	if err := o.makeTiers(); err != nil {
		return err
	}
	o.makeTables()
	if o.opts.Index != "" {
		if err := o.openIndex(o.hdr); err != nil {
			return err
		}
	}
	if err := o.startTiers(); err != nil {
		return err
	}
	o.holdAllocs()
	o.startGiveBack()
	return nil
}

// checkDevices checks o's devices against rt: each exists and is listed once, lays
// o's geometry out as the others do (the layout returned), has fabric handles if
// [WithFabric] asks, and has room for the slab's start ([WithInitialPages]). It
// fails with [kv.ErrGeometry] or [cudart.ErrOutOfMemory] naming the device, or
// with what rt failed with; it changes nothing.
func checkDevices(rt cudart.Runtime, o options) (kv.SlabLayout, error) {
	n, err := rt.DeviceCount()
	if err != nil {
		return kv.SlabLayout{}, err
	}
	var layout kv.SlabLayout
	for i, d := range o.Devices {
		if d < 0 || d >= n {
			return kv.SlabLayout{}, fmt.Errorf("%w: device %d: the runtime has %d", kv.ErrGeometry, d, n)
		}
		if slices.Contains(o.Devices[:i], d) {
			return kv.SlabLayout{}, fmt.Errorf("%w: device %d listed twice", kv.ErrGeometry, d)
		}
		l, err := layoutOf(rt, d, o.Geometry, o.ChunkBytes, handleTypeOf(o))
		if err != nil {
			return kv.SlabLayout{}, err
		}
		if i > 0 && l != layout {
			return kv.SlabLayout{}, fmt.Errorf("%w: device %d lays the slab out as %v, device %d as %v: give WithChunkBytes", kv.ErrGeometry, d, l, o.Devices[0], layout)
		}
		layout = l
		if o.Fabric {
			if err := probeFabric(rt, d); err != nil {
				return kv.SlabLayout{}, err
			}
		}
		free, total, err := rt.MemGetInfo(d)
		if err != nil {
			return kv.SlabLayout{}, fmt.Errorf("kv/owner: the memory of device %d: %w", d, err)
		}
		if c := initialChunks(layout, o.InitialPages); layout.MappedBytes(c) > free {
			n := layout.MappedBytes(c)
			return kv.SlabLayout{}, fmt.Errorf("kv/owner: %w: a slab's start of %s (%d bytes: %d chunks of %s, %d pages of the %d at most) is larger than device %d's free memory, %s (%d bytes, of %s)",
				cudart.ErrOutOfMemory, humanize.IBytes(n), n, c, humanize.IBytes(layout.ChunkBytes()), layout.MappedPages(c), o.Geometry.Pages, d, humanize.IBytes(free), free, humanize.IBytes(total))
		}
	}
	return layout, nil
}

// settleLimits gives o a logger and the default caps where it has none, and fails
// if [WithMaxLeases] times the connection limit could wrap a page's 32-bit reader
// count.
func settleLimits(o *options) error {
	if o.Logger == nil {
		o.Logger = slog.New(slog.DiscardHandler)
	}
	for _, c := range []struct {
		v   *int
		def int
	}{{&o.MaxLeases, DefaultMaxLeases}, {&o.MaxLeasedPages, DefaultMaxLeasedPages}, {&o.MaxNotifiers, DefaultMaxNotifiers}} {
		if *c.v <= 0 {
			*c.v = c.def
		}
	}
	conns := o.Limits.Conns
	if conns <= 0 {
		conns = session.DefaultConns
	}
	if n := uint64(o.MaxLeases) * uint64(conns); n >= math.MaxUint32 {
		return fmt.Errorf("kv/owner: WithMaxLeases (%d) × WithConnLimit's total (%d) is %d: a page's 32-bit reader count could wrap; keep the product under 2^32", o.MaxLeases, conns, n)
	}
	return nil
}

// makeSlabs makes each device's slab.
func (o *Owner) makeSlabs() error {
	for _, d := range o.opts.Devices {
		s, err := o.makeSlab(d)
		if s != nil {
			o.slabs = append(o.slabs, s)
			o.byDev[d] = s
		}
		if err != nil {
			return err
		}
	}
	return nil
}

// makeSlab makes device d's slab (newSlabOf) and maps its initial chunks.
func (o *Owner) makeSlab(d int) (*slab, error) {
	s, err := o.newSlabOf(d)
	if err != nil {
		return s, err
	}
	if err = o.growSlab(s, initialChunks(o.layout, o.opts.InitialPages)); err != nil {
		return s, err
	}
	return s, nil
}

// newSlabOf makes device d's stream and slab, its regions reserved with access for
// the other devices served that can reach d, nothing mapped.
func (o *Owner) newSlabOf(d int) (*slab, error) {
	s := newSlab(d)
	var peers []int
	for _, other := range o.opts.Devices {
		if other == d {
			continue
		}
		if ok, err := o.rt.DeviceCanAccessPeer(other, d); err == nil && ok {
			peers = append(peers, other)
		}
	}
	var err error
	if s.stream, err = o.rt.StreamCreate(d, cudart.StreamNonBlocking); err != nil {
		return s, fmt.Errorf("kv/owner: stream on device %d: %w", d, err)
	}
	if s.done, err = o.rt.EventCreate(d, cudart.EventDisableTiming); err != nil {
		return s, fmt.Errorf("kv/owner: event on device %d: %w", d, err)
	}
	if err = o.mapSlab(s, peers); err != nil {
		return s, err
	}
	return s, nil
}

// opensToOthers says whether p admits anyone but this user.
func opensToOthers(p export.Policy) bool { return session.OpensToOthers(p.AllowUIDs, p.AllowGIDs) }

// wrapListener, set by tests alone, wraps the page socket's listener.
var wrapListener func(net.Listener) net.Listener

// makeDir creates dir if missing and checks that it is a directory of this user's that
// no one else can write. made is the topmost directory it created ("" if none), for
// a Listen that fails to remove.
func makeDir(dir string, open bool) (made string, err error) {
	mode := os.FileMode(0o700)
	if open {
		mode = 0o711
	}
	for d := filepath.Clean(dir); ; d = filepath.Dir(d) {
		if _, err := os.Lstat(d); err == nil || filepath.Dir(d) == d {
			break
		}
		made = d
	}
	if err := os.MkdirAll(dir, mode); err != nil {
		return "", fmt.Errorf("kv/owner: %w", err)
	}
	info, err := os.Lstat(dir)
	if err != nil {
		return made, fmt.Errorf("kv/owner: %w", err)
	}
	st, ok := info.Sys().(*syscall.Stat_t)
	switch {
	case !info.IsDir():
		return made, fmt.Errorf("kv/owner: %s is not a directory", dir)
	case ok && int(st.Uid) != os.Getuid():
		return made, fmt.Errorf("kv/owner: %s belongs to uid %d, not this user", dir, st.Uid)
	case info.Mode().Perm()&0o022 != 0:
		return made, fmt.Errorf("kv/owner: %s can be written by others (mode %v)", dir, info.Mode().Perm())
	}
	return made, nil
}

// listenPages listens on path, replacing a stale socket there (the caller holds the
// slab socket, so no live owner uses it), with mode 0600 (0666 if open) whatever the
// umask: it binds a temporary name, sets its mode and renames it.
func listenPages(path string, open bool) (*net.UnixListener, error) {
	if info, err := os.Lstat(path); err == nil {
		if info.Mode().Type() != os.ModeSocket {
			return nil, fmt.Errorf("kv/owner: %s exists and is not a socket; it is left alone", path)
		}
	}
	tmp := path + ".new-" + strconv.Itoa(os.Getpid())
	_ = os.Remove(tmp) // a stale one from a pid before us; if it stays, the listen says why
	l, err := net.ListenUnix("unix", &net.UnixAddr{Name: tmp, Net: "unix"})
	if err != nil {
		return nil, fmt.Errorf("kv/owner: listen on %s: %w", path, err)
	}
	l.SetUnlinkOnClose(false)
	mode := os.FileMode(0o600)
	if open {
		mode = 0o666
	}
	if err := os.Chmod(tmp, mode); err != nil {
		_ = l.Close()      // cleanup: nothing is left to do if closing fails
		_ = os.Remove(tmp) // best effort: a leftover file is harmless, and the first error is the one returned
		return nil, fmt.Errorf("kv/owner: socket %s: %w", path, err)
	}
	if err := os.Rename(tmp, path); err != nil {
		_ = l.Close()      // cleanup: nothing is left to do if closing fails
		_ = os.Remove(tmp) // best effort: a leftover file is harmless, and the first error is the one returned
		return nil, fmt.Errorf("kv/owner: socket %s: %w", path, err)
	}
	return l, nil
}

// Dir is the directory the owner serves in.
func (o *Owner) Dir() string { return o.dir }

// Geometry is every slab's geometry.
func (o *Owner) Geometry() kv.Geometry { return o.geo }

// Layout is how every slab lies in its chunks.
func (o *Owner) Layout() kv.SlabLayout { return o.layout }

// Stats is a snapshot of the owner's slabs and replicas.
func (o *Owner) Stats() Stats {
	o.mu.Lock()
	defer o.mu.Unlock()
	st := Stats{PID: os.Getpid(), Geometry: kv.StatsOf(o.layout), Devices: make([]kv.DeviceStats, len(o.slabs)), Replicas: []kv.ReplicaStats{}}
	for i, s := range o.slabs {
		st.Devices[i] = s.stats()
	}
	for c := range o.conns {
		if c.welcomed {
			st.Replicas = append(st.Replicas, kv.ReplicaStats{PID: c.cred.PID, Device: c.s.dev, Leases: len(c.held), Pages: c.heldPgs, AwaitingExit: c.lost})
		}
	}
	slices.SortFunc(st.Replicas, func(a, b kv.ReplicaStats) int { return a.PID - b.PID })
	st.ReplicaCount = len(st.Replicas)
	if o.ix != nil {
		rs := &kv.RestartStats{Epoch: o.epoch, Adopted: o.recovery.Adopted, Keeper: o.recovery.KeeperPID,
			Restored: o.recovery.Pages, Replicas: o.recovery.Replicas, Dropped: o.recovery.Dropped}
		for _, s := range o.slabs {
			rs.Kept += o.keptLocked(s)
			if s.tab.Window() {
				rs.Awaiting = len(o.expectedLocked())
			}
		}
		st.Restart = rs
	}
	return st
}

// Close stops serving: it closes every replica's connection (their Done closes, and
// their leases end), waits, until ctx ends, for its own copies to complete, and unmaps
// the slabs: their memory lives on while a replica maps it. A second Close returns
// [kv.ErrClosed].
func (o *Owner) Close(ctx context.Context) error {
	o.mu.Lock()
	if o.closed {
		o.mu.Unlock()
		return kv.ErrClosed
	}
	o.closed = true
	o.mu.Unlock()
	return o.teardown(ctx)
}

// teardown undoes what Listen made, whatever it got to.
func (o *Owner) teardown(ctx context.Context) error {
	o.stop()
	o.mu.Lock()
	o.closed = true
	o.mu.Unlock()
	if o.srv != nil {
		o.srv.Close() // the listener, and every connection: closing it is what ends its service
	} else if o.ln != nil {
		_ = o.ln.Close() // cleanup: nothing is left to do if closing fails
	}
	if o.ln != nil {
		_ = os.Remove(filepath.Join(o.dir, PageSocket)) // best effort: the next Listen replaces a stale socket
	}
	// The notifiers' watchers return once their connections' ends close them, and the
	// Allocs that wait once their waits do.
	waited := make(chan struct{})
	go func() {
		o.waiters.Wait()
		close(waited)
	}()
	select {
	case <-waited:
	case <-ctx.Done():
	}
	errs := o.stopTiers()
	if err := o.ix.Close(ctx); err != nil {
		errs = append(errs, err)
	}
	for _, s := range o.slabs {
		drained := true
		if s.stream != 0 && s.done != 0 {
			if err := o.waitStream(ctx, s); err != nil {
				errs = append(errs, fmt.Errorf("kv/owner: the stream of device %d: %w", s.dev, err))
				drained = false
			}
		}
		if drained { // else the mapping stays, to the process's exit: a copy may still run on it
			if err := s.closeSlab(); err != nil {
				errs = append(errs, err)
			}
		}
		if s.done != 0 {
			if err := o.rt.EventDestroy(s.dev, s.done); err != nil {
				errs = append(errs, fmt.Errorf("kv/owner: destroying the event of device %d: %w", s.dev, err))
			}
		}
		if s.stream != 0 {
			if err := o.rt.StreamDestroy(s.dev, s.stream); err != nil {
				errs = append(errs, fmt.Errorf("kv/owner: destroying the stream of device %d: %w", s.dev, err))
			}
		}
	}
	if o.keeper != nil {
		if err := o.keeper.Close(); err != nil {
			errs = append(errs, fmt.Errorf("kv/owner: the keeper's descriptors: %w", err))
		}
	}
	if o.lock != nil {
		_ = o.lock.Close() // cleanup: closing it is what lets the lock go
	}
	return errors.Join(errs...)
}
