package consumer

import (
	"context"
	"errors"
	"fmt"
	"sync"

	"github.com/cudapool/cudapool/cudart"
	"github.com/cudapool/cudapool/export"
	"github.com/cudapool/cudapool/export/internal/wire"
	"github.com/cudapool/cudapool/pool"
)

// Mapping is a published range of another process's buffer, imported into this one.
// The same range opened again through the same [Importer] is the same Mapping, counted
// once more. Mappings of ranges of one buffer share one import of the whole buffer
// (FACTS 4), which is freed when the last reference to any of them is released.
type Mapping struct {
	imp *Importer
	key rangeKey
	buf *imported
	// vmm is the VMM allocation's import a Mapping of the VMM route views; buf is nil.
	vmm  *vmmImport
	ptr  cudart.DevicePtr
	size uint64
	name string
	meta []byte
	// onPeer: on another GPU than its exporter's, so lost with the exporter.
	onPeer bool
	// owner is the exporter's device, as importedPool.owner.
	owner int
	// life ends when the Mapping must not be used any more (liveness.go).
	life mappingLife
	// local copy is the memory of a Mapping made WithLocalCopy, this process's own, from
	// localCopyFrom; nil for an import.
	localCopy     *pool.Buffer
	localCopyFrom pool.Allocator
	// Guarded by imp.mapMu.
	refs   int
	grants map[uint64]uint32 // lease id -> grants of it this mapping answers for
}

// rangeKey names a Mapping: a range of the buffer that record imports, or (record
// zero) of the VMM allocation alloc.
type rangeKey struct {
	record         cudart.PtrExportData
	alloc          uint64
	offset, length uint64
}

// imported is one buffer imported into this process, whole, and how many Mappings
// of its ranges are live. Guarded by Importer.mapMu.
type imported struct {
	record cudart.PtrExportData
	ptr    cudart.DevicePtr
	views  int
	// revoked: the exporter asked for the import back (Revoke) while a Mapping used
	// it; the last Release frees it and says Revoked.
	revoked bool
}

// Ptr is the range's address in this process.
func (m *Mapping) Ptr() cudart.DevicePtr { return m.ptr }

// Size is the range's length in bytes.
func (m *Mapping) Size() uint64 { return m.size }

// Name is the name the range was first opened (or pushed) under.
func (m *Mapping) Name() string { return m.name }

// Meta is the metadata published with the range (producer.WithMeta), nil if none. It is the
// [Mapping]'s own: do not modify it.
func (m *Mapping) Meta() []byte { return m.meta }

