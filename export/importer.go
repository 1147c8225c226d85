package export

import (
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"os"
	"reflect"
	"sync"
	"syscall"
	"time"

	"github.com/cudapool/cudapool/cudart"
)

// Importer is a consumer's connection to one exporter: it opens published buffers as
// Mappings on its device. Its methods are safe for concurrent use; many goroutines may
// Open and Release at once over its one connection.
type Importer struct {
	rt     cudart.Runtime // nil for QueryState's connection, which takes no leases
	dev    int
	c      *conn
	log    *slog.Logger
	remote bool // a byte stream: no descriptors, no IPC events
	opts   options
	// exporterPID is what the exporter said in Welcome.
	exporterPID int
	devUUID     cudart.UUID

	relStream cudart.Stream // where imports are freed
	// relEvent is recorded on relStream after every free and waited on by the
	// exporter before it frees; 0 on a byte stream, where frees are synchronised.
	relEvent cudart.Event
	relIPC   cudart.IpcEventHandle
	// orderEvent carries the caller's stream, as of Release, over to relStream.
	orderEvent cudart.Event

	registryKey any // the entry this Importer holds in importers, nil if none

	mu     sync.Mutex
	closed bool
	// bye: the exporter is closing; it takes no more opens but still ends leases.
	bye bool
	// down says why the connection ended, nil while it carries requests.
	down    error
	nextReq uint64
	pending map[uint64]chan message
	states  map[uint64][]byte // State replies being assembled
	pools   map[uint64]*importedPool
	events  map[cudart.IpcEventHandle]cudart.Event // opened ready events
	pushes  []*push
	pushCue chan struct{}

	// mapMu serialises every import and free of a pointer with the table, so that a
	// pointer is never imported again while its free may still be pending (FACTS 4).
	mapMu    sync.Mutex
	mappings map[cudart.PtrExportData]*Mapping
	freed    map[cudart.PtrExportData]struct{} // freed since relEvent last completed

	readerDone chan struct{}
	pushDone   chan struct{}
}

type importedPool struct {
	handle cudart.MemPool
	err    error // the import failed; leases on the pool fail with it
}

// Mapping is a buffer of another process imported into this one. The same buffer
// opened again through the same Importer is the same Mapping, counted once more; its
// import is freed when the last reference is released.
type Mapping struct {
	imp  *Importer
	key  cudart.PtrExportData
	ptr  cudart.DevicePtr
	size uint64
	name string
	// Guarded by imp.mapMu.
	refs   int
	grants map[uint64]uint32 // lease id -> grants of it this mapping answers for
}

// Ptr is the buffer's address in this process.
func (m *Mapping) Ptr() cudart.DevicePtr { return m.ptr }

// Size is the buffer's size in bytes.
func (m *Mapping) Size() uint64 { return m.size }

// Name is the name the buffer was first opened (or pushed) under.
func (m *Mapping) Name() string { return m.name }

// importers holds one entry per (runtime, exporter process) with a live Importer: two
// Importers of one process importing the same pool would alias each other's pointers
// (FACTS 4), so the second Dial is refused.
var importers sync.Map

type importerKey struct {
	rt  cudart.Runtime
	pid int
}

// Dial connects to the exporter listening at path, for buffers to be used on device
// of rt. It fails with ErrRefused (and the exporter's reason) if the exporter does not
// admit this process, ErrVersionMismatch if it speaks another protocol version, and
// ErrExporterGone if nothing listens at path. One process should hold one Importer per
// exporter and runtime: a second fails with ErrDuplicateImporter. On failure nothing
// is left behind.
func Dial(ctx context.Context, path string, rt cudart.Runtime, device int, opts ...Option) (*Importer, error) {
	if rt == nil {
		return nil, errors.New("export: Dial needs a runtime")
	}
	return dial(ctx, path, rt, device, applyOptions(opts))
}

// DialConn is Dial over a connection the caller made, such as TCP to another node of
// the same NVLink domain. On anything but a Unix socket only FABRIC pools can be
// opened, the exporter waits for the producer's writes before it answers, and Release
// waits for the import's free before it tells the exporter: IPC events do not cross
// hosts. DialConn owns nc from the call on, and closes it on failure.
func DialConn(ctx context.Context, nc net.Conn, rt cudart.Runtime, device int, opts ...Option) (*Importer, error) {
	if rt == nil {
		nc.Close()
		return nil, errors.New("export: DialConn needs a runtime")
	}
	return handshake(ctx, nc, rt, device, applyOptions(opts))
}

