package consumer

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"maps"
	"net"
	"os"
	"reflect"
	"slices"
	"sync"
	"sync/atomic"

	"golang.org/x/sync/singleflight"

	"github.com/cudapool/cudapool/cudart"
	"github.com/cudapool/cudapool/export"
	"github.com/cudapool/cudapool/export/internal/wire"
)

// Importer is a consumer's connection to one exporter: it opens published buffers as
// Mappings on its device. Its methods are safe for concurrent use; many goroutines may
// Open and Release at once over its one connection.
type Importer struct {
	rt     cudart.Runtime
	dev    int
	cl     *wire.Client
	log    *slog.Logger
	remote bool // a byte stream: no descriptors, no IPC events
	// retain: the exporter lets this Importer keep imports mapped past their leases.
	retain bool
	opts   dialOptions

	devUUID   cudart.UUID
	relStream cudart.Stream // where imports are freed
	// relEvent is recorded on relStream after every free and waited on by the
	// exporter before it frees; 0 on a byte stream, where frees are synchronised.
	relEvent cudart.Event
	relIPC   cudart.IpcEventHandle
	// orderEvents carry callers' streams, as of Release, over to relStream: one per
	// stream (mapping.go, orderRelease). Guarded by mapMu.
	orderEvents map[cudart.Stream]cudart.Event

	registryKey any // the entry this Importer holds in importers, nil if none

	mu     sync.Mutex
	pools  map[uint64]*importedPool
	events map[cudart.IpcEventHandle]cudart.Event // opened ready events
	// eventOpens shares one opening of a ready event among the Opens that need it.
	eventOpens singleflight.Group
	pushes     []*wire.PushMsg
	pushCue    chan struct{}
	// kept are the chunks of VMM allocations, imported, by allocation (vmm.go).
	kept map[uint64]*chunkSet

	// closing is set when Close begins; adopting is held (shared) by each adoption of
	// a lease (adoptLease) and taken by Close before it frees anything, so an Open in
	// flight either finished adopting before Close began, or fails with export.ErrClosed and
	// imports nothing into what Close tears down.
	closing  atomic.Bool
	adopting sync.RWMutex

	// mapMu serialises every import and free of a pointer with the table, so that a
	// pointer is never imported again while its free may still be pending (FACTS 4).
	mapMu    sync.Mutex
	mappings map[rangeKey]*Mapping
	imports  map[cudart.PtrExportData]*imported
	// vmmImports are the VMM allocations mapped, by id (vmm.go).
	vmmImports map[uint64]*vmmImport
	freed      map[cudart.PtrExportData]struct{} // freed since relEvent last completed

	pushDone chan struct{}
	// watch tells when the exporter's process is gone (liveness.go).
	watch exporterWatch
	// local copies copies buffers for WithLocalCopy (local copy.go).
	localCopies localCopies
	// life ends when Close gives up on the exporter: sends that are the Importer's own
	// business (releases of unused leases), not a caller's, are bounded by it.
	life    context.Context
	endLife context.CancelFunc
}

type importedPool struct {
	// onPeer: the pool lives on another GPU than the Importer's, so its memory is
	// lost with the exporter (FACTS 14).
	onPeer bool
	// owner is the ordinal of the pool's device in this process, -1 if it does not
	// see it: local copies are copied through it.
	owner  int
	handle cudart.MemPool
	err    error // the import failed; leases on the pool fail with it
}

// importers holds one entry per (runtime, exporter process) with a live Importer: two
// Importers of one process importing the same pool would alias each other's pointers
// (FACTS 4), so the second Dial is refused.
var importers sync.Map

type importerKey struct {
	rt  cudart.Runtime
	pid int
}

