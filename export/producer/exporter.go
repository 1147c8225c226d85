package producer

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"maps"
	"net"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/dustin/go-humanize"
	"golang.org/x/sync/errgroup"

	"github.com/cudapool/cudapool/cudart"
	"github.com/cudapool/cudapool/export"
	"github.com/cudapool/cudapool/export/discover"
	"github.com/cudapool/cudapool/export/internal/wire"
	"github.com/cudapool/cudapool/internal/printable"
	"github.com/cudapool/cudapool/internal/session"
	"github.com/cudapool/cudapool/pool"
)

// Exporter shares buffers of IPC-capable pools with the processes that connect to its
// socket. Its methods are safe for concurrent use.
type Exporter struct {
	rt      cudart.Runtime
	opts    listenOptions
	log     *slog.Logger
	started time.Time
	devices []cudart.UUID // by ordinal
	sock    *socketFile
	// announced is the announcement file, "" if none.
	announced string

	connIDs *connIDs

	readyMu sync.Mutex
	ready   map[readyKey]*readyEvent

	mu       sync.Mutex
	closed   bool
	pubs     map[string]*publication
	pools    map[*pool.Pool]uint64 // wire ids of the pools ever published
	lastPool uint64
	// lastAlloc is the wire id of the last VMM allocation published (PublishChunks).
	lastAlloc uint64
	peers     map[*peer]struct{}
	// observers are the connections made for State alone.
	observers map[*observer]struct{}
	// srv serves the socket and the listeners of Serve: their caps, handshake timeout
	// and admission by credentials.
	srv *session.Server
	// changed is poked whenever a lease ends or a peer leaves, for Close to recount.
	changed chan struct{}
}

// publication is a buffer, or a VMM allocation, under a name, with the event
// consumers wait on for the producer's writes.
type publication struct {
	name string
	// buf is the pool buffer published, nil for a VMM allocation (alloc).
	buf            *pool.Buffer
	alloc          *vmmAlloc
	offset, length uint64 // the range of buf (or alloc) published
	meta           []byte
	ready          *readyEvent
}

// readyKey names the ready event of one producer stream.
type readyKey struct {
	dev int
	s   cudart.Stream
}

// readyEvent is an IPC event recorded on one producer stream, created on first use and
// kept until Close: all its records are on that one in-order stream, so waiting on a
// later record than a buffer needs only waits longer, never too little.
type readyEvent struct {
	dev    int
	ev     cudart.Event
	handle cudart.IpcEventHandle
}

// Listen creates an [Exporter] on a new Unix socket at path (mode 0600, or as
// [SocketFollowsPolicy] makes it) and starts accepting connections. A stale socket file
// at path is replaced; a live exporter's gives [ErrAddressInUse], a file that is not a
// socket [export.ErrNotSocket], and a path longer than a socket address holds [ErrSocketPath]. Unless
// [WithoutAnnounce] is given, the exporter announces itself in DefaultDir() (or the
// [WithAnnounceDir] directory, created private if missing). On failure nothing is left
// behind: no socket, no announcement.
func Listen(path string, rt cudart.Runtime, opts ...ListenOption) (*Exporter, error) {
	if rt == nil {
		return nil, errors.New("producer: Listen needs a runtime")
	}
	o := newListenOptions(opts)
	if err := printable.Check(o.name, MaxExporterNameLen); err != nil {
		return nil, fmt.Errorf("producer: listen: %w: exporter name %w", export.ErrBadName, err)
	}
	ex := &Exporter{
		rt: rt, opts: o, log: o.Log, connIDs: newConnIDs(), started: time.Now(),
		ready: map[readyKey]*readyEvent{}, pubs: map[string]*publication{},
		pools: map[*pool.Pool]uint64{}, peers: map[*peer]struct{}{}, observers: map[*observer]struct{}{},
		changed: make(chan struct{}, 1),
	}
	ex.srv = session.NewServer(o.Log, "producer", o.limits(), ex.serveConn)
	var err error
	if ex.devices, err = deviceUUIDs(rt); err != nil {
		return nil, err
	}
	if o.announce {
		if o.announceDir == "" {
			o.announceDir = discover.DefaultDir()
		}
		if err := discover.EnsureDir(o.announceDir); err != nil {
			return nil, err
		}
	}
	access := privateSocket
	if o.socketFollowsPolicy {
		access = accessFor(o.policy)
	}
	if ex.sock, err = listenSocket(path, access); err != nil {
		return nil, err
	}
	ex.sock.unlocal = wire.AddLocal(ex.sock.info, rt) // consumer.Dial refuses this process's own
	if o.announce {
		a := discover.Announcement{PID: os.Getpid(), Socket: absPath(path), Name: o.name, Started: ex.started}
		if ex.announced, err = discover.Announce(o.announceDir, a); err != nil {
			_ = ex.sock.remove() // the announce error is the one returned
			return nil, err
		}
	}
	_ = ex.srv.Serve(ex.sock) // a new server is not shut down
	return ex, nil
}