func dial(ctx context.Context, path string, rt cudart.Runtime, device int, o options) (*Importer, error) {
	var d net.Dialer
	nc, err := d.DialContext(ctx, "unix", path)
	if err != nil {
		if errors.Is(err, syscall.ECONNREFUSED) || errors.Is(err, syscall.ENOENT) {
			return nil, fmt.Errorf("%w: nothing listens at %s: %w", ErrExporterGone, path, err)
		}
		return nil, fmt.Errorf("export: dial %s: %w", path, err)
	}
	return handshake(ctx, nc, rt, device, o)
}

func handshake(ctx context.Context, nc net.Conn, rt cudart.Runtime, device int, o options) (_ *Importer, err error) {
	imp := &Importer{
		rt: rt, dev: device, c: newConn(nc, true), log: o.log, opts: o,
		pending: map[uint64]chan message{}, states: map[uint64][]byte{}, pools: map[uint64]*importedPool{},
		events: map[cudart.IpcEventHandle]cudart.Event{}, pushCue: make(chan struct{}, 1),
		mappings: map[cudart.PtrExportData]*Mapping{}, freed: map[cudart.PtrExportData]struct{}{},
		readerDone: make(chan struct{}), pushDone: make(chan struct{}),
	}
	imp.remote = !imp.c.canPassFDs()
	defer func() {
		if err != nil {
			nc.Close()
			imp.unregister()
			imp.destroyResources()
		}
	}()
	h := hello{Version: ProtocolVersion, PID: uint32(os.Getpid())}
	if rt != nil {
		if err := imp.makeResources(); err != nil {
			return nil, err
		}
		h.Flags = helloLeases
		h.Device = imp.devUUID
		h.HandleTypes = uint32(cudart.HandleTypeFabric)
		if !imp.remote {
			h.HandleTypes |= uint32(cudart.HandleTypePosixFD)
			h.Flags |= helloReleaseEvent
			h.ReleaseEvent = imp.relIPC
		}
	}
	deadline := time.Now().Add(o.handshake)
	if d, ok := ctx.Deadline(); ok && d.Before(deadline) {
		deadline = d
	}
	nc.SetDeadline(deadline)
	stop := context.AfterFunc(ctx, func() { nc.SetDeadline(time.Unix(1, 0)) })
	defer stop()
	if err := imp.c.send(ctx, &h, -1); err != nil {
		return nil, ctxOr(ctx, err)
	}
	m, fd, err := imp.c.recv()
	if fd >= 0 {
		closeFDs([]int{fd}) // a pool handle before Welcome: refused below
	}
	if err != nil {
		if errors.Is(err, io.EOF) {
			return nil, fmt.Errorf("%w: the exporter closed the connection during the handshake", ErrExporterGone)
		}
		return nil, ctxOr(ctx, fmt.Errorf("export: handshake: %w", err))
	}
	switch m := m.(type) {
	case *refused:
		if m.Version != ProtocolVersion {
			return nil, fmt.Errorf("%w: exporter speaks protocol version %d, this side speaks %d: %s", ErrVersionMismatch, m.Version, ProtocolVersion, m.Reason)
		}
		return nil, fmt.Errorf("%w: %s", ErrRefused, m.Reason)
	case *welcome:
		if m.Version != ProtocolVersion {
			return nil, fmt.Errorf("%w: exporter speaks protocol version %d, this side speaks %d", ErrVersionMismatch, m.Version, ProtocolVersion)
		}
		imp.exporterPID = int(m.PID)
	default:
		return nil, fmt.Errorf("%w: the exporter answered Hello with %s", ErrProtocol, m.kind())
	}
	if err := imp.register(); err != nil {
		return nil, err
	}
	if !stop() {
		return nil, ctx.Err()
	}
	nc.SetDeadline(time.Time{})
	go imp.read()
	go imp.deliverPushes()
	return imp, nil
}

func ctxOr(ctx context.Context, err error) error {
	if ctx.Err() != nil {
		return fmt.Errorf("export: handshake: %w", ctx.Err())
	}
	return err
}

