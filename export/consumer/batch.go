package consumer

import (
	"context"
	"errors"
	"fmt"

	"github.com/cudapool/cudapool/cudart"
	"github.com/cudapool/cudapool/export"
	"github.com/cudapool/cudapool/export/internal/wire"
)

// OpenAll is Open of every name at once: one request and one answer (a few, for
// names too long to fit one frame together), and s waits once for each distinct
// producer stream the buffers were published on. It returns the Mappings in the order
// of names, all or none: on failure nothing is held, and the error names the first
// name that failed. At most [export.MaxBatch] names.
func (imp *Importer) OpenAll(ctx context.Context, names []string, s cudart.Stream) ([]*Mapping, error) {
	switch {
	case len(names) == 0:
		return nil, nil
	case len(names) > export.MaxBatch:
		return nil, fmt.Errorf("consumer: open %d names: %w: at most %d at once", len(names), export.ErrBadRequest, export.MaxBatch)
	}
	for _, name := range names {
		if err := wire.CheckName(name); err != nil {
			return nil, err
		}
	}
	if err := imp.checkStream(s); err != nil {
		return nil, fmt.Errorf("consumer: open %d names: %w", len(names), err)
	}
	// Names too long to fit one frame together go in several requests, in order.
	var leases []wire.LeaseMsg
	for _, chunk := range openChunks(names) {
		got, err := imp.openChunk(ctx, chunk)
		if err != nil {
			imp.cl.GiveBackAll(leases)
			return nil, imp.closedOr(fmt.Sprintf("open %d names", len(names)), fmt.Errorf("consumer: open %d names: %w", len(names), err))
		}
		leases = append(leases, got...)
	}
	ms, err := imp.adoptAll(ctx, leases, names, s)
	if err != nil || imp.closing.Load() {
		return nil, imp.closedOr(fmt.Sprintf("open %d names", len(names)), err)
	}
	return ms, nil
}

// openChunk asks for the leases of names in one OpenBatch, which fits a frame.
func (imp *Importer) openChunk(ctx context.Context, names []string) ([]wire.LeaseMsg, error) {
	reply, err := imp.cl.Request(ctx, func(id uint64) wire.Message { return &wire.OpenBatchMsg{ReqID: id, Names: names} }, true)
	if err != nil {
		return nil, err
	}
	switch r := reply.(type) {
	case *wire.LeaseBatchMsg:
		if len(r.Leases) != len(names) {
			imp.cl.GiveBackAll(r.Leases)
			imp.cl.Fail(wire.ProtocolErr("OpenBatch of %d names answered with %d leases", len(names), len(r.Leases)))
			return nil, imp.cl.GoneOr(export.ErrProtocol)
		}
		return r.Leases, nil
	case *wire.ErrorMsg:
		return nil, wire.ReplyErr(r)
	}
	imp.cl.Fail(wire.ProtocolErr("OpenBatch answered with %s", reply.Kind()))
	return nil, imp.cl.GoneOr(export.ErrProtocol)
}

// openChunks splits names, in order, into the OpenBatch requests that each fit a
// frame: a request id, then a length byte and the bytes of each name.
func openChunks(names []string) [][]string {
	var chunks [][]string
	start, size := 0, 8
	for i, name := range names {
		if size+1+len(name) > wire.MaxPayload {
			chunks = append(chunks, names[start:i])
			start, size = i, 8
		}
		size += 1 + len(name)
	}
	return append(chunks, names[start:])
}

// adoptAll turns a batch of leases into Mappings, or releases every one.
func (imp *Importer) adoptAll(ctx context.Context, leases []wire.LeaseMsg, names []string, s cudart.Stream) ([]*Mapping, error) {
	waited := map[cudart.IpcEventHandle]bool{}
	out := make([]*Mapping, 0, len(leases))
	for i := range leases {
		m, err := imp.adoptLease(&leases[i], names[i], s, waited)
		if err == nil {
			out = append(out, m)
			continue
		}
		imp.cl.GiveBackAll(leases[i:])
		if rerr := imp.ReleaseAll(ctx, out, s); rerr != nil {
			err = errors.Join(err, rerr)
		}
		return nil, fmt.Errorf("consumer: open %q of a batch of %d: %w", names[i], len(names), err)
	}
	return out, nil
}