// Serve accepts connections on l too, until l fails or the [Exporter] closes (which
// closes l). It is for byte streams such as TCP between the nodes of one NVLink domain:
// peers there have no credentials, so the Policy must set AllowRemote, and only FABRIC
// pools can be shared with them. Its connections are served as the socket's are, under
// the same caps and handshake timeout ([WithHandshakeLimit], [WithConnLimit],
// [WithHandshakeTimeout]). Serve returns at once; it fails with [export.ErrClosed]
// after Close.
func (ex *Exporter) Serve(l net.Listener) error {
	ex.mu.Lock()
	defer ex.mu.Unlock()
	if ex.closed {
		return export.ErrClosed
	}
	return ex.srv.Serve(l) // shut down only after closed is set, under mu
}

// Addr is the path of the exporter's socket.
func (ex *Exporter) Addr() string { return ex.sock.path }

// Publish makes b available under name, ready once the work queued on s before the
// call (the producer's writes) has completed: consumers' streams wait for
// that, the host does not. It exports b's pool and b now, so that Open is quick and a
// failure shows here: a FABRIC pool on a host without IMEX fails with [export.ErrIMEXRequired].
// A name already in use fails with [ErrNameInUse]; Unpublish it first. A buffer may be
// published under several names. To end every publication of a buffer, Free it: later Opens
// fail with [export.ErrBufferGone] (an [export.ErrUnknownName]: the name is unpublished), its memory returns to the pool once the consumers that
// hold it released it, and its names are free for Publish at once. [Range] publishes part of b, [WithMeta] sends metadata with it;
// an empty range or one past b's end fails with [export.ErrBadRange], metadata longer than
// [export.MaxMetaLen] with [ErrMetaTooLong].
func (ex *Exporter) Publish(ctx context.Context, name string, b *pool.Buffer, s cudart.Stream, opts ...PublishOption) error {
	return ex.PublishAll(ctx, []Entry{{Name: name, Buffer: b, Options: opts}}, s)
}

// Entry is one name for PublishAll: what Publish takes besides the stream.
type Entry struct {
	Name    string
	Buffer  *pool.Buffer
	Options []PublishOption
}