// register claims this process's one Importer slot for the exporter.
func (imp *Importer) register() error {
	if imp.rt == nil || imp.remote || !reflect.TypeOf(imp.rt).Comparable() {
		return nil
	}
	k := importerKey{imp.rt, imp.exporterPID}
	if _, loaded := importers.LoadOrStore(k, imp); loaded {
		return fmt.Errorf("%w: exporter pid %d", ErrDuplicateImporter, imp.exporterPID)
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
		return fmt.Errorf("export: device %d: %w", dev, err)
	}
	if imp.relStream, err = rt.StreamCreate(dev, cudart.StreamNonBlocking); err != nil {
		return fmt.Errorf("export: release stream: %w", err)
	}
	if imp.orderEvent, err = rt.EventCreate(dev, cudart.EventDisableTiming); err != nil {
		return fmt.Errorf("export: release ordering event: %w", err)
	}
	if imp.remote {
		return nil
	}
	if imp.relEvent, err = rt.EventCreate(dev, cudart.EventIPC); err != nil {
		return fmt.Errorf("export: release event: %w", err)
	}
	// Recorded once before any free, so the exporter never waits on an event that was
	// never recorded.
	if err = rt.EventRecord(dev, imp.relEvent, imp.relStream); err != nil {
		return fmt.Errorf("export: release event: %w", err)
	}
	if imp.relIPC, err = rt.IpcGetEventHandle(dev, imp.relEvent); err != nil {
		return fmt.Errorf("export: release event handle: %w", err)
	}
	return nil
}

// destroyResources destroys what makeResources and the connection's life created:
// opened ready events, imported pools, the release event and stream. Errors are
// logged: they leave nothing the caller could act on.
func (imp *Importer) destroyResources() {
	if imp.rt == nil {
		return
	}
	rt, dev := imp.rt, imp.dev
	logErr := func(what string, err error) {
		if err != nil {
			imp.log.Warn("export: importer cleanup", "what", what, "err", err)
		}
	}
	imp.mu.Lock()
	events, pools, gone := imp.events, imp.pools, imp.down != nil || imp.bye
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
	if imp.relStream != 0 {
		logErr("release stream sync", rt.StreamSynchronize(dev, imp.relStream))
	}
	for _, ev := range []cudart.Event{imp.relEvent, imp.orderEvent} {
		if ev != 0 {
			logErr("event", rt.EventDestroy(dev, ev))
		}
	}
	if imp.relStream != 0 {
		logErr("release stream", rt.StreamDestroy(dev, imp.relStream))
	}
	imp.relEvent, imp.orderEvent, imp.relStream = 0, 0, 0
}

// read is the connection's one reader: it imports pools as their handles arrive and
// hands every reply to the request waiting for it.
func (imp *Importer) read() {
	defer close(imp.readerDone)
	for {
		m, fd, err := imp.c.recv()
		if err != nil {
			imp.fail(err)
			return
		}
		switch m := m.(type) {
		case *poolHandle:
			imp.importPool(m, fd)
		case *lease:
			if !imp.deliver(m.ReqID, m) {
				// Its request was given up on. Not sent from here: a reader blocked on
				// a full socket while the exporter blocks writing to it would deadlock.
				go imp.giveBack(m)
			}
		case *released:
			imp.deliver(m.ReqID, m)
		case *errorMsg:
			imp.deliver(m.ReqID, m)
		case *stateChunk:
			imp.assembleState(m)
		case *push:
			imp.mu.Lock()
			imp.pushes = append(imp.pushes, m)
			imp.mu.Unlock()
			cue(imp.pushCue)
		case *bye:
			imp.mu.Lock()
			imp.bye = true
			imp.mu.Unlock()
		default:
			imp.fail(protocolErr("unexpected %s from an exporter", m.kind()))
			return
		}
	}
}

// fail ends the connection: every waiting request and every later Open fails with
// ErrExporterGone; mappings stay usable until released.
func (imp *Importer) fail(err error) {
	if errors.Is(err, ErrProtocol) {
		imp.log.Warn("export: closing the exporter's connection", "exporter", imp.exporterPID, "reason", err)
	}
	imp.c.close()
	imp.mu.Lock()
	defer imp.mu.Unlock()
	switch {
	case imp.down != nil:
	case errors.Is(err, io.EOF) || errors.Is(err, net.ErrClosed):
		imp.down = fmt.Errorf("%w: the connection closed", ErrExporterGone)
	default:
		imp.down = fmt.Errorf("%w: %w", ErrExporterGone, err)
	}
	for id, ch := range imp.pending {
		close(ch)
		delete(imp.pending, id)
	}
	imp.states = map[uint64][]byte{}
}