// ReleaseAll is Release of every [Mapping] at once: the release stream is ordered after
// s once, the imports that no Mapping holds any more are freed (or kept, where the
// exporter retains them) and the release event recorded once, and the exporter is told
// in one request. A Mapping listed twice is released twice. It fails with [ErrReleased],
// releasing nothing, if one of them has no reference left; if the exporter refuses
// some of the leases, the others are released all the same. At most [export.MaxBatch] Mappings.
func (imp *Importer) ReleaseAll(ctx context.Context, ms []*Mapping, s cudart.Stream) error {
	switch {
	case len(ms) == 0:
		return nil
	case len(ms) > export.MaxBatch:
		return fmt.Errorf("consumer: release %d mappings: %w: at most %d at once", len(ms), export.ErrBadRequest, export.MaxBatch)
	}
	if err := imp.checkStream(s); err != nil {
		return fmt.Errorf("consumer: release %d mappings: %w", len(ms), err)
	}
	imp.mapMu.Lock()
	drops := map[*Mapping]int{}
	for _, m := range ms {
		if m.imp != imp {
			imp.mapMu.Unlock()
			return fmt.Errorf("consumer: release %q: %w: a Mapping of another Importer", m.name, export.ErrBadRequest)
		}
		if drops[m]++; drops[m] > m.refs {
			imp.mapMu.Unlock()
			return fmt.Errorf("%w: %q", ErrReleased, m.name)
		}
	}
	if err := imp.orderRelease(s); err != nil {
		imp.mapMu.Unlock()
		return fmt.Errorf("consumer: release %d mappings: %w", len(ms), err)
	}
	plain, kept := map[uint64]uint32{}, map[uint64]uint32{}
	anyFreed := false
	var keptBufs []*imported
	var lastVMM []*vmmImport
	var revoked []cudart.PtrExportData
	var errs []error
	for m, n := range drops {
		if m.refs -= n; m.refs > 0 {
			continue
		}
		if m.localCopy != nil {
			if err := imp.freeLocalCopy(m, s); err != nil {
				m.refs += n
				errs = append(errs, err)
				continue
			}
			m.end(errReleasedCause)
			continue
		}
		if m.vmm != nil {
			grants, last := imp.unviewVMM(m)
			if last != nil {
				lastVMM = append(lastVMM, last)
			}
			m.end(errReleasedCause)
			for id, g := range grants {
				plain[id] += g
			}
			continue
		}
		buf := m.buf
		if imp.retain && buf.views == 1 && !buf.revoked {
			buf.views = 0
			delete(imp.mappings, m.key)
			for id, g := range m.grants {
				kept[id] += g
			}
			m.grants = nil
			m.end(errReleasedCause)
			keptBufs = append(keptBufs, buf)
			continue
		}
		if buf.revoked && buf.views == 1 {
			revoked = append(revoked, buf.record)
		}
		grants, freed, err := imp.unview(m, 0, false)
		if err != nil {
			// Still mapped, its lease held: it can be released again.
			m.refs += n
			errs = append(errs, fmt.Errorf("consumer: release %q: %w", m.name, err))
			continue
		}
		anyFreed = anyFreed || freed
		m.end(errReleasedCause)
		for id, g := range grants {
			plain[id] += g
		}
	}
	if len(kept) > 0 || anyFreed {
		// One record covers every free of the batch, and the kept imports' last use.
		if err := imp.recordFrees(); err != nil {
			// The exporter is not told: without the event its free could come first.
			imp.mapMu.Unlock()
			return fmt.Errorf("consumer: release %d mappings: %w", len(ms), err)
		}
	}
	imp.mapMu.Unlock()
	// The grants of an allocation whose unmap failed are released all the same, as
	// Release does: the lease holds nothing of the exporter's.
	unmapErr := imp.unmapVMM(lastVMM)
	if unmapErr != nil {
		unmapErr = fmt.Errorf("consumer: release %d mappings: %w", len(ms), unmapErr)
	}
	if err := errors.Join(errs...); err != nil {
		return errors.Join(err, unmapErr)
	}
	if len(plain) == 0 && len(kept) == 0 {
		// Every Mapping is still referenced (or a local copy): no grant to release.
		for _, rec := range revoked {
			imp.sendRevoked(rec)
		}
		return unmapErr
	}
	err := imp.releaseBatch(ctx, plain, kept, keptBufs)
	for _, rec := range revoked {
		imp.sendRevoked(rec)
	}
	return errors.Join(unmapErr, err)
}

// releaseBatch tells the exporter in one request that plain grants are released and
// kept ones released with their imports retained. If the exporter refuses, the kept
// imports are freed (those no new lease uses) and every grant is released one lease at
// a time, as Release does; grants it had released already are refused as stale, which
// changes nothing.
func (imp *Importer) releaseBatch(ctx context.Context, plain, kept map[uint64]uint32, keptBufs []*imported) error {
	entries := make([]wire.ReleaseMsg, 0, len(plain)+len(kept))
	for id, n := range plain {
		entries = append(entries, wire.ReleaseMsg{LeaseID: id, Count: n})
	}
	for id, n := range kept {
		entries = append(entries, wire.ReleaseMsg{LeaseID: id, Count: n, Flags: wire.ReleaseRetain})
	}
	reply, err := imp.cl.Request(ctx, func(req uint64) wire.Message { return &wire.ReleaseBatchMsg{ReqID: req, Entries: entries} }, false)
	switch r := reply.(type) {
	case nil:
		if errors.Is(err, export.ErrExporterGone) {
			return nil
		}
		return fmt.Errorf("consumer: release %d leases: %w", len(entries), err)
	case *wire.ReleasedMsg:
		return nil
	case *wire.ErrorMsg:
		imp.log.Debug("consumer: a batch release was refused in part; releasing one lease at a time", "err", wire.ReplyErr(r))
	default:
		return fmt.Errorf("consumer: release %d leases: %w: ReleaseBatch answered with %s", len(entries), export.ErrProtocol, r.Kind())
	}
	imp.mapMu.Lock()
	for _, buf := range keptBufs {
		if buf.views == 0 && imp.imports[buf.record] == buf {
			if err := imp.unmap(buf, 0, false); err != nil {
				imp.log.Error("consumer: freeing an import the exporter would not keep", "err", err)
			}
		}
	}
	imp.mapMu.Unlock()
	all := plain
	for id, n := range kept {
		all[id] += n
	}
	var errs []error
	for id, n := range all {
		if err := imp.releaseGrants(ctx, "a batch", map[uint64]uint32{id: n}, 0, nil); err != nil && !errors.Is(err, export.ErrStaleLease) {
			errs = append(errs, err)
		}
	}
	return errors.Join(errs...)
}
