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
// allocation once per connection, before the first lease of it, each chunk's
// descriptor passed with SCM_RIGHTS; the Importer imports them as they come and keeps
// them (chunks) while the allocation is published, as it keeps a pool's import for
// the connection. A lease maps them, in order, into one reserved range, which every
// Mapping of a range of the allocation shares; the last Release unmaps it, and a later
// Open maps the kept chunks again without a descriptor passed. The exporter's
// DropChunks (the allocation is unpublished), its death and Close close the kept
// chunks: a chunk's memory lives while any process holds an import or a mapping of it,
// so nothing here holds the producer's memory once it is unpublished and no lease
// maps it.

// maxKeptAllocs bounds the allocations whose chunks are kept: an exporter sends them
// only for what it publishes, so more are a misbehaving exporter.
const maxKeptAllocs = 4096

// chunkSet is the chunks of one allocation as they come (ChunkHandle), imported, kept
// for the leases that name it. Guarded by Importer.mu.
type chunkSet struct {
	chunks []*vmm.Chunk // by index; nil until it has come
	err    error        // an import failed: the leases fail with it
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

// importChunk imports a chunk that came in a ChunkHandle into its allocation's set; fd,
// if any, is closed here (the driver does not keep it). A frame the set cannot take is
// a protocol violation, which ends the connection.
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
	set := imp.kept[m.AllocID]
	if set == nil {
		if len(imp.kept) >= maxKeptAllocs {
			_ = closeChunk(c)
			return wire.ProtocolErr("chunks of %d allocations kept, at most %d", len(imp.kept), maxKeptAllocs)
		}
		set = &chunkSet{chunks: make([]*vmm.Chunk, m.Count)}
		imp.kept[m.AllocID] = set
	}
	switch {
	case len(set.chunks) != int(m.Count):
		_ = closeChunk(c)
		return wire.ProtocolErr("allocation %d has %d chunks, and a ChunkHandle says %d", m.AllocID, len(set.chunks), m.Count)
	case set.chunks[m.Index] != nil:
		_ = closeChunk(c)
		return wire.ProtocolErr("chunk %d of allocation %d came twice", m.Index, m.AllocID)
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

// dropChunks closes the chunks kept of allocation id (DropChunks: it is unpublished).
func (imp *Importer) dropChunks(id uint64) {
	imp.mu.Lock()
	set := imp.kept[id]
	delete(imp.kept, id)
	imp.mu.Unlock()
	set.close()
}

// dropAllChunks closes every chunk kept: the exporter is gone, or the Importer closing.
func (imp *Importer) dropAllChunks() {
	imp.mu.Lock()
	kept := imp.kept
	imp.kept = map[uint64]*chunkSet{}
	imp.mu.Unlock()
	for _, set := range kept {
		set.close()
	}
}

// mappedChunks returns the chunks kept of the allocation l leases, in order, once
// they add up to it. Call with imp.mu held.
func (imp *Importer) mappedChunks(l *wire.LeaseMsg) ([]*vmm.Chunk, error) {
	set := imp.kept[l.PoolID]
	if set == nil {
		// The exporter sends the chunks before its first lease of the allocation, and
		// drops them once it is unpublished: a lease sent as it was unpublished comes
		// after the drop. Or the connection ended, and its end dropped them.
		if err := imp.Err(); err != nil {
			return nil, err
		}
		return nil, fmt.Errorf("%w: allocation %d was unpublished as it was leased (its chunks are not here)", export.ErrUnknownName, l.PoolID)
	}
	if set.err != nil {
		return nil, set.err
	}
	var total uint64
	for i, c := range set.chunks {
		if c == nil {
			return nil, wire.ProtocolErr("chunk %d of %d of allocation %d never came", i, len(set.chunks), l.PoolID)
		}
		total += c.Size()
	}
	if total != l.Size {
		return nil, wire.ProtocolErr("a lease of %d bytes of allocation %d, whose chunks add up to %d", l.Size, l.PoolID, total)
	}
	return set.chunks, nil
}

// adoptVMM is adoptLease of a VMM allocation's lease, whose ready event s has waited
// on: the allocation's range is mapped unless this Importer maps it already. Call with
// mapMu held.
func (imp *Importer) adoptVMM(l *wire.LeaseMsg, name string) (*Mapping, error) {
	key := rangeKey{alloc: l.PoolID, offset: l.Offset, length: l.Length}
	if m := imp.heldMapping(key, l.LeaseID); m != nil {
		return m, nil
	}
	vi := imp.vmmImports[l.PoolID]
	if vi == nil {
		res, err := imp.mapChunks(l)
		if err != nil {
			return nil, err
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

// mapChunks maps the chunks kept of the allocation l leases into a new range. imp.mu is
// held across it, so that a DropChunks that comes meanwhile closes them only once they
// are mapped (the mapping then holds their memory): a few driver calls that do not
// wait for the GPU.
func (imp *Importer) mapChunks(l *wire.LeaseMsg) (*vmm.Reservation, error) {
	imp.mu.Lock()
	defer imp.mu.Unlock()
	chunks, err := imp.mappedChunks(l)
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
	return res, nil
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

// closeVMM unmaps every allocation and closes the chunks kept, for Close. Call with
// mapMu held.
func (imp *Importer) closeVMM() error {
	var errs []error
	for id, vi := range imp.vmmImports {
		delete(imp.vmmImports, id)
		if err := vi.res.Close(); err != nil {
			errs = append(errs, fmt.Errorf("consumer: close: unmap allocation %d: %w", id, err))
		}
	}
	imp.dropAllChunks()
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