// deliver hands a reply to its request; false if no request waits for it.
func (imp *Importer) deliver(reqID uint64, m message) bool {
	imp.mu.Lock()
	ch := imp.pending[reqID]
	delete(imp.pending, reqID)
	imp.mu.Unlock()
	if ch == nil {
		return false
	}
	ch <- m
	return true
}

func (imp *Importer) assembleState(m *stateChunk) {
	imp.mu.Lock()
	_, waiting := imp.pending[m.ReqID]
	body := append(imp.states[m.ReqID], m.JSON...)
	if !waiting || len(body) > maxStateBytes {
		delete(imp.states, m.ReqID)
		imp.mu.Unlock()
		if waiting {
			imp.deliver(m.ReqID, &errorMsg{Code: codeExporter, Text: fmt.Sprintf("%v: State larger than %d bytes", ErrProtocol, maxStateBytes)})
		}
		return
	}
	if m.Flags&stateMore != 0 {
		imp.states[m.ReqID] = body
		imp.mu.Unlock()
		return
	}
	delete(imp.states, m.ReqID)
	imp.mu.Unlock()
	imp.deliver(m.ReqID, &stateChunk{ReqID: m.ReqID, JSON: body})
}

// importPool imports a pool whose handle arrived, and grants this Importer's device
// access when the pool lives on another GPU. fd, if any, is closed here: the driver
// does not keep it.
func (imp *Importer) importPool(m *poolHandle, fd int) {
	if fd >= 0 {
		defer closeFDs([]int{fd})
	}
	ip := &importedPool{}
	if imp.rt == nil {
		ip.err = ErrNoLeases
	} else {
		ip.handle, ip.err = imp.rt.MemPoolImportFromShareableHandle(imp.dev, cudart.ShareableHandle{Type: m.HandleType, FD: fd, Fabric: m.Fabric})
		if ip.err == nil && m.Device != imp.devUUID {
			access := []cudart.AccessDesc{{Location: cudart.DeviceLocation(imp.dev), Flags: cudart.AccessReadWrite}}
			if err := imp.rt.MemPoolSetAccess(imp.dev, ip.handle, access); err != nil {
				imp.rt.MemPoolDestroy(imp.dev, ip.handle)
				ip.err = fmt.Errorf("grant device %d access to the pool on %v: %w", imp.dev, m.Device, err)
			}
		}
		if ip.err != nil {
			ip.err = fmt.Errorf("export: import pool %d (%v): %w", m.PoolID, m.HandleType, ip.err)
		}
	}
	imp.mu.Lock()
	old := imp.pools[m.PoolID]
	imp.pools[m.PoolID] = ip
	imp.mu.Unlock()
	if old != nil && old.err == nil {
		// The exporter sends each pool once; a second handle replaces the first.
		imp.log.Warn("export: exporter sent a pool handle twice", "pool", m.PoolID)
		imp.rt.MemPoolDestroy(imp.dev, old.handle)
	}
}

func cue(ch chan struct{}) {
	select {
	case ch <- struct{}{}:
	default:
	}
}

// request sends the message build makes for a fresh request id and waits for the
// reply. A new request (Open, StateRequest) is refused once the Importer is closed or
// the exporter said Bye; a Release only once the connection is down. A late reply to
// a request given up on is dealt with by the reader.
func (imp *Importer) request(ctx context.Context, build func(reqID uint64) message, isNew bool) (message, error) {
	imp.mu.Lock()
	var refuse error
	switch {
	case imp.down != nil:
		refuse = imp.down
	case isNew && imp.closed:
		refuse = ErrClosed
	case isNew && imp.bye:
		refuse = fmt.Errorf("%w: it is closing", ErrExporterGone)
	}
	if refuse != nil {
		imp.mu.Unlock()
		return nil, refuse
	}
	imp.nextReq++
	id := imp.nextReq
	ch := make(chan message, 1)
	imp.pending[id] = ch
	imp.mu.Unlock()
	if err := imp.c.send(ctx, build(id), -1); err != nil {
		imp.forget(id) // send closed the connection if it wrote part of the frame
		return nil, imp.goneOr(err)
	}
	select {
	case m, ok := <-ch:
		if !ok {
			return nil, imp.goneOr(ErrExporterGone)
		}
		return m, nil
	case <-ctx.Done():
		if m, ok := imp.forget(id); ok {
			if l, isLease := m.(*lease); isLease {
				imp.giveBack(l)
			}
		}
		return nil, ctx.Err()
	}
}