// PublishAll is Publish of every entry at once, each ready once the work queued on s
// before the call has completed: the ready event is recorded once for all of
// them. The buffers must be on one device. It publishes all the entries or, with the
// error of the first that fails, none.
func (ex *Exporter) PublishAll(ctx context.Context, entries []Entry, s cudart.Stream) error {
	if len(entries) == 0 {
		return nil
	}
	pubs := make([]*publication, len(entries))
	for i, e := range entries {
		pub, err := newPublication(e)
		if err != nil {
			return err
		}
		if i > 0 && pub.buf.Device() != pubs[0].buf.Device() {
			return fmt.Errorf("producer: publish %q: %w: on device %d, the batch's first on %d", e.Name, export.ErrBadRequest, pub.buf.Device(), pubs[0].buf.Device())
		}
		pubs[i] = pub
	}
	if err := ctx.Err(); err != nil {
		return err
	}
	ex.mu.Lock()
	closed := ex.closed
	ex.mu.Unlock()
	if closed {
		return export.ErrClosed
	}
	for _, pub := range pubs {
		if _, err := pub.buf.ExportRecord(); err != nil {
			return fmt.Errorf("producer: publish %q: %w", pub.name, fabricErr(pub.buf.Pool(), err))
		}
	}
	re, err := ex.readyFor(pubs[0].buf.Device(), s)
	if err != nil {
		return fmt.Errorf("producer: publish %q: %w", pubs[0].name, err)
	}
	ex.mu.Lock()
	defer ex.mu.Unlock()
	if ex.closed {
		return export.ErrClosed
	}
	seen := make(map[string]bool, len(pubs))
	for _, pub := range pubs {
		if ex.nameTakenLocked(pub.name) || seen[pub.name] {
			return fmt.Errorf("%w: %q", ErrNameInUse, pub.name)
		}
		seen[pub.name] = true
	}
	// Recorded under mu so that no Open can see the publications before their writes
	// are captured.
	if err := ex.rt.EventRecord(re.dev, re.ev, s); err != nil {
		return fmt.Errorf("producer: publish %q: record ready event: %w", pubs[0].name, err)
	}
	for _, pub := range pubs {
		if _, ok := ex.pools[pub.buf.Pool()]; !ok {
			ex.lastPool++
			ex.pools[pub.buf.Pool()] = ex.lastPool
		}
		pub.ready = re
		ex.pubs[pub.name] = pub
	}
	return nil
}

// newPublication checks what Publish is asked for, and returns it without its ready
// event.
func newPublication(e Entry) (*publication, error) {
	if err := wire.CheckName(e.Name); err != nil {
		return nil, err
	}
	if e.Buffer == nil {
		return nil, fmt.Errorf("producer: publish %q: %w: nil buffer", e.Name, export.ErrBadRequest)
	}
	pub, err := publicationOf(e.Name, e.Buffer.Size(), e.Options)
	if err != nil {
		return nil, err
	}
	pub.buf = e.Buffer
	return pub, nil
}

// publicationOf is the publication under name of the range opts give of size bytes,
// with its metadata, and neither its memory nor its ready event.
func publicationOf(name string, size uint64, opts []PublishOption) (*publication, error) {
	var o publishOptions
	for _, opt := range opts {
		if opt != nil {
			opt(&o)
		}
	}
	if o.length == 0 && o.offset <= size {
		o.length = size - o.offset
	}
	if err := wire.CheckRange(size, o.offset, o.length); err != nil {
		return nil, fmt.Errorf("producer: publish %q: %w", name, err)
	}
	if len(o.meta) > export.MaxMetaLen {
		return nil, fmt.Errorf("producer: publish %q: %w: %d bytes, at most %d", name, ErrMetaTooLong, len(o.meta), export.MaxMetaLen)
	}
	return &publication{name: name, offset: o.offset, length: o.length, meta: o.meta}, nil
}

// nameTakenLocked reports whether name is published, by a buffer not freed or a VMM
// allocation. Call with mu held.
func (ex *Exporter) nameTakenLocked(name string) bool {
	old, ok := ex.pubs[name]
	return ok && (old.alloc != nil || !freed(old.buf))
}

// Unpublish removes name. Leases already given out are unaffected. A VMM allocation
// ([Exporter.PublishChunks]) gives up the Exporter's descriptors of its chunks. An
// unknown name fails with [export.ErrUnknownName].
func (ex *Exporter) Unpublish(name string) error {
	ex.mu.Lock()
	pub, ok := ex.pubs[name]
	if !ok {
		defer ex.mu.Unlock()
		return ex.unknownName(name)
	}
	delete(ex.pubs, name)
	ex.mu.Unlock()
	if pub.alloc != nil {
		pub.alloc.unpublished()
	}
	return nil
}

