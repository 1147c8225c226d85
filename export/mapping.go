package export

import (
	"context"
	"errors"
	"fmt"

	"github.com/cudapool/cudapool/cudart"
)

// Mapping is a published range of another process's buffer, imported into this one.
// The same range opened again through the same Importer is the same Mapping, counted
// once more. Mappings of ranges of one buffer share one import of the whole buffer
// (FACTS 4), which is freed when the last reference to any of them is released.
type Mapping struct {
	imp  *Importer
	key  rangeKey
	buf  *imported
	ptr  cudart.DevicePtr
	size uint64
	name string
	meta []byte
	// Guarded by imp.mapMu.
	refs   int
	grants map[uint64]uint32 // lease id -> grants of it this mapping answers for
}

// rangeKey names a Mapping: a range of the buffer that record imports.
type rangeKey struct {
	record         cudart.PtrExportData
	offset, length uint64
}

// imported is one buffer imported into this process, whole, and how many Mappings
// of its ranges are live. Guarded by Importer.mapMu.
type imported struct {
	record cudart.PtrExportData
	ptr    cudart.DevicePtr
	views  int
}

// Ptr is the range's address in this process.
func (m *Mapping) Ptr() cudart.DevicePtr { return m.ptr }

// Size is the range's length in bytes.
func (m *Mapping) Size() uint64 { return m.size }

// Name is the name the range was first opened (or pushed) under.
func (m *Mapping) Name() string { return m.name }

// Meta is the metadata published with the range (WithMeta), nil if none. It is the
// Mapping's own: do not modify it.
func (m *Mapping) Meta() []byte { return m.meta }

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
// release stream once the work queued on s before the call has completed (unless a
// Mapping of another range of the buffer still holds it), and tells the exporter,
// whose own free of the buffer then waits for that free; the host does not wait for
// the GPU. After Release the pointer must not be used by work queued
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
	grants, err := imp.unview(m, s)
	imp.mapMu.Unlock()
	if err != nil {
		return fmt.Errorf("export: release %q: %w", m.name, err)
	}
	return imp.returnGrants(ctx, m.name, grants)
}

// unview forgets m, whose last reference is gone, and returns the grants it answered
// for. The import of its buffer is freed after the work queued on s if no other
// Mapping of the buffer holds it; until then those Mappings' leases keep the buffer
// alive. Call with mapMu held.
func (imp *Importer) unview(m *Mapping, s cudart.Stream) (map[uint64]uint32, error) {
	if m.buf.views > 1 {
		m.buf.views--
		delete(imp.mappings, m.key)
		grants := m.grants
		m.grants = nil
		return grants, nil
	}
	if err := imp.unmap(m.buf, s, true); err != nil {
		if imp.imports[m.buf.record] == nil {
			delete(imp.mappings, m.key) // freed, but the exporter could not be told in order
		}
		return nil, err
	}
	delete(imp.mappings, m.key)
	grants := m.grants
	m.grants = nil
	return grants, nil
}

// unmap frees the import of buf after the work queued on s (if ordered) and forgets
// it. On failure buf stays mapped and the leases of its Mappings held, so the
// exporter cannot free what this process may still map. Call with mapMu held.
func (imp *Importer) unmap(buf *imported, s cudart.Stream, ordered bool) error {
	rt, dev := imp.rt, imp.dev
	if ordered {
		if err := rt.EventRecord(dev, imp.orderEvent, s); err != nil {
			return err
		}
		if err := rt.StreamWaitEvent(dev, imp.relStream, imp.orderEvent); err != nil {
			return err
		}
	}
	if err := rt.FreeAsync(dev, buf.ptr, imp.relStream); err != nil {
		return err
	}
	buf.views = 0
	delete(imp.imports, buf.record)
	if imp.relEvent == 0 {
		// The exporter cannot wait on an event of this host: the free must be done
		// before it hears of it.
		return rt.StreamSynchronize(dev, imp.relStream)
	}
	if err := rt.EventRecord(dev, imp.relEvent, imp.relStream); err != nil {
		return err
	}
	imp.freed[buf.record] = struct{}{}
	if len(imp.freed) > 256 {
		imp.settleFrees(false)
	}
	return nil
}

// returnGrants tells the exporter that leases are released and waits for it to agree.
// With the exporter gone there is nothing to tell, and that is not an error.
func (imp *Importer) returnGrants(ctx context.Context, name string, grants map[uint64]uint32) error {
	var errs []error
	for id, n := range grants {
		reply, err := imp.cl.request(ctx, func(req uint64) message { return &releaseMsg{ReqID: req, LeaseID: id, Count: n} }, false)
		switch r := reply.(type) {
		case nil:
			if errors.Is(err, ErrExporterGone) {
				continue
			}
		case *releasedMsg:
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