// forget drops the request id; if its reply had arrived meanwhile it is returned.
func (imp *Importer) forget(id uint64) (message, bool) {
	imp.mu.Lock()
	ch := imp.pending[id]
	delete(imp.pending, id)
	imp.mu.Unlock()
	if ch == nil {
		return nil, false
	}
	select {
	case m, ok := <-ch:
		return m, ok
	default:
		return nil, false
	}
}

func (imp *Importer) goneOr(err error) error {
	imp.mu.Lock()
	defer imp.mu.Unlock()
	if imp.down != nil {
		return imp.down
	}
	return err
}

// replyErr turns an Error frame into the error it stands for.
func replyErr(m *errorMsg) error {
	return &RemoteError{Code: codeErrs[m.Code], Text: m.Text}
}

// RemoteError is a request the exporter refused: Text is the exporter's message, and
// errors.Is matches the sentinel it stands for (ErrUnknownName, ErrStaleLease, ...).
type RemoteError struct {
	Code error
	Text string
}

func (e *RemoteError) Error() string { return "exporter: " + e.Text }
func (e *RemoteError) Unwrap() error { return e.Code }

// giveBack returns a lease this process will not use, without waiting for the answer.
func (imp *Importer) giveBack(l *lease) {
	err := imp.c.send(context.Background(), &release{LeaseID: l.LeaseID, Count: 1, Flags: releaseNothingImported}, -1)
	if err != nil {
		imp.log.Debug("export: could not give a lease back; the exporter ends it when the connection closes", "err", err)
	}
}

// Open leases the buffer published under name and returns it mapped into this
// process. Work queued on s after Open returns sees the producer's writes that came
// before Publish; the host does not wait. Opening a buffer this Importer already holds
// returns the same Mapping, counted once more; each Open needs its Release.
//
// It fails with ErrUnknownName, ErrBufferGone (the producer freed it), ErrHandleType,
// ErrExporterGone once the exporter left, ErrClosed after Close, or ctx's error. On
// failure nothing is held.
func (imp *Importer) Open(ctx context.Context, name string, s cudart.Stream) (*Mapping, error) {
	if err := checkName(name); err != nil {
		return nil, err
	}
	if imp.rt == nil {
		return nil, ErrNoLeases
	}
	reply, err := imp.request(ctx, func(id uint64) message { return &open{ReqID: id, Name: name} }, true)
	if err != nil {
		return nil, fmt.Errorf("export: open %q: %w", name, err)
	}
	switch r := reply.(type) {
	case *lease:
		m, err := imp.adopt(r, name, s)
		if err != nil {
			return nil, fmt.Errorf("export: open %q: %w", name, err)
		}
		return m, nil
	case *errorMsg:
		return nil, fmt.Errorf("export: open %q: %w", name, replyErr(r))
	}
	imp.fail(protocolErr("Open answered with %s", reply.kind()))
	return nil, fmt.Errorf("export: open %q: %w", name, imp.goneOr(ErrProtocol))
}

// adopt turns a lease into a Mapping: s waits for the producer's writes, and the
// pointer is imported unless this Importer holds it already. On failure the lease is
// given back.
func (imp *Importer) adopt(l *lease, name string, s cudart.Stream) (*Mapping, error) {
	m, err := imp.adoptLease(l, name, s)
	if err != nil {
		imp.giveBack(l)
	}
	return m, err
}