// Dial connects to the exporter listening at path, for buffers to be used on device
// of rt. It fails with [export.ErrRefused] (and the exporter's reason) if the exporter does not
// admit this process, [export.ErrVersionMismatch] if it speaks another protocol version, and
// [export.ErrExporterGone] if nothing listens at path. One process should hold one [Importer] per
// exporter and runtime: a second fails with [ErrDuplicateImporter]. An exporter of this
// very process on the same runtime is refused at once with [ErrOwnExporter]: its buffers
// are this process's already (use their pointers), and CUDA imports none of a
// process's own pools or events. On failure nothing is left behind.
func Dial(ctx context.Context, path string, rt cudart.Runtime, device int, opts ...DialOption) (*Importer, error) {
	if rt == nil {
		return nil, errors.New("consumer: Dial needs a runtime")
	}
	o := newDialOptions(opts)
	nc, err := wire.DialSocket(ctx, path, o.waitForExporter)
	if err != nil {
		return nil, err
	}
	if wire.IsLocal(path, rt) {
		_ = nc.Close() // nothing was said on it
		return nil, fmt.Errorf("consumer: dial %s: %w", path, ErrOwnExporter)
	}
	return newImporter(ctx, nc, rt, device, o)
}

// DialConn is [Dial] over a connection the caller made, such as TCP to another node of
// the same NVLink domain. On anything but a Unix socket only FABRIC pools can be
// opened, the exporter waits for the producer's writes before it answers, and Release
// waits for the import's free before it tells the exporter: IPC events do not cross
// hosts. DialConn owns nc from the call on, and closes it on failure.
func DialConn(ctx context.Context, nc net.Conn, rt cudart.Runtime, device int, opts ...DialOption) (*Importer, error) {
	if rt == nil {
		_ = nc.Close() // cleanup: nothing is left to do if closing fails
		return nil, errors.New("consumer: DialConn needs a runtime")
	}
	return newImporter(ctx, nc, rt, device, newDialOptions(opts))
}

// newImporter makes the Importer's resources on its device and does the handshake on
// nc. On failure it closes nc and destroys what it made.
func newImporter(ctx context.Context, nc net.Conn, rt cudart.Runtime, device int, o dialOptions) (_ *Importer, err error) {
	imp := &Importer{
		rt: rt, dev: device, log: o.Log, opts: o,
		pools: map[uint64]*importedPool{}, events: map[cudart.IpcEventHandle]cudart.Event{}, pushCue: make(chan struct{}, 1),
		mappings: map[rangeKey]*Mapping{}, orderEvents: map[cudart.Stream]cudart.Event{}, imports: map[cudart.PtrExportData]*imported{}, freed: map[cudart.PtrExportData]struct{}{},
		pushDone: make(chan struct{}), vmmImports: map[uint64]*vmmImport{}, kept: map[uint64]*chunkSet{},
	}
	imp.life, imp.endLife = context.WithCancel(context.Background())
	_, isUnix := nc.(*net.UnixConn)
	imp.remote = !isUnix
	defer func() {
		if err != nil {
			_ = nc.Close() // cleanup: nothing is left to do if closing fails
			imp.unregister()
			imp.destroyResources(false)
		}
	}()
	if err := imp.makeResources(); err != nil {
		return nil, err
	}
	if o.pushHandler != nil {
		if err := imp.checkStream(o.pushStream); err != nil {
			return nil, fmt.Errorf("consumer: WithPushes: %w", err)
		}
	}
	h := &wire.HelloMsg{Version: export.ProtocolVersion, PID: uint32(os.Getpid()), Flags: wire.HelloLeases, Device: imp.devUUID,
		HandleTypes: uint32(cudart.HandleTypeFabric)}
	if !imp.remote {
		h.HandleTypes |= uint32(cudart.HandleTypePosixFD)
		h.Flags |= wire.HelloReleaseEvent
		h.ReleaseEvent = imp.relIPC
	}
	c, w, err := wire.Handshake(ctx, nc, h, o.HandshakeTimeout)
	if err != nil {
		return nil, err
	}
	imp.retain = w.Flags&wire.WelcomeRetain != 0 && !imp.remote
	imp.cl = wire.NewClient(c, o.Log, int(w.PID))
	imp.cl.Handle = imp.handle
	imp.cl.Unclaimed = imp.releaseUnused
	if err := imp.register(); err != nil {
		return nil, err
	}
	imp.cl.Start()
	imp.watchExporter(nc)
	go imp.deliverPushes()
	return imp, nil
}

