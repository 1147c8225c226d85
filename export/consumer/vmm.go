package consumer

import (
	"context"
	"errors"
	"fmt"

	"github.com/cudapool/cudapool/cudart"
	"github.com/cudapool/cudapool/export"
	"github.com/cudapool/cudapool/export/internal/wire"
	"github.com/cudapool/cudapool/vmm"
)

// The VMM route (producer.Exporter.PublishChunks): the exporter sends the chunks of an
// allocation as a chunk set before each lease of it, each chunk's descriptor once per
// set; the Importer imports them as they come, and the lease maps them, in order, into
// one reserved range, which every Mapping of a range of the allocation shares. The
// chunks are not kept between leases: once mapped, the Importer closes them (the
// mapping holds the memory), and the last Release of the allocation unmaps it, so
// nothing here holds the producer's memory once no lease does. (A pool's import, by
// contrast, is kept for the connection: it holds no buffer's memory of its own.)

// maxPendingSets bounds the chunk sets that have come and wait for their leases: an
// exporter sends a set just before its lease, so more are a misbehaving exporter.
const maxPendingSets = 1024

// chunkSet is the chunks of one set as they come (ChunkHandle), imported, for the lease
// that names it. Guarded by Importer.mu.
type chunkSet struct {
	alloc  uint64
	chunks []*vmm.Chunk // by index; nil until it has come
	err    error        // an import failed: the lease fails with it
}

// close closes the chunks imported so far: a mapping of them holds their memory.
func (cs *chunkSet) close() {
	if cs == nil {
		return
	}
	for _, c := range cs.chunks {
		if c != nil {
			_ = c.Close() // cleanup: a handle given up fails only on a driver error, which leaves nothing to do
		}
	}
}

// vmmImport is a VMM allocation mapped into this process as one range, and how many
// Mappings of its ranges are live. Guarded by Importer.mapMu.
type vmmImport struct {
	alloc uint64
	res   *vmm.Reservation
	views int
}

// importChunk imports a chunk that came in a ChunkHandle into its set; fd, if any, is
// closed here (the driver does not keep it). A frame the set cannot take is a
// protocol violation, which ends the connection.
func (imp *Importer) importChunk(m *wire.ChunkHandleMsg, fd int) error {
	if fd >= 0 {
		defer wire.CloseFDs([]int{fd})
	}
	var c *vmm.Chunk
	var err error
	if m.HandleType == cudart.HandleTypeFabric {
		c, err = vmm.ImportFabric(imp.rt, imp.dev, m.Fabric, m.Size)
	} else {
		c, err = vmm.Import(imp.rt, imp.dev, fd, m.Size)
	}
	switch {
	case errors.Is(err, vmm.ErrFabricNotPermitted):
		err = fmt.Errorf("%w: %w", export.ErrIMEXRequired, err)
	case errors.Is(err, vmm.ErrGranularity):
		err = fmt.Errorf("%w: %w", export.ErrProtocol, err)
	}
	if err != nil {
		err = fmt.Errorf("consumer: import chunk %d of %d of allocation %d: %w", m.Index, m.Count, m.AllocID, err)
	}
	imp.mu.Lock()
	defer imp.mu.Unlock()
	set := imp.sets[m.SetID]
	if set == nil {
		if len(imp.sets) >= maxPendingSets {
			_ = closeChunk(c)
			return wire.ProtocolErr("%d chunk sets wait for their leases, at most %d", len(imp.sets), maxPendingSets)
		}
		set = &chunkSet{alloc: m.AllocID, chunks: make([]*vmm.Chunk, m.Count)}
		imp.sets[m.SetID] = set
	}
	switch {
	case set.alloc != m.AllocID || len(set.chunks) != int(m.Count):
		_ = closeChunk(c)
		return wire.ProtocolErr("chunk set %d is of allocation %d in %d chunks, and a ChunkHandle says %d in %d", m.SetID, set.alloc, len(set.chunks), m.AllocID, m.Count)
	case set.chunks[m.Index] != nil:
		_ = closeChunk(c)
		return wire.ProtocolErr("chunk %d of set %d came twice", m.Index, m.SetID)
	}
	set.chunks[m.Index] = c
	if err != nil && set.err == nil {
		set.err = err
	}
	return nil
}

func closeChunk(c *vmm.Chunk) error {
	if c == nil {
		return nil
	}
	return c.Close()
}

// takeSet removes the chunk set id from those waiting and returns it, nil if none came.
func (imp *Importer) takeSet(id uint64) *chunkSet {
	imp.mu.Lock()
	defer imp.mu.Unlock()
	set := imp.sets[id]
	delete(imp.sets, id)
	return set
}

// mappedChunks checks that set holds the whole allocation l leases, and returns its
// chunks in order.
func (set *chunkSet) mappedChunks(l *wire.LeaseMsg) ([]*vmm.Chunk, error) {
	if set == nil {
		return nil, wire.ProtocolErr("a lease of allocation %d names chunk set %d, which never came", l.PoolID, l.BufferID)
	}
	if set.err != nil {
		return nil, set.err
	}
	var total uint64
	for i, c := range set.chunks {
		if c == nil {
			return nil, wire.ProtocolErr("chunk %d of %d of set %d never came", i, len(set.chunks), l.BufferID)
		}
		total += c.Size()
	}
	if set.alloc != l.PoolID || total != l.Size {
		return nil, wire.ProtocolErr("a lease of %d bytes of allocation %d names a set of %d bytes of allocation %d", l.Size, l.PoolID, total, set.alloc)
	}
	return set.chunks, nil
}