func (imp *Importer) adoptLease(l *lease, name string, s cudart.Stream) (*Mapping, error) {
	imp.mu.Lock()
	ip := imp.pools[l.PoolID]
	imp.mu.Unlock()
	if ip == nil {
		return nil, fmt.Errorf("%w: lease on pool %d, whose handle never came", ErrProtocol, l.PoolID)
	}
	if ip.err != nil {
		return nil, ip.err
	}
	if l.Flags&leaseReadyEvent != 0 {
		ev, err := imp.readyEvent(l.Ready)
		if err != nil {
			return nil, err
		}
		if !completed(imp.rt, imp.dev, ev) {
			if err := imp.rt.StreamWaitEvent(imp.dev, s, ev); err != nil {
				return nil, fmt.Errorf("wait for the producer's writes: %w", err)
			}
		}
	}
	imp.mapMu.Lock()
	defer imp.mapMu.Unlock()
	if m := imp.mappings[l.Record]; m != nil {
		m.refs++
		m.grants[l.LeaseID]++
		return m, nil
	}
	if _, ok := imp.freed[l.Record]; ok {
		if err := imp.settleFrees(true); err != nil {
			return nil, err
		}
	}
	ptr, err := imp.rt.MemPoolImportPointer(imp.dev, ip.handle, l.Record)
	if err != nil {
		return nil, fmt.Errorf("import buffer %d: %w", l.BufferID, err)
	}
	m := &Mapping{imp: imp, key: l.Record, ptr: ptr, size: l.Size, name: name, refs: 1, grants: map[uint64]uint32{l.LeaseID: 1}}
	imp.mappings[l.Record] = m
	return m, nil
}

// readyEvent opens a ready event once; it costs 0.29 ms on the measured host, far too
// much for every Open.
func (imp *Importer) readyEvent(h cudart.IpcEventHandle) (cudart.Event, error) {
	imp.mu.Lock()
	defer imp.mu.Unlock()
	if ev, ok := imp.events[h]; ok {
		return ev, nil
	}
	ev, err := imp.rt.IpcOpenEventHandle(imp.dev, h)
	if err != nil {
		return 0, fmt.Errorf("open the ready event: %w", err)
	}
	imp.events[h] = ev
	return ev, nil
}

// settleFrees makes sure every free issued so far has completed, so that a pointer
// freed by this process can be imported again without the pending free unmapping the
// new import. wait: block until it has; otherwise only forget them if they have.
// Call with mapMu held.
func (imp *Importer) settleFrees(wait bool) error {
	done, err := imp.rt.EventQuery(imp.dev, imp.relEvent)
	if err == nil && !done && wait {
		err = imp.rt.StreamSynchronize(imp.dev, imp.relStream)
		done = err == nil
	}
	if err != nil {
		return fmt.Errorf("wait for this process's earlier free: %w", err)
	}
	if done {
		clear(imp.freed)
	}
	return nil
}

// Release gives back one reference. The last one frees the import on the Importer's
// release stream once the work queued on s before the call has completed, and tells
// the exporter, whose own free of the buffer then waits for that free; the host does
// not wait for the GPU. After Release the pointer must not be used by work queued
// later. If the exporter is gone, the import is freed all the same and Release
// returns nil: there is no one to tell. Releasing more often than opening fails with
// ErrReleased.
func (m *Mapping) Release(ctx context.Context, s cudart.Stream) error {
	imp := m.imp
	imp.mapMu.Lock()
	if m.refs == 0 {
		imp.mapMu.Unlock()
		return fmt.Errorf("%w: %q", ErrReleased, m.name)
	}
	if m.refs--; m.refs > 0 {
		imp.mapMu.Unlock()
		return nil
	}
	grants, err := imp.unmap(m, s, true)
	imp.mapMu.Unlock()
	if err != nil {
		return fmt.Errorf("export: release %q: %w", m.name, err)
	}
	return imp.returnGrants(ctx, m.name, grants)
}

// unmap frees m's import after the work queued on s (if ordered) and forgets m. On
// failure m stays mapped (its references already gone) and its lease held, so the
// exporter cannot free what this process may still map. Call with mapMu held.
func (imp *Importer) unmap(m *Mapping, s cudart.Stream, ordered bool) (map[uint64]uint32, error) {
	rt, dev := imp.rt, imp.dev
	if ordered {
		if err := rt.EventRecord(dev, imp.orderEvent, s); err != nil {
			return nil, err
		}
		if err := rt.StreamWaitEvent(dev, imp.relStream, imp.orderEvent); err != nil {
			return nil, err
		}
	}
	if err := rt.FreeAsync(dev, m.ptr, imp.relStream); err != nil {
		return nil, err
	}
	delete(imp.mappings, m.key)
	grants := m.grants
	m.grants = nil
	if imp.relEvent == 0 {
		// The exporter cannot wait on an event of this host: the free must be done
		// before it hears of it.
		return grants, rt.StreamSynchronize(dev, imp.relStream)
	}
	if err := rt.EventRecord(dev, imp.relEvent, imp.relStream); err != nil {
		return grants, err
	}
	imp.freed[m.key] = struct{}{}
	if len(imp.freed) > 256 {
		imp.settleFrees(false)
	}
	return grants, nil
}