// handle takes the frames of the connection that answer no request.
func (imp *Importer) handle(m wire.Message, fd int) error {
	switch m := m.(type) {
	case *wire.PoolHandleMsg:
		imp.importPool(m, fd)
	case *wire.ChunkHandleMsg:
		return imp.importChunk(m, fd)
	case *wire.DropChunksMsg:
		imp.dropChunks(m.AllocID)
	case *wire.RevokeMsg:
		// Not answered from here: the reader must not block on a send.
		go imp.answerRevoke(m.Record)
	case *wire.PushMsg:
		imp.mu.Lock()
		imp.pushes = append(imp.pushes, m)
		imp.mu.Unlock()
		cue(imp.pushCue)
	default:
		return wire.ProtocolErr("unexpected %s from an exporter", m.Kind())
	}
	return nil
}

// register claims this process's one Importer slot for the exporter.
func (imp *Importer) register() error {
	if imp.remote || !reflect.TypeOf(imp.rt).Comparable() {
		return nil
	}
	k := importerKey{imp.rt, imp.cl.ExporterPID}
	if _, loaded := importers.LoadOrStore(k, imp); loaded {
		return fmt.Errorf("%w: exporter pid %d", ErrDuplicateImporter, imp.cl.ExporterPID)
	}
	imp.registryKey = k
	return nil
}

func (imp *Importer) unregister() {
	if imp.registryKey != nil {
		importers.CompareAndDelete(imp.registryKey, imp)
	}
}

// makeResources creates what the Importer needs on its device.
func (imp *Importer) makeResources() error {
	rt, dev := imp.rt, imp.dev
	var err error
	if imp.devUUID, err = rt.DeviceUUID(dev); err != nil {
		return fmt.Errorf("consumer: device %d: %w", dev, err)
	}
	if imp.relStream, err = rt.StreamCreate(dev, cudart.StreamNonBlocking); err != nil {
		return fmt.Errorf("consumer: release stream: %w", err)
	}
	if imp.remote {
		return nil
	}
	if imp.relEvent, err = rt.EventCreate(dev, cudart.EventIPC); err != nil {
		return fmt.Errorf("consumer: release event: %w", err)
	}
	// Recorded once before any free, so the exporter never waits on an event that was
	// never recorded.
	if err = rt.EventRecord(dev, imp.relEvent, imp.relStream); err != nil {
		return fmt.Errorf("consumer: release event: %w", err)
	}
	if imp.relIPC, err = rt.IpcGetEventHandle(dev, imp.relEvent); err != nil {
		return fmt.Errorf("consumer: release event handle: %w", err)
	}
	return nil
}

// destroyResources destroys what makeResources and the connection's life created:
// opened ready events, imported pools, the release event and stream. gone: the
// exporter left, so the driver refuses to destroy its pools (FACTS 7). Errors are
// logged: they leave nothing the caller could act on.
func (imp *Importer) destroyResources(gone bool) {
	rt, dev := imp.rt, imp.dev
	logErr := func(what string, err error) {
		if err != nil {
			imp.log.Warn("consumer: importer cleanup", "what", what, "err", err)
		}
	}
	imp.mu.Lock()
	events, pools := imp.events, imp.pools
	imp.events, imp.pools = map[cudart.IpcEventHandle]cudart.Event{}, map[uint64]*importedPool{}
	imp.mu.Unlock()
	for _, ev := range events {
		logErr("ready event", rt.EventDestroy(dev, ev))
	}
	for _, p := range pools {
		if p.err != nil {
			continue
		}
		err := rt.MemPoolDestroy(dev, p.handle)
		if gone && errors.Is(err, cudart.ErrInvalidValue) {
			err = nil // the driver's answer once the exporter has exited (FACTS 7)
		}
		logErr("imported pool", err)
	}
	imp.closeLocalCopies()
	if imp.relStream != 0 {
		logErr("release stream sync", rt.StreamSynchronize(dev, imp.relStream))
	}
	imp.mapMu.Lock()
	orders := slices.Collect(maps.Values(imp.orderEvents))
	clear(imp.orderEvents)
	imp.mapMu.Unlock()
	for _, ev := range append(orders, imp.relEvent) {
		if ev != 0 {
			logErr("event", rt.EventDestroy(dev, ev))
		}
	}
	if imp.relStream != 0 {
		logErr("release stream", rt.StreamDestroy(dev, imp.relStream))
	}
	imp.relEvent, imp.relStream = 0, 0
}