// readyFor returns the ready event of stream s on dev, creating it on first use.
func (ex *Exporter) readyFor(dev int, s cudart.Stream) (*readyEvent, error) {
	ex.readyMu.Lock()
	defer ex.readyMu.Unlock()
	// Checked under readyMu: Close destroys the events under it after setting closed.
	ex.mu.Lock()
	closed := ex.closed
	ex.mu.Unlock()
	if closed {
		return nil, export.ErrClosed
	}
	k := readyKey{dev, s}
	if re := ex.ready[k]; re != nil {
		return re, nil
	}
	ev, err := ex.rt.EventCreate(dev, cudart.EventIPC)
	if err != nil {
		return nil, fmt.Errorf("create ready event: %w", err)
	}
	h, err := ex.rt.IpcGetEventHandle(dev, ev)
	if err != nil {
		_ = ex.rt.EventDestroy(dev, ev) // cleanup: nothing is left to undo if it fails
		return nil, fmt.Errorf("ready event handle: %w", err)
	}
	re := &readyEvent{dev: dev, ev: ev, handle: h}
	ex.ready[k] = re
	return re, nil
}

// Push leases the buffer published under name to every connection of process pid,
// without being asked; the importer there hands it to its consumer.WithPushes handler (or gives
// it back at once if it has none). It returns once the lease is sent. No connected
// process pid gives [ErrNoPeer].
func (ex *Exporter) Push(ctx context.Context, name string, pid int) error {
	return ex.PushAll(ctx, name, pid)
}

// maxPushSends bounds the connections PushAll grants and sends to at once.
const maxPushSends = 64

// PushAll is Push to every connection of each process in pids at once: the leases
// are granted and sent concurrently, up to 64 connections at a time, and no send waits
// for another process to take its push, so fanning a buffer out to n processes takes
// about as long as pushing it to one. (A process that stopped reading holds its slot
// until ctx ends.) It returns once every lease is sent or has failed. A pid without a
// connection gives an error wrapping [ErrNoPeer] and the others are pushed all the same;
// a pid listed twice is pushed to twice. Without pids it fails and pushes nothing.
func (ex *Exporter) PushAll(ctx context.Context, name string, pids ...int) error {
	if len(pids) == 0 {
		return fmt.Errorf("producer: push %q: no process to push to", name)
	}
	wanted := make(map[int]bool, len(pids))
	for _, pid := range pids {
		wanted[pid] = true
	}
	ex.mu.Lock()
	pub := ex.pubs[name]
	var unknown error
	if pub == nil {
		unknown = ex.unknownName(name)
	}
	conns := map[int][]*peer{}
	for p := range ex.peers {
		if p.cred != nil && wanted[p.cred.PID] {
			conns[p.cred.PID] = append(conns[p.cred.PID], p)
		}
	}
	closed := ex.closed
	ex.mu.Unlock()
	switch {
	case closed:
		return export.ErrClosed
	case pub == nil:
		return unknown
	}
	// Every send is tried whatever the others do, so the group's functions report
	// through errs, one slot each, and return nil: a failure cancels nothing.
	type send struct {
		pid int
		p   *peer
	}
	var sends []send
	var errs []error
	for _, pid := range pids {
		if len(conns[pid]) == 0 {
			errs = append(errs, fmt.Errorf("%w: no connection from pid %d", ErrNoPeer, pid))
		}
		for _, p := range conns[pid] {
			sends = append(sends, send{pid, p})
		}
	}
	sendErrs := make([]error, len(sends))
	var g errgroup.Group
	g.SetLimit(maxPushSends)
	for i, s := range sends {
		g.Go(func() error {
			if err := s.p.push(ctx, pub); err != nil {
				sendErrs[i] = fmt.Errorf("producer: push %q to pid %d: %w", name, s.pid, err)
			}
			return nil
		})
	}
	_ = g.Wait() // only its exit matters here
	return errors.Join(append(errs, sendErrs...)...)
}