// adoptVMM is adoptLease of a VMM allocation's lease, whose ready event s has waited
// on: the allocation's range is mapped unless this Importer maps it already. Call with
// mapMu held.
func (imp *Importer) adoptVMM(l *wire.LeaseMsg, name string) (*Mapping, error) {
	set := imp.takeSet(l.BufferID)
	defer set.close() // mapped or not needed: a mapping holds the memory
	key := rangeKey{alloc: l.PoolID, offset: l.Offset, length: l.Length}
	if m := imp.heldMapping(key, l.LeaseID); m != nil {
		return m, nil
	}
	vi := imp.vmmImports[l.PoolID]
	if vi == nil {
		chunks, err := set.mappedChunks(l)
		if err != nil {
			return nil, err
		}
		res, err := vmm.Reserve(imp.rt, imp.dev, l.Size)
		if err != nil {
			return nil, fmt.Errorf("map allocation %d: %w", l.PoolID, err)
		}
		if err := res.Grow(chunks...); err != nil {
			return nil, errors.Join(fmt.Errorf("map allocation %d: %w", l.PoolID, err), res.Close())
		}
		vi = &vmmImport{alloc: l.PoolID, res: res}
		imp.vmmImports[l.PoolID] = vi
	}
	vi.views++
	m := &Mapping{imp: imp, key: key, vmm: vi, ptr: vi.res.Ptr() + cudart.DevicePtr(l.Offset), size: l.Length,
		name: name, meta: l.Meta, refs: 1, grants: map[uint64]uint32{l.LeaseID: 1}, owner: -1}
	imp.mappings[key] = m
	return m, nil
}

// unviewVMM forgets m, whose last reference is gone, and returns the grants it answered
// for, and its allocation's import if no Mapping views it any more: the caller unmaps
// that (unmapVMM) once the release stream has run. The release stream is ordered after
// the work on m already. Call with mapMu held.
func (imp *Importer) unviewVMM(m *Mapping) (grants map[uint64]uint32, last *vmmImport) {
	delete(imp.mappings, m.key)
	grants = m.grants
	m.grants = nil
	if m.vmm.views--; m.vmm.views == 0 {
		last = m.vmm
	}
	return grants, last
}

// unmapVMM unmaps each allocation of vis that no Mapping views any more, once the work
// the release stream was ordered after has run: the driver must not unmap memory that
// queued work touches. The host waits for that here. An allocation opened again
// meanwhile stays mapped.
func (imp *Importer) unmapVMM(vis []*vmmImport) error {
	if len(vis) == 0 {
		return nil
	}
	if err := imp.rt.StreamSynchronize(imp.dev, imp.relStream); err != nil {
		return fmt.Errorf("wait for the work on the range before it is unmapped: %w", err)
	}
	imp.mapMu.Lock()
	defer imp.mapMu.Unlock()
	var errs []error
	for _, vi := range vis {
		if vi.views > 0 || imp.vmmImports[vi.alloc] != vi {
			continue
		}
		delete(imp.vmmImports, vi.alloc)
		if err := vi.res.Close(); err != nil {
			errs = append(errs, fmt.Errorf("unmap allocation %d: %w", vi.alloc, err))
		}
	}
	return errors.Join(errs...)
}

// closeVMM unmaps every allocation and closes the chunk sets still waiting, for
// Close. Call with mapMu held.
func (imp *Importer) closeVMM() error {
	var errs []error
	for id, vi := range imp.vmmImports {
		delete(imp.vmmImports, id)
		if err := vi.res.Close(); err != nil {
			errs = append(errs, fmt.Errorf("consumer: close: unmap allocation %d: %w", id, err))
		}
	}
	imp.mu.Lock()
	sets := imp.sets
	imp.sets = map[uint64]*chunkSet{}
	imp.mu.Unlock()
	for _, set := range sets {
		set.close()
	}
	return errors.Join(errs...)
}

// releaseVMM is Release of a Mapping of the VMM route, with mapMu held (and given up
// here): the release stream is ordered after the work queued on s, and the last
// Mapping of the allocation unmaps it once that work has run, the host waiting for
// it; then the exporter is told.
func (imp *Importer) releaseVMM(ctx context.Context, m *Mapping, s cudart.Stream) error {
	if err := imp.orderRelease(s); err != nil {
		m.refs++
		imp.mapMu.Unlock()
		return fmt.Errorf("consumer: release %q: %w", m.name, err)
	}
	grants, last := imp.unviewVMM(m)
	m.end(errReleasedCause)
	imp.mapMu.Unlock()
	var unmapErr error
	if last != nil {
		if err := imp.unmapVMM([]*vmmImport{last}); err != nil {
			unmapErr = fmt.Errorf("consumer: release %q: %w", m.name, err)
		}
	}
	// Released whether or not the unmap failed: the lease holds nothing of the
	// exporter's, and a range left mapped is this process's own loss.
	return errors.Join(unmapErr, imp.releaseGrants(ctx, m.name, grants, 0, nil))
}