// importPool imports a pool whose handle arrived, and grants this Importer's device
// access when the pool lives on another GPU. fd, if any, is closed here: the driver
// does not keep it.
func (imp *Importer) importPool(m *wire.PoolHandleMsg, fd int) {
	if fd >= 0 {
		defer wire.CloseFDs([]int{fd})
	}
	ip := &importedPool{onPeer: m.Device != imp.devUUID, owner: imp.ordinalOf(m.Device)}
	ip.handle, ip.err = imp.rt.MemPoolImportFromShareableHandle(imp.dev, cudart.ShareableHandle{Type: m.HandleType, FD: fd, Fabric: m.Fabric})
	if ip.err == nil && m.Device != imp.devUUID {
		access := []cudart.AccessDesc{{Location: cudart.DeviceLocation(imp.dev), Flags: cudart.AccessReadWrite}}
		if err := imp.rt.MemPoolSetAccess(imp.dev, ip.handle, access); err != nil {
			_ = imp.rt.MemPoolDestroy(imp.dev, ip.handle) // cleanup: nothing is left to undo if it fails
			ip.err = fmt.Errorf("give device %d access to the pool on %v: %w", imp.dev, m.Device, err)
		}
	}
	if ip.err != nil {
		ip.err = fmt.Errorf("consumer: import pool %d (%v): %w", m.PoolID, m.HandleType, ip.err)
	}
	imp.mu.Lock()
	old := imp.pools[m.PoolID]
	imp.pools[m.PoolID] = ip
	imp.mu.Unlock()
	if old != nil && old.err == nil {
		// The exporter sends each pool once; a second handle replaces the first.
		imp.log.Warn("consumer: exporter sent a pool handle twice", "pool", m.PoolID)
		_ = imp.rt.MemPoolDestroy(imp.dev, old.handle) // cleanup: nothing is left to undo if it fails
	}
}

func cue(ch chan struct{}) {
	select {
	case ch <- struct{}{}:
	default:
	}
}

// releaseUnused releases a lease this process will not use, without waiting for the answer.
func (imp *Importer) releaseUnused(l *wire.LeaseMsg) {
	err := imp.cl.C.Send(imp.life, &wire.ReleaseMsg{LeaseID: l.LeaseID, Count: 1, Flags: wire.ReleaseNothingImported}, -1)
	if err != nil {
		imp.log.Debug("consumer: could not release an unused lease; the exporter ends it when the connection closes", "err", err)
	}
}

// Open leases the buffer published under name and returns it mapped into this
// process. Work queued on s after Open returns sees the producer's writes that came
// before Publish; the host does not wait. Opening a buffer this [Importer] already holds
// returns the same [Mapping], counted once more; each Open needs its Release.
//
// s must belong to the [Importer]'s device, else Open fails with [ErrStreamDevice]. It
// fails with [export.ErrUnknownName] (whose message lists a few names that are published;
// [WaitForName] waits for the name instead), [export.ErrBufferGone] (the producer freed it:
// an export.ErrUnknownName too, which WaitForName does not wait out),
// [export.ErrHandleType], [export.ErrExporterGone] once the exporter left, [export.ErrClosed] after Close, or
// ctx's error. On failure nothing is held.
func (imp *Importer) Open(ctx context.Context, name string, s cudart.Stream, opts ...OpenOption) (*Mapping, error) {
	if err := wire.CheckName(name); err != nil {
		return nil, err
	}
	if err := imp.checkStream(s); err != nil {
		return nil, fmt.Errorf("consumer: open %q: %w", name, err)
	}
	o := newOpenOptions(opts)
	var m *Mapping
	var err error
	if o.waitForName {
		m, err = imp.openWaiting(ctx, name, s)
	} else {
		m, err = imp.open(ctx, name, s)
	}
	if err != nil || imp.closing.Load() {
		return nil, imp.closedOr(fmt.Sprintf("open %q", name), err)
	}
	if !o.localCopy {
		return m, nil
	}
	r, err := imp.copyLocally(ctx, m, s, o.localCopyAlloc)
	if err != nil {
		return nil, fmt.Errorf("consumer: open %q: local copy: %w", name, err)
	}
	return r, nil
}