// lookup returns the publication under name.
func (ex *Exporter) lookup(name string) (*publication, error) {
	ex.mu.Lock()
	defer ex.mu.Unlock()
	if ex.closed {
		return nil, export.ErrClosed
	}
	pub := ex.pubs[name]
	if pub == nil {
		return nil, ex.unknownName(name)
	}
	return pub, nil
}

// namesInError bounds the published names an unknown name's error lists.
const namesInError = 5

// unknownName is the error for a name not published, listing a few that are, so that
// a misspelt name shows at once. Call with mu held.
func (ex *Exporter) unknownName(name string) error {
	if len(ex.pubs) == 0 {
		return fmt.Errorf("%w: %q (nothing is published)", export.ErrUnknownName, name)
	}
	names := slices.Sorted(maps.Keys(ex.pubs))
	list := make([]string, 0, namesInError)
	for _, n := range names[:min(len(names), namesInError)] {
		list = append(list, strconv.Quote(n))
	}
	more := ""
	if extra := len(names) - namesInError; extra > 0 {
		more = fmt.Sprintf(" and %d more", extra)
	}
	return fmt.Errorf("%w: %q (published: %s%s)", export.ErrUnknownName, name, strings.Join(list, ", "), more)
}

// freed reports whether b was freed: its record may not be handed out any more.
func freed(b *pool.Buffer) bool {
	_, err := b.ExportRecord()
	return errors.Is(err, pool.ErrFreed)
}

// dropFreed drops pub if it is still published: its buffer was freed.
func (ex *Exporter) dropFreed(pub *publication) {
	ex.mu.Lock()
	defer ex.mu.Unlock()
	if ex.pubs[pub.name] == pub {
		delete(ex.pubs, pub.name)
	}
}

func (ex *Exporter) poolID(p *pool.Pool) uint64 {
	ex.mu.Lock()
	defer ex.mu.Unlock()
	return ex.pools[p]
}

// poke tells Close that leases or peers changed.
func (ex *Exporter) poke() {
	select {
	case ex.changed <- struct{}{}:
	default:
	}
}

// Peers lists the peers, the connections that take leases: the connected ones and
// those awaiting their process's exit. Connections made for State alone (QueryState's,
// cmd/poolstat's) hold nothing and are left out.
func (ex *Exporter) Peers() []export.PeerState {
	peers := ex.peerList()
	out := make([]export.PeerState, 0, len(peers))
	for _, p := range peers {
		out = append(out, p.state())
	}
	return out
}

// Close stops accepting connections, removes the socket and the announcement, and
// tells every peer that no more buffers can be opened. It then waits, until ctx ends,
// for the peers to release what they hold (and for the processes of peers lost without
// Bye to exit), closes every connection and destroys the events it made.
//
// Close never frees memory a living process maps. Leases still held when ctx ends are
// abandoned, as pool.Close(Force) abandons buffers: the error wraps [ErrAbandoned] and
// ctx's error and names each peer and what it holds; those peers are served on in the
// background (they can Release and say Bye, nothing else) and each buffer goes back to
// its pool once its consumer released it or its process exited. Close leaves the
// pools alone: they are the caller's (closing one with Force abandons what is still
// leased). A second Close returns [export.ErrClosed].
func (ex *Exporter) Close(ctx context.Context) error {
	ex.mu.Lock()
	if ex.closed {
		ex.mu.Unlock()
		return export.ErrClosed
	}
	ex.closed = true
	pubs := ex.pubs
	ex.pubs = map[string]*publication{}
	for o := range ex.observers {
		_ = o.c.Close() // an observer holds nothing
	}
	ex.mu.Unlock()
	for _, pub := range pubs {
		if pub.alloc != nil {
			// Its DropChunks may follow the Bye, as Revokes do: a peer whose leases
			// Close abandons is served on, and must not keep the chunks meanwhile.
			pub.alloc.unpublished()
		}
	}

	// The socket first, so that its file goes and its listener's close is counted
	// once; then the other listeners and the connections not yet admitted, which
	// hold nothing either.
	errs := []error{ex.sock.remove()}
	ex.srv.Shutdown()
	if ex.announced != "" {
		if err := os.Remove(ex.announced); err != nil {
			errs = append(errs, fmt.Errorf("producer: remove announcement: %w", err))
		}
	}
	var byes sync.WaitGroup
	for _, p := range ex.peerList() {
		// Each Bye on its own: a peer that stopped reading must keep neither the
		// others from being told nor the wait below from starting. A peer that cannot
		// be told still holds what it holds: it is counted below, and cut with the
		// others, which ends its Bye.
		byes.Go(func() {
			_ = p.c.Send(ctx, &wire.ByeMsg{}, -1) // the peer may be gone already; the connection closes next
			p.revokeAll(ctx)
		})
	}
	errs = append(errs, ex.waitReleased(ctx))
	for _, p := range ex.peerList() {
		if ctx.Err() != nil && (p.holdsLeases() || p.retainedCount() > 0) {
			// Cut, a live peer's retained imports would stay reserved for good; served
			// on, they end with its revokes, or when its process exits.
			ex.log.Warn("producer: close: leases or retained imports abandoned; the peer is served until it releases them or its process exits", "pid", p.pid())
			p.detach()
			continue
		}
		p.shut()
	}
	byes.Wait()
	ex.srv.Close() // waits for every handler but those of the peers detached above
	ex.readyMu.Lock()
	for k, re := range ex.ready {
		if err := ex.rt.EventDestroy(re.dev, re.ev); err != nil {
			errs = append(errs, fmt.Errorf("producer: destroy ready event: %w", err))
		}
		delete(ex.ready, k)
	}
	ex.readyMu.Unlock()
	return errors.Join(errs...)
}