// awaitFrees makes sure every free issued so far has completed, so that a pointer
// freed by this process can be imported again without the pending free unmapping the
// new import. wait: block until it has; otherwise only forget them if they have.
// Call with mapMu held.
func (imp *Importer) awaitFrees(wait bool) error {
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

// Release gives back one reference. The last one frees the import on the [Importer]'s
// release stream once the work queued on s before the call has completed (unless a
// [Mapping] of another range of the buffer still holds it), and tells the exporter,
// whose own free of the buffer then waits for that free; the host does not wait for
// the GPU. After Release the pointer must not be used by work queued
// later. If the exporter is gone, the import is freed all the same and Release
// returns nil: there is no one to tell. Releasing more often than opening fails with
// [ErrReleased], and a stream of another device than the Importer's with
// [ErrStreamDevice], as Open does; neither releases anything.
//
// On the vmm route the import is the allocation's range, which the last Release of its
// last Mapping unmaps once the work queued on s, and on the streams its other Mappings
// were last released on, has run: the host waits for that work there, as the driver
// must not unmap memory in use.
func (m *Mapping) Release(ctx context.Context, s cudart.Stream) error {
	imp := m.imp
	if err := imp.checkStream(s); err != nil {
		return fmt.Errorf("consumer: release %q: %w", m.name, err)
	}
	imp.mapMu.Lock()
	if m.refs == 0 {
		imp.mapMu.Unlock()
		return fmt.Errorf("%w: %q", ErrReleased, m.name)
	}
	if m.refs--; m.refs > 0 {
		imp.mapMu.Unlock()
		return nil
	}
	if m.localCopy != nil {
		err := imp.freeLocalCopy(m, s)
		m.finishRelease(err == nil)
		imp.mapMu.Unlock()
		return err
	}
	if m.vmm != nil {
		return imp.releaseVMM(ctx, m, s)
	}
	buf := m.buf
	if imp.retain && buf.views == 1 && !buf.revoked {
		grants, err := imp.keep(m, s)
		m.finishRelease(err == nil)
		imp.mapMu.Unlock()
		if err != nil {
			return fmt.Errorf("consumer: release %q: %w", m.name, err)
		}
		return imp.releaseRetained(ctx, m.name, buf, grants)
	}
	revoked := buf.revoked && buf.views == 1
	grants, freed, err := imp.unview(m, s, true)
	if err == nil && freed {
		err = imp.recordFrees()
	}
	m.finishRelease(err == nil || imp.mappings[m.key] != m) // a failed free leaves m mapped
	imp.mapMu.Unlock()
	if err != nil {
		return fmt.Errorf("consumer: release %q: %w", m.name, err)
	}
	err = imp.releaseGrants(ctx, m.name, grants, 0, nil)
	if revoked {
		imp.sendRevoked(buf.record)
	}
	return err
}

// finishRelease ends m's context after its last Release, if that let go of it; if it did
// not (nothing was freed, the lease is held), it gives the reference back, so that
// Release can be tried again. Call with mapMu held.
func (m *Mapping) finishRelease(released bool) {
	if released {
		m.end(errReleasedCause)
		return
	}
	m.refs++
}

// unview forgets m, whose last reference is gone, and returns the grants it answered
// for. The release stream is ordered after the work queued on s (if ordered; else it
// is ordered already), and the import of its buffer freed there if no other Mapping
// of the buffer holds it
// (freed says so: the caller then records the release event, recordFrees, before it
// returns the grants); until then those Mappings' leases keep the buffer alive. Call
// with mapMu held.
func (imp *Importer) unview(m *Mapping, s cudart.Stream, ordered bool) (grants map[uint64]uint32, freed bool, err error) {
	if m.buf.views > 1 {
		// The import lives on, but its free, whichever Release issues it, must follow
		// this Mapping's use on s too.
		if ordered {
			if err := imp.orderRelease(s); err != nil {
				return nil, false, err
			}
		}
		m.buf.views--
		delete(imp.mappings, m.key)
		grants := m.grants
		m.grants = nil
		return grants, false, nil
	}
	if err := imp.freeImport(m.buf, s, ordered); err != nil {
		return nil, false, err
	}
	delete(imp.mappings, m.key)
	grants = m.grants
	m.grants = nil
	return grants, true, nil
}

// unmap frees the import of buf after the work queued on s (if ordered), forgets it
// and records the release event after the free. On failure buf stays mapped, or its
// free is not covered by the release event; either way the leases of its Mappings stay
// held, so the exporter cannot free what this process may still map. Call with mapMu
// held.
func (imp *Importer) unmap(buf *imported, s cudart.Stream, ordered bool) error {
	if err := imp.freeImport(buf, s, ordered); err != nil {
		return err
	}
	return imp.recordFrees()
}

// freeImport frees the import of buf after the work queued on s (if ordered) and
// forgets it, without recording the release event: recordFrees, once for all the
// frees a caller makes, does. On failure buf stays mapped. Call with mapMu held.
func (imp *Importer) freeImport(buf *imported, s cudart.Stream, ordered bool) error {
	if ordered {
		if err := imp.orderRelease(s); err != nil {
			return err
		}
	}
	if err := imp.rt.FreeAsync(imp.dev, buf.ptr, imp.relStream); err != nil {
		return err
	}
	buf.views = 0
	delete(imp.imports, buf.record)
	if imp.relEvent != 0 {
		imp.freed[buf.record] = struct{}{}
	}
	return nil
}

// recordFrees records the release event after the frees issued so far, which it then
// covers for the exporter; on a byte stream, where the exporter cannot wait on an
// event of this host, it waits for them instead. Call with mapMu held.
func (imp *Importer) recordFrees() error {
	rt, dev := imp.rt, imp.dev
	if imp.relEvent == 0 {
		return rt.StreamSynchronize(dev, imp.relStream)
	}
	if err := rt.EventRecord(dev, imp.relEvent, imp.relStream); err != nil {
		return err
	}
	if len(imp.freed) > 256 {
		_ = imp.awaitFrees(false) // a trim only: a failed query keeps the frees, and the next Open that needs one asks again
	}
	return nil
}

// orderRelease makes the release stream wait for the work queued on s so far, through
// an event of s's own: were one event recorded on several callers' streams, a later
// record on another stream could run first and let the release stream's wait for
// this one through (the software device holds the code to that, a stricter reading
// than CUDA's docs give), freeing the import under the work on s. Call with mapMu
// held.
func (imp *Importer) orderRelease(s cudart.Stream) error {
	ev, err := imp.orderEventOf(s)
	if err != nil {
		return err
	}
	if err := imp.rt.EventRecord(imp.dev, ev, s); err != nil {
		return err
	}
	return imp.rt.StreamWaitEvent(imp.dev, imp.relStream, ev)
}

// maxIdleOrderEvents bounds the order events kept: past it, those of streams whose
// last record has run are destroyed before another is made.
const maxIdleOrderEvents = 64

// orderEventOf returns s's order event, made on first use. Call with mapMu held.
func (imp *Importer) orderEventOf(s cudart.Stream) (cudart.Event, error) {
	if ev, ok := imp.orderEvents[s]; ok {
		return ev, nil
	}
	if len(imp.orderEvents) >= maxIdleOrderEvents {
		for st, ev := range imp.orderEvents {
			if done, err := imp.rt.EventQuery(imp.dev, ev); err == nil && done && imp.rt.EventDestroy(imp.dev, ev) == nil {
				delete(imp.orderEvents, st)
			}
		}
	}
	ev, err := imp.rt.EventCreate(imp.dev, cudart.EventDisableTiming)
	if err != nil {
		return 0, fmt.Errorf("release ordering event: %w", err)
	}
	imp.orderEvents[s] = ev
	return ev, nil
}

// keep forgets m, the last Mapping of its buffer, without freeing the buffer's import:
// the release event is recorded after the work queued on s, and m's grants are
// returned for the caller to release with releaseRetain. The import stays in the
// table, with no view, for the next lease on the same memory. Call with mapMu held.
func (imp *Importer) keep(m *Mapping, s cudart.Stream) (map[uint64]uint32, error) {
	if err := imp.orderRelease(s); err != nil {
		return nil, err
	}
	if err := imp.rt.EventRecord(imp.dev, imp.relEvent, imp.relStream); err != nil {
		return nil, err
	}
	m.buf.views = 0
	delete(imp.mappings, m.key)
	grants := m.grants
	m.grants = nil
	return grants, nil
}

// releaseRetained releases grants with releaseRetain, buf's import kept. An exporter
// that refuses to keep it still holds the grants: the import is then freed (unless a
// new lease uses it meanwhile) and the grants released the usual way.
func (imp *Importer) releaseRetained(ctx context.Context, name string, buf *imported, grants map[uint64]uint32) error {
	return imp.releaseGrants(ctx, name, grants, wire.ReleaseRetain, func(id uint64, n uint32, why error) error {
		imp.log.Debug("consumer: the exporter would not keep an import; freeing it", "name", name, "err", why)
		imp.mapMu.Lock()
		if buf.views == 0 && imp.imports[buf.record] == buf {
			// The release stream is ordered after the caller's stream already (keep).
			if err := imp.unmap(buf, 0, false); err != nil {
				imp.mapMu.Unlock()
				return err
			}
		}
		imp.mapMu.Unlock()
		return imp.releaseGrants(ctx, name, map[uint64]uint32{id: n}, 0, nil)
	})
}

// answerRevoke frees the retained import of rec that the exporter asks back, and says
// so; one a Mapping uses again is freed by the last Release. An import no longer held
// was freed already, and that free is covered by the release event.
func (imp *Importer) answerRevoke(rec cudart.PtrExportData) {
	imp.mapMu.Lock()
	buf := imp.imports[rec]
	switch {
	case buf != nil && buf.views > 0:
		buf.revoked = true
		imp.mapMu.Unlock()
		return
	case buf != nil:
		if err := imp.unmap(buf, 0, false); err != nil {
			imp.mapMu.Unlock()
			// Still mapped: the exporter keeps waiting, and the import is freed at
			// Close, whose Bye ends the retention.
			imp.log.Error("consumer: freeing a revoked import", "err", err)
			return
		}
	}
	imp.mapMu.Unlock()
	imp.sendRevoked(rec)
}

func (imp *Importer) sendRevoked(rec cudart.PtrExportData) {
	if err := imp.cl.C.Send(context.Background(), &wire.RevokedMsg{Record: rec}, -1); err != nil {
		imp.log.Debug("consumer: could not say Revoked; the exporter ends the retention when the connection closes", "err", err)
	}
}

// releaseGrants tells the exporter that leases are released, with the Release flags
// given, and waits for it to agree. With the exporter gone there is nothing to tell,
// and that is not an error. refused, if not nil, handles a refusal instead.
func (imp *Importer) releaseGrants(ctx context.Context, name string, grants map[uint64]uint32, flags uint32,
	refused func(id uint64, n uint32, why error) error) error {
	var errs []error
	for id, n := range grants {
		reply, err := imp.cl.Request(ctx, func(req uint64) wire.Message {
			return &wire.ReleaseMsg{ReqID: req, LeaseID: id, Count: n, Flags: flags}
		}, false)
		switch r := reply.(type) {
		case nil:
			if errors.Is(err, export.ErrExporterGone) {
				continue
			}
		case *wire.ReleasedMsg:
			continue
		case *wire.ErrorMsg:
			err = wire.ReplyErr(r)
			if refused != nil {
				if err = refused(id, n, err); err == nil {
					continue
				}
			}
		default:
			err = fmt.Errorf("%w: Release answered with %s", export.ErrProtocol, r.Kind())
		}
		errs = append(errs, fmt.Errorf("consumer: release %q: %w", name, err))
	}
	return errors.Join(errs...)
}

// Context is done once the [Mapping] must not be used any more: after its last Release
// (the cause is [ErrReleased]) and, for a Mapping on another GPU than its exporter's,
// the moment the exporter's process is gone (the cause is [ErrMappingLost]: reading the
// memory then would lose this process's CUDA context). Derive the contexts of work
// that reads the Mapping from it; [context.Cause] says which.
func (m *Mapping) Context() context.Context {
	l := &m.life
	l.mu.Lock()
	defer l.mu.Unlock()
	if l.ctx == nil {
		l.ctx, l.cancel = context.WithCancelCause(context.Background())
		if l.cause != nil {
			l.cancel(l.cause)
		}
	}
	return l.ctx
}

// Err is nil while the [Mapping] may be used, and otherwise why not: [ErrMappingLost]
// (wrapping [export.ErrExporterGone]) for a Mapping on another GPU whose exporter is gone,
// [ErrReleased] once it was released. A lost Mapping must still be released, which
// frees its import without touching the memory.
func (m *Mapping) Err() error {
	m.life.mu.Lock()
	defer m.life.mu.Unlock()
	return m.life.cause
}

// mappingLife is a Mapping's end and its cause. The context is made only for a caller
// of Context: a Mapping is made per block of a batch, and most are never asked.
type mappingLife struct {
	mu     sync.Mutex
	cause  error
	ctx    context.Context
	cancel context.CancelCauseFunc
}

// end ends the Mapping's context with cause, unless it has ended already.
func (m *Mapping) end(cause error) {
	l := &m.life
	l.mu.Lock()
	defer l.mu.Unlock()
	if l.cause != nil {
		return
	}
	l.cause = cause
	if l.cancel != nil {
		l.cancel(cause)
	}
}

// errReleasedCause is the cause of a released Mapping's context.
var errReleasedCause = fmt.Errorf("%w: the mapping was released", ErrReleased)