// closedOr is err of op, or export.ErrClosed (with err's text) if Close has begun: an Open
// in flight then fails for that reason, whatever its request or adoption ran into. Its
// Mapping, if it got one, is Close's to free.
func (imp *Importer) closedOr(op string, err error) error {
	switch {
	case !imp.closing.Load() || errors.Is(err, export.ErrClosed):
		return err
	case err == nil:
		return fmt.Errorf("consumer: %s: %w", op, export.ErrClosed)
	}
	return fmt.Errorf("consumer: %s: %w (%v)", op, export.ErrClosed, err)
}

// checkStream refuses a stream of another device: Release orders the import's free
// after the caller's stream through an event of the Importer's device, which the
// driver cannot record on another device's stream. A runtime that cannot tell a
// stream's device (before CUDA 12.8) leaves the check to Release.
func (imp *Importer) checkStream(s cudart.Stream) error {
	dev, err := imp.rt.StreamDevice(imp.dev, s)
	switch {
	case errors.Is(err, cudart.ErrNotSupported):
		return nil
	case err != nil:
		return fmt.Errorf("stream %#x: %w", uintptr(s), err)
	case dev != imp.dev:
		return fmt.Errorf("%w: stream %#x is on device %d, the Importer on device %d", ErrStreamDevice, uintptr(s), dev, imp.dev)
	}
	return nil
}

// open is one try of Open.
func (imp *Importer) open(ctx context.Context, name string, s cudart.Stream) (*Mapping, error) {
	reply, err := imp.cl.Request(ctx, func(id uint64) wire.Message { return &wire.OpenMsg{ReqID: id, Name: name} }, true)
	if err != nil {
		return nil, fmt.Errorf("consumer: open %q: %w", name, err)
	}
	switch r := reply.(type) {
	case *wire.LeaseMsg:
		m, err := imp.adopt(r, name, s)
		if err != nil {
			return nil, fmt.Errorf("consumer: open %q: %w", name, err)
		}
		return m, nil
	case *wire.ErrorMsg:
		return nil, fmt.Errorf("consumer: open %q: %w", name, wire.ReplyErr(r))
	}
	imp.cl.Fail(wire.ProtocolErr("Open answered with %s", reply.Kind()))
	return nil, fmt.Errorf("consumer: open %q: %w", name, imp.cl.GoneOr(export.ErrProtocol))
}

// adopt turns a lease into a Mapping: s waits for the producer's writes, and the
// pointer is imported unless this Importer holds it already. On failure the lease is
// released.
func (imp *Importer) adopt(l *wire.LeaseMsg, name string, s cudart.Stream) (*Mapping, error) {
	m, err := imp.adoptLease(l, name, s, nil)
	if err != nil {
		imp.releaseUnused(l)
	}
	return m, err
}

// adoptLease is adopt without the giving back. waited, when not nil, holds the ready
// events s waited on already in this batch: one wait covers every lease that names
// the same event.
func (imp *Importer) adoptLease(l *wire.LeaseMsg, name string, s cudart.Stream, waited map[cudart.IpcEventHandle]bool) (*Mapping, error) {
	imp.adopting.RLock()
	defer imp.adopting.RUnlock()
	if imp.closing.Load() {
		return nil, export.ErrClosed
	}
	var ip *importedPool
	if l.Flags&wire.LeaseVMM == 0 {
		var err error
		if ip, err = imp.leasePool(l); err != nil {
			return nil, err
		}
	}
	if l.Flags&wire.LeaseReadyEvent != 0 && !waited[l.Ready] {
		if err := imp.awaitReady(l.Ready, s); err != nil {
			return nil, err
		}
		if waited != nil {
			waited[l.Ready] = true
		}
	}
	imp.mapMu.Lock()
	defer imp.mapMu.Unlock()
	if ip == nil {
		return imp.adoptVMM(l, name)
	}
	key := rangeKey{record: l.Record, offset: l.Offset, length: l.Length}
	if m := imp.heldMapping(key, l.LeaseID); m != nil {
		return m, nil
	}
	buf, err := imp.importBuffer(l, ip)
	if err != nil {
		return nil, err
	}
	buf.views++
	m := &Mapping{imp: imp, key: key, buf: buf, ptr: buf.ptr + cudart.DevicePtr(l.Offset), size: l.Length,
		name: name, meta: l.Meta, refs: 1, grants: map[uint64]uint32{l.LeaseID: 1}, onPeer: ip.onPeer, owner: ip.owner}
	imp.mappings[key] = m
	if m.onPeer && imp.exporterDead() {
		m.end(ErrMappingLost) // died as it was mapped; the watcher may have looked already
	}
	return m, nil
}

