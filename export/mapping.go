package export

import (
	"context"
	"errors"
	"fmt"

	"github.com/cudapool/cudapool/cudart"
)

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