func (ex *Exporter) peerList() []*peer {
	ex.mu.Lock()
	defer ex.mu.Unlock()
	out := make([]*peer, 0, len(ex.peers))
	for p := range ex.peers {
		out = append(out, p)
	}
	return out
}

// waitReleased waits until no peer holds a lease, or ctx ends; then it says who still
// holds what.
func (ex *Exporter) waitReleased(ctx context.Context) error {
	for {
		var held []string
		for _, p := range ex.peerList() {
			i := p.state()
			switch {
			case i.Leases > 0 && i.AwaitingExit:
				held = append(held, fmt.Sprintf("pid %d, its connection lost but its process alive, holds %d leases (%s)", i.PID, i.Leases, humanize.IBytes(i.BytesLeased)))
			case i.Leases > 0:
				held = append(held, fmt.Sprintf("pid %d holds %d leases (%s)", i.PID, i.Leases, humanize.IBytes(i.BytesLeased)))
			}
			if n := p.retainedCount(); n > 0 {
				held = append(held, fmt.Sprintf("pid %d retains %d imports", i.PID, n))
			}
		}
		if len(held) == 0 {
			return nil
		}
		select {
		case <-ex.changed:
		case <-ctx.Done():
			return fmt.Errorf("producer: close: %w while peers still held leases: %w: %s", ctx.Err(), ErrAbandoned, strings.Join(held, "; "))
		}
	}
}

// deviceUUIDs lists the UUIDs of rt's devices by ordinal.
func deviceUUIDs(rt cudart.Runtime) ([]cudart.UUID, error) {
	n, err := rt.DeviceCount()
	if err != nil {
		return nil, fmt.Errorf("producer: count devices: %w", err)
	}
	out := make([]cudart.UUID, n)
	for i := range out {
		if out[i], err = rt.DeviceUUID(i); err != nil {
			return nil, fmt.Errorf("producer: device %d: %w", i, err)
		}
	}
	return out, nil
}

// fabricErr explains the driver's refusal to export a FABRIC pool (FACTS 11).
func fabricErr(p *pool.Pool, err error) error {
	if p.HandleType() == cudart.HandleTypeFabric && errors.Is(err, cudart.ErrNotPermitted) {
		return fmt.Errorf("%w: %w", export.ErrIMEXRequired, err)
	}
	return err
}

func absPath(p string) string {
	if a, err := filepath.Abs(p); err == nil {
		return a
	}
	return p
}