// leasePool is the imported pool that lease l (not of a VMM allocation) is on. It
// fails with [export.ErrProtocol] if the pool's handle never came, and with the
// pool's own error if its import failed.
func (imp *Importer) leasePool(l *wire.LeaseMsg) (*importedPool, error) {
	imp.mu.Lock()
	ip := imp.pools[l.PoolID]
	imp.mu.Unlock()
	if ip == nil {
		return nil, fmt.Errorf("%w: lease on pool %d, whose handle never came", export.ErrProtocol, l.PoolID)
	}
	if ip.err != nil {
		return nil, ip.err
	}
	return ip, nil
}

// awaitReady makes s wait for the exporter's ready event ready, opened once per
// Importer, unless it has completed. It fails with [export.ErrExporterGone] if the
// exporter is found dead at any step, else with what opening or waiting failed
// with; s then waits for nothing new.
//
// The exporter's event is asked about, and waited on, only while its process
// lives: a dead process's event may never complete, and a stream left waiting on
// it would hold the caller's work for good. Each step asks the kernel first; a
// death between the last question and the wait is the one window left, as narrow
// as one CUDA call. (An event opened before needs one question: nothing but a
// lookup comes between the lease and the next step.)
func (imp *Importer) awaitReady(ready cudart.IpcEventHandle, s cudart.Stream) error {
	ev, opened := imp.openedEvent(ready)
	if !opened {
		if imp.exporterDead() {
			return imp.goneErr("before the lease could be used")
		}
		var err error
		if ev, err = imp.readyEvent(ready); err != nil {
			if imp.exporterDead() {
				return imp.goneErr("as its ready event was opened")
			}
			return err
		}
	}
	if imp.exporterDead() {
		return imp.goneErr("before its ready event was waited on")
	}
	if wire.Completed(imp.rt, imp.dev, ev) {
		return nil
	}
	if imp.exporterDead() {
		return imp.goneErr("before its ready event was waited on")
	}
	if err := imp.rt.StreamWaitEvent(imp.dev, s, ev); err != nil {
		if imp.exporterDead() { // it died in the window: say so, not what the driver made of it
			return errors.Join(imp.goneErr("as its ready event was waited on"), err)
		}
		return fmt.Errorf("wait for the producer's writes: %w", err)
	}
	return nil
}

// importBuffer is this Importer's import of the buffer lease l is of, on pool ip,
// imported now if it holds none (after the frees of an earlier import of it have
// completed). Call with mapMu held. It fails with [export.ErrExporterGone] if the
// exporter died, else with what the import failed with; nothing is imported then.
func (imp *Importer) importBuffer(l *wire.LeaseMsg, ip *importedPool) (*imported, error) {
	if buf := imp.imports[l.Record]; buf != nil {
		return buf, nil
	}
	if _, ok := imp.freed[l.Record]; ok {
		if err := imp.awaitFrees(true); err != nil {
			return nil, err
		}
	}
	ptr, err := imp.rt.MemPoolImportPointer(imp.dev, ip.handle, l.Record)
	if err != nil {
		if imp.exporterDead() { // whatever the driver makes of a dead exporter's pool
			return nil, errors.Join(imp.goneErr("as its buffer was imported"), err)
		}
		return nil, fmt.Errorf("import buffer %d: %w", l.BufferID, err)
	}
	buf := &imported{record: l.Record, ptr: ptr}
	imp.imports[l.Record] = buf
	return buf, nil
}