// returnGrants tells the exporter that leases are released and waits for it to agree.
// With the exporter gone there is nothing to tell, and that is not an error.
func (imp *Importer) returnGrants(ctx context.Context, name string, grants map[uint64]uint32) error {
	var errs []error
	for id, n := range grants {
		reply, err := imp.request(ctx, func(req uint64) message { return &release{ReqID: req, LeaseID: id, Count: n} }, false)
		switch r := reply.(type) {
		case nil:
			if errors.Is(err, ErrExporterGone) {
				continue
			}
		case *released:
			continue
		case *errorMsg:
			err = replyErr(r)
		default:
			err = fmt.Errorf("%w: Release answered with %s", ErrProtocol, r.kind())
		}
		errs = append(errs, fmt.Errorf("export: release %q: %w", name, err))
	}
	return errors.Join(errs...)
}

// deliverPushes imports pushed buffers and hands them to the push handler, one at a
// time, until Close.
func (imp *Importer) deliverPushes() {
	defer close(imp.pushDone)
	for {
		imp.mu.Lock()
		batch := imp.pushes
		imp.pushes = nil
		closed := imp.closed
		imp.mu.Unlock()
		for _, p := range batch {
			if closed || imp.opts.pushHandler == nil || imp.rt == nil {
				imp.giveBack(&p.lease)
				continue
			}
			m, err := imp.adopt(&p.lease, p.Name, imp.opts.pushStream)
			if err != nil {
				imp.log.Warn("export: a pushed buffer could not be imported", "name", p.Name, "err", err)
				continue
			}
			imp.opts.pushHandler(p.Name, m)
		}
		if closed {
			return
		}
		<-imp.pushCue
	}
}

func (imp *Importer) queryState(ctx context.Context) ([]byte, error) {
	reply, err := imp.request(ctx, func(id uint64) message { return &stateRequest{ReqID: id} }, true)
	if err != nil {
		return nil, fmt.Errorf("export: state: %w", err)
	}
	switch r := reply.(type) {
	case *stateChunk:
		return r.JSON, nil
	case *errorMsg:
		return nil, fmt.Errorf("export: state: %w", replyErr(r))
	}
	return nil, fmt.Errorf("%w: StateRequest answered with %s", ErrProtocol, reply.kind())
}

// ExporterPID is the exporter's process id, as it said in its Welcome.
func (imp *Importer) ExporterPID() int { return imp.exporterPID }

// Close frees every import still held (without waiting for the caller's streams:
// release mappings first to order their frees after your work), gives their leases
// back, tells the exporter goodbye and waits, until ctx ends, for it to close the
// connection, so that it is done with this process's release event before that is
// destroyed. It then destroys the events, stream and imported pools it made. With the
// exporter gone Close still completes, and returns nil. A second Close returns
// ErrClosed.
func (imp *Importer) Close(ctx context.Context) error {
	imp.mu.Lock()
	if imp.closed {
		imp.mu.Unlock()
		return ErrClosed
	}
	imp.closed = true
	imp.mu.Unlock()
	cue(imp.pushCue)
	<-imp.pushDone

	var errs []error
	if imp.rt != nil {
		imp.mapMu.Lock()
		held := make([]*Mapping, 0, len(imp.mappings))
		for _, m := range imp.mappings {
			held = append(held, m)
		}
		grants := map[uint64]uint32{}
		for _, m := range held {
			m.refs = 0
			g, err := imp.unmap(m, 0, false)
			if err != nil {
				errs = append(errs, fmt.Errorf("export: close: free %q: %w", m.name, err))
			}
			for id, n := range g {
				grants[id] += n
			}
		}
		imp.mapMu.Unlock()
		errs = append(errs, imp.returnGrants(ctx, "held at Close", grants))
	}
	// Bye, then wait for the exporter to hang up: it may still be ending leases as of
	// the release event.
	if err := imp.c.send(ctx, &bye{}, -1); err == nil {
		select {
		case <-imp.readerDone:
		case <-ctx.Done():
			errs = append(errs, fmt.Errorf("export: close: the exporter did not hang up: %w", ctx.Err()))
		}
	}
	imp.c.close()
	<-imp.readerDone
	imp.unregister()
	imp.destroyResources()
	return errors.Join(errs...)
}
