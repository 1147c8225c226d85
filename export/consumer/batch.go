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
	drops := map[*Mapping]int{} // here, not in countDrops, so that it stays on the stack
	if err := imp.countDrops(ms, drops); err != nil {
		imp.mapMu.Unlock()
		return err
	}
	if err := imp.orderRelease(s); err != nil {
		imp.mapMu.Unlock()
		return fmt.Errorf("consumer: release %d mappings: %w", len(ms), err)
	}
	b := batchRelease{plain: map[uint64]uint32{}, kept: map[uint64]uint32{}}
	for m, n := range drops {
		b = imp.dropRefs(b, m, n, s)
	}
	if len(b.kept) > 0 || b.anyFreed {
		// One record covers every free of the batch, and the kept imports' last use.
		if err := imp.recordFrees(); err != nil {
			// The exporter is not told: without the event its free could come first.
			imp.mapMu.Unlock()
			return fmt.Errorf("consumer: release %d mappings: %w", len(ms), err)
		}
	}
	imp.mapMu.Unlock()
	return imp.finishRelease(ctx, &b, len(ms))
}

// countDrops counts into drops how many times each of ms is listed, with imp.mapMu
// held. It fails, changing no Mapping, with [export.ErrBadRequest] for a Mapping of
// another Importer, and with [ErrReleased] for one listed more times than it has
// references.
func (imp *Importer) countDrops(ms []*Mapping, drops map[*Mapping]int) error {
	for _, m := range ms {
		if m.imp != imp {
			return fmt.Errorf("consumer: release %q: %w: a Mapping of another Importer", m.name, export.ErrBadRequest)
		}
		if drops[m]++; drops[m] > m.refs {
			return fmt.Errorf("%w: %q", ErrReleased, m.name)
		}
	}
	return nil
}

// batchRelease is what one [Importer.ReleaseAll] gathers as it drops its Mappings:
// the grants to release, plain and with their imports kept, and what is told or
// undone once the lock is let go. It is passed by value, and holds no *Importer,
// so that escape analysis keeps its maps on the stack.
type batchRelease struct {
	plain, kept map[uint64]uint32 // grants by lease
	keptBufs    []*imported       // the imports the exporter is asked to retain
	anyFreed    bool              // an import was freed: the release event is recorded
	lastVMM     []*vmmImport      // VMM allocations no Mapping views, to unmap
	revoked     []cudart.PtrExportData
	errs        []error // Mappings left as they were, their references restored
}

// dropRefs takes n references from m, with imp.mapMu held. At its last, it ends m
// and books what it held in b, which it returns: a local copy is freed, a VMM
// view's grants are released (and the allocation unmapped after if no view is
// left), an import the exporter retains is kept, others are unviewed (freed if no
// view is left). If freeing or unviewing fails, m keeps its references and its
// lease, and the error is booked.
func (imp *Importer) dropRefs(b batchRelease, m *Mapping, n int, s cudart.Stream) batchRelease {
	if m.refs -= n; m.refs > 0 {
		return b
	}
	if m.localCopy != nil {
		if err := imp.freeLocalCopy(m, s); err != nil {
			m.refs += n
			b.errs = append(b.errs, err)
			return b
		}
		m.end(errReleasedCause)
		return b
	}
	if m.vmm != nil {
		grants, last := imp.unviewVMM(m)
		if last != nil {
			b.lastVMM = append(b.lastVMM, last)
		}
		m.end(errReleasedCause)
		for id, g := range grants {
			b.plain[id] += g
		}
		return b
	}
	buf := m.buf
	if imp.retain && buf.views == 1 && !buf.revoked {
		buf.views = 0
		delete(imp.mappings, m.key)
		for id, g := range m.grants {
			b.kept[id] += g
		}
		m.grants = nil
		m.end(errReleasedCause)
		b.keptBufs = append(b.keptBufs, buf)
		return b
	}
	if buf.revoked && buf.views == 1 {
		b.revoked = append(b.revoked, buf.record)
	}
	grants, freed, err := imp.unview(m, 0, false)
	if err != nil {
		// Still mapped, its lease held: it can be released again.
		m.refs += n
		b.errs = append(b.errs, fmt.Errorf("consumer: release %q: %w", m.name, err))
		return b
	}
	b.anyFreed = b.anyFreed || freed
	m.end(errReleasedCause)
	for id, g := range grants {
		b.plain[id] += g
	}
	return b
}

// finishRelease, without imp.mapMu, unmaps the VMM allocations of b that no Mapping
// views and tells the exporter of the grants released and the revoked buffers
// dropped. If a Mapping's drop failed, no grant is released and the errors are
// returned; the grants of an allocation whose unmap failed are released all the
// same, as Release does: the lease holds nothing of the exporter's.
func (imp *Importer) finishRelease(ctx context.Context, b *batchRelease, nms int) error {
	unmapErr := imp.unmapVMM(b.lastVMM)
	if unmapErr != nil {
		unmapErr = fmt.Errorf("consumer: release %d mappings: %w", nms, unmapErr)
	}
	if err := errors.Join(b.errs...); err != nil {
		return errors.Join(err, unmapErr)
	}
	var err error
	if len(b.plain) > 0 || len(b.kept) > 0 { // else every Mapping is still referenced (or a local copy)
		err = imp.releaseBatch(ctx, b.plain, b.kept, b.keptBufs)
	}
	for _, rec := range b.revoked {
		imp.sendRevoked(rec)
	}
	if err == nil {
		return unmapErr
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