// heldMapping is the Mapping of key, counted once more under lease id, if this Importer
// holds it; else nil. Call with mapMu held.
func (imp *Importer) heldMapping(key rangeKey, id uint64) *Mapping {
	m := imp.mappings[key]
	if m != nil {
		m.refs++
		m.grants[id]++
	}
	return m
}

// readyEvent opens a ready event once; it costs 0.29 ms on the measured host, far too
// much for every Open. Concurrent Opens of buffers published from one stream (of one
// name, say) share the one opening instead of each waiting for the lock around it.
func (imp *Importer) readyEvent(h cudart.IpcEventHandle) (cudart.Event, error) {
	if ev, ok := imp.openedEvent(h); ok {
		return ev, nil
	}
	v, err, _ := imp.eventOpens.Do(string(h[:]), func() (any, error) {
		if ev, ok := imp.openedEvent(h); ok {
			return ev, nil // opened between the look and the Do
		}
		ev, err := imp.rt.IpcOpenEventHandle(imp.dev, h)
		if err != nil {
			return cudart.Event(0), fmt.Errorf("open the ready event: %w", err)
		}
		imp.mu.Lock()
		imp.events[h] = ev
		imp.mu.Unlock()
		return ev, nil
	})
	return v.(cudart.Event), err
}

func (imp *Importer) openedEvent(h cudart.IpcEventHandle) (cudart.Event, bool) {
	imp.mu.Lock()
	defer imp.mu.Unlock()
	ev, ok := imp.events[h]
	return ev, ok
}

// ExporterPID is the exporter's process id, as it said in its Welcome.
func (imp *Importer) ExporterPID() int { return imp.cl.ExporterPID }

// Close frees every import still held (without waiting for the caller's streams:
// release mappings first to order their frees after your work), gives their leases
// back, tells the exporter goodbye and waits, until ctx ends, for it to close the
// connection, so that it is done with this process's release event before that is
// destroyed. It then destroys the events, stream and imported pools it made. With the
// exporter gone Close still completes, and returns nil. A second Close returns
// [export.ErrClosed].
func (imp *Importer) Close(ctx context.Context) error {
	if !imp.cl.Close() {
		return export.ErrClosed
	}
	imp.closing.Store(true)
	defer imp.endLife()
	var errs []error
	cue(imp.pushCue)
	select {
	case <-imp.pushDone:
	case <-ctx.Done():
		// Give-backs stuck on an exporter that stopped reading: the exporter ends
		// those leases when the connection closes (nothing was imported under them).
		imp.endLife()
		<-imp.pushDone
		errs = append(errs, fmt.Errorf("consumer: close: pushed leases not released (the exporter ends them with the connection): %w", ctx.Err()))
	}
	// Adoptions under way finish first (a few CUDA calls); later ones fail.
	imp.adopting.Lock()
	defer imp.adopting.Unlock()

	imp.mapMu.Lock()
	kept := map[*imported]bool{} // imports whose free failed: their leases stay held
	for _, buf := range slices.Collect(maps.Values(imp.imports)) {
		if err := imp.unmap(buf, 0, false); err != nil {
			errs = append(errs, fmt.Errorf("consumer: close: free an import: %w", err))
			kept[buf] = imp.imports[buf.record] != nil
		}
	}
	if err := imp.closeVMM(); err != nil {
		errs = append(errs, err)
	}
	grants := map[uint64]uint32{}
	for _, m := range imp.mappings {
		m.refs = 0
		m.end(errReleasedCause)
		if !kept[m.buf] {
			for id, n := range m.grants {
				grants[id] += n
			}
		}
		m.grants = nil
	}
	clear(imp.mappings)
	imp.mapMu.Unlock()
	errs = append(errs, imp.releaseGrants(ctx, "held at Close", grants, 0, nil))
	if err := imp.cl.HangUp(ctx); err != nil {
		errs = append(errs, fmt.Errorf("consumer: close: %w", err))
	}
	imp.unregister()
	imp.destroyResources(imp.cl.Gone())
	imp.endLife() // stops the watch on the exporter's process
	if imp.watch.proc != nil {
		_ = imp.watch.proc.Close() // cleanup: nothing is left to do if closing fails
	}
	return errors.Join(errs...)
}
