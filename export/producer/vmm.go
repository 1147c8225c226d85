package producer

import (
	"context"
	"errors"
	"fmt"
	"sync"

	"golang.org/x/sys/unix"

	"github.com/cudapool/cudapool/cudart"
	"github.com/cudapool/cudapool/export"
	"github.com/cudapool/cudapool/export/internal/wire"
	"github.com/cudapool/cudapool/vmm"
)

// vmmAlloc is a published VMM allocation: a descriptor of each of its chunks (and,
// for FABRIC chunks, the handle), held from PublishChunks until the publication ends
// and no grant is sending them. While it holds them the memory lives, whatever the
// producer closed; the imports of the peers it was sent to hold it too, until they
// are told to drop them (dropped, once the descriptors are closed).
type vmmAlloc struct {
	id     uint64 // the wire id, Lease's pool_id with flag vmm
	dev    int
	size   uint64
	chunks []vmmChunk
	fabric bool // every chunk has a FABRIC handle
	// dropped runs once the descriptors are closed: it tells the peers the chunks were
	// sent to that they may drop them. Set before the allocation is published.
	dropped func(*vmmAlloc)

	mu      sync.Mutex
	names   int  // the names it is published under
	sending int  // grants sending the chunks now
	retired bool // its last name went: the descriptors close once sending is 0
}

// vmmChunk is one chunk of a vmmAlloc: its size, the exporter's descriptor of it, and
// its FABRIC handle where it has one.
type vmmChunk struct {
	size uint64
	fd   int
	fab  cudart.FabricHandle
}

// PublishChunks makes a VMM allocation available under name: chunks, made on one
// device (vmm.NewChunk) and mapped one behind the other from the first, are one
// contiguous allocation of their summed size, which a consumer's Open maps as one
// range of its addresses and gets as the same [consumer.Mapping] a pool buffer gives.
// It is ready once the work queued on s before the call has completed, as [Exporter.Publish] is.
// [Range] publishes part of the allocation and [WithMeta] sends metadata with it;
// [Exporter.PublishChunksAll] publishes several ranges of one allocation. Each call
// publishes an allocation of its own: the same chunks published by two calls are
// mapped twice by a consumer that opens both.
//
// The Exporter takes a descriptor of each chunk now: the memory lives while a name of
// the allocation is published, even if the caller closes its [vmm.Chunk] values and
// unmaps them. Each peer is sent the descriptors once (SCM_RIGHTS) and keeps its
// imports while the allocation is published; its mappings hold the memory from its
// Open to its last Release (or its process's exit). Once [Exporter.Unpublish] (or
// Close) has removed the allocation's last name, the Exporter gives its descriptors up
// as soon as no Open is sending them and tells the peers to drop their imports; leases
// already given out are unaffected. Leases of the allocation are counted, released and
// ended on a consumer's death as those of pool buffers are; the consumer unmaps only
// once its work on the range has run.
//
// Chunks made [vmm.WithFabric] travel to peers on a byte stream as FABRIC handles too
// ([Exporter.Serve]): on a host without an IMEX channel PublishChunks fails with
// [export.ErrIMEXRequired]. It fails with [export.ErrBadRequest] for no chunks, more
// than [export.MaxChunks], a nil or imported chunk ([vmm.ErrImported]) or chunks of
// different devices; with [ErrNameInUse], [export.ErrBadRange], [ErrMetaTooLong] and
// [export.ErrClosed] as Publish does. On failure nothing is published and no
// descriptor is kept.
func (ex *Exporter) PublishChunks(ctx context.Context, name string, chunks []*vmm.Chunk, s cudart.Stream, opts ...PublishOption) error {
	return ex.PublishChunksAll(ctx, chunks, []ChunkEntry{{Name: name, Options: opts}}, s)
}

// ChunkEntry is one name of a VMM allocation for PublishChunksAll, with its options
// ([Range], [WithMeta]).
type ChunkEntry struct {
	Name    string
	Options []PublishOption
}

// PublishChunksAll is [Exporter.PublishChunks] of one allocation under every entry's
// name at once, each name for its range, all ready once the work queued on s before
// the call has completed. A consumer maps the allocation once, however many of its
// names it opens: their Mappings lie in one range, at their offsets. The allocation
// stays published, and its descriptors kept, until its last name is unpublished. It
// publishes all the entries or, with the error of the first that fails, none; without
// entries it fails with [export.ErrBadRequest].
func (ex *Exporter) PublishChunksAll(ctx context.Context, chunks []*vmm.Chunk, entries []ChunkEntry, s cudart.Stream) error {
	if len(entries) == 0 {
		return fmt.Errorf("producer: publish chunks: %w: no names", export.ErrBadRequest)
	}
	for _, e := range entries {
		if err := wire.CheckName(e.Name); err != nil {
			return err
		}
	}
	a, err := newVMMAlloc(entries[0].Name, chunks)
	if err != nil {
		return err
	}
	pubs, err := a.publications(entries)
	if err == nil {
		err = ctx.Err()
	}
	var re *readyEvent
	if err == nil {
		if re, err = ex.readyFor(a.dev, s); err != nil {
			err = fmt.Errorf("producer: publish %q: %w", entries[0].Name, err)
		}
	}
	if err != nil {
		a.retire()
		return err
	}
	ex.mu.Lock()
	defer ex.mu.Unlock()
	if err := ex.addVMMLocked(a, pubs, re, s); err != nil {
		a.retire()
		return err
	}
	return nil
}

// publications are the publications of a the entries ask for.
func (a *vmmAlloc) publications(entries []ChunkEntry) ([]*publication, error) {
	pubs := make([]*publication, len(entries))
	seen := make(map[string]bool, len(entries))
	for i, e := range entries {
		if seen[e.Name] {
			return nil, fmt.Errorf("%w: %q twice in one publish", ErrNameInUse, e.Name)
		}
		seen[e.Name] = true
		pub, err := publicationOf(e.Name, a.size, e.Options)
		if err != nil {
			return nil, err
		}
		pub.alloc = a
		pubs[i] = pub
	}
	a.names = len(pubs)
	return pubs, nil
}

// addVMMLocked publishes pubs, all of a, after the work queued on s, unless one of
// their names is taken or the Exporter closed. Call with ex.mu held.
func (ex *Exporter) addVMMLocked(a *vmmAlloc, pubs []*publication, re *readyEvent, s cudart.Stream) error {
	if ex.closed {
		return export.ErrClosed
	}
	for _, pub := range pubs {
		if ex.nameTakenLocked(pub.name) {
			return fmt.Errorf("%w: %q", ErrNameInUse, pub.name)
		}
	}
	// Recorded under mu, as PublishAll does: no Open sees the names before the
	// producer's writes are captured.
	if err := ex.rt.EventRecord(re.dev, re.ev, s); err != nil {
		return fmt.Errorf("producer: publish %q: record ready event: %w", pubs[0].name, err)
	}
	ex.lastAlloc++
	a.id = ex.lastAlloc
	a.dropped = ex.dropChunks // before anyone else sees a: unguarded
	for _, pub := range pubs {
		pub.ready = re
		ex.pubs[pub.name] = pub
	}
	return nil
}

// newVMMAlloc checks chunks and takes a descriptor (and a FABRIC handle, where the
// chunk has one) of each. On failure it keeps none.
func newVMMAlloc(name string, chunks []*vmm.Chunk) (*vmmAlloc, error) {
	switch {
	case len(chunks) == 0:
		return nil, fmt.Errorf("producer: publish %q: %w: no chunks", name, export.ErrBadRequest)
	case len(chunks) > export.MaxChunks:
		return nil, fmt.Errorf("producer: publish %q: %w: %d chunks, at most %d", name, export.ErrBadRequest, len(chunks), export.MaxChunks)
	}
	a := &vmmAlloc{dev: -1, fabric: true}
	for i, c := range chunks {
		var err error
		switch {
		case c == nil:
			err = fmt.Errorf("%w: chunk %d is nil", export.ErrBadRequest, i)
		case c.Imported():
			err = fmt.Errorf("%w: chunk %d: %w", export.ErrBadRequest, i, vmm.ErrImported)
		case i > 0 && c.Device() != a.dev:
			err = fmt.Errorf("%w: chunk %d is on device %d, chunk 0 on %d", export.ErrBadRequest, i, c.Device(), a.dev)
		}
		if err == nil {
			err = a.add(c)
		}
		if err != nil {
			a.retire()
			return nil, fmt.Errorf("producer: publish %q: %w", name, err)
		}
	}
	return a, nil
}

// add takes c's descriptor, and its FABRIC handle if it has one.
func (a *vmmAlloc) add(c *vmm.Chunk) error {
	a.dev = c.Device()
	fd, err := c.Export()
	if err != nil {
		return err
	}
	vc := vmmChunk{size: c.Size(), fd: fd}
	a.chunks = append(a.chunks, vc) // from now on retire closes fd
	a.size += c.Size()
	if c.HandleType()&cudart.HandleTypeFabric == 0 {
		a.fabric = false
		return nil
	}
	if a.chunks[len(a.chunks)-1].fab, err = c.ExportFabric(); err != nil {
		if errors.Is(err, cudart.ErrNotPermitted) {
			return fmt.Errorf("%w: %w", export.ErrIMEXRequired, err)
		}
		return err
	}
	return nil
}

// unpublished says that one of a's names is no longer published: the last retires a.
func (a *vmmAlloc) unpublished() {
	a.mu.Lock()
	a.names--
	last := a.names == 0
	a.mu.Unlock()
	if last {
		a.retire()
	}
}

// retire ends the publication: the descriptors are closed now, or by the last grant
// that is sending them. A second retire changes nothing.
func (a *vmmAlloc) retire() {
	a.mu.Lock()
	a.retired = true
	last := a.sending == 0
	a.mu.Unlock()
	if last {
		a.closeFDs()
	}
}

// closeFDs closes the exporter's descriptors, once, and then tells the peers that
// imported the chunks to drop them.
func (a *vmmAlloc) closeFDs() {
	a.mu.Lock()
	chunks := a.chunks
	a.chunks = nil
	a.mu.Unlock()
	for _, c := range chunks {
		_ = unix.Close(c.fd) // cleanup: the descriptor is ours and unused
	}
	a.mu.Lock()
	dropped := a.dropped
	a.mu.Unlock()
	if chunks != nil && dropped != nil {
		dropped(a)
	}
}

// dropChunks tells each peer a's chunks were sent to that a is unpublished, so that it
// closes its imports of them (DropChunks). Each is told on a goroutine of its own: a
// peer that stopped reading holds up no other, and no caller of Unpublish.
func (ex *Exporter) dropChunks(a *vmmAlloc) {
	for _, p := range ex.peerList() {
		p.mu.Lock()
		sent := p.sentAllocs[a]
		delete(p.sentAllocs, a)
		p.mu.Unlock()
		if sent {
			go func() {
				ctx, cancel := bounded()
				defer cancel()
				if err := p.c.Send(ctx, &wire.DropChunksMsg{AllocID: a.id}, -1); err != nil {
					p.ex.log.Debug("producer: could not tell a peer to drop an allocation's chunks; they go with its connection", "pid", p.pid(), "err", err)
				}
			}()
		}
	}
}

// send runs f with the chunks, whose descriptors stay open until it returns; once the
// publication has ended it fails with export.ErrUnknownName.
func (a *vmmAlloc) send(name string, f func([]vmmChunk) error) error {
	a.mu.Lock()
	if a.retired {
		a.mu.Unlock()
		return fmt.Errorf("%w: %q was unpublished as it was leased", export.ErrUnknownName, name)
	}
	a.sending++
	chunks := a.chunks
	a.mu.Unlock()
	err := f(chunks)
	a.mu.Lock()
	a.sending--
	last := a.retired && a.sending == 0
	a.mu.Unlock()
	if last {
		a.closeFDs()
	}
	return err
}

// prepareVMM sends the chunks of pub's allocation to the peer unless it has them, and
// returns the Lease message that names the allocation. LeaseID and ReqID are left to
// the caller.
func (p *peer) prepareVMM(ctx context.Context, pub *publication) (wire.LeaseMsg, error) {
	a := pub.alloc
	var ht cudart.HandleType
	switch {
	case p.c.CanPassFDs() && p.hello.HandleTypes&uint32(cudart.HandleTypePosixFD) != 0:
		ht = cudart.HandleTypePosixFD
	case a.fabric && p.hello.HandleTypes&uint32(cudart.HandleTypeFabric) != 0:
		ht = cudart.HandleTypeFabric
	case !p.c.CanPassFDs():
		return wire.LeaseMsg{}, fmt.Errorf("%w: %q: chunks without a FABRIC handle cannot travel on a byte stream; make them with vmm.WithFabric", export.ErrHandleType, pub.name)
	default:
		return wire.LeaseMsg{}, fmt.Errorf("%w: %q: the peer imports %#x", export.ErrHandleType, pub.name, p.hello.HandleTypes)
	}
	if err := p.sendChunks(ctx, pub.name, a, ht); err != nil {
		return wire.LeaseMsg{}, err
	}
	msg := wire.LeaseMsg{PoolID: a.id, Size: a.size, Offset: pub.offset, Length: pub.length,
		Meta: pub.meta, Flags: wire.LeaseVMM}
	if err := p.readyFields(pub, &msg); err != nil {
		return wire.LeaseMsg{}, err
	}
	return msg, nil
}

// sendChunks sends a's chunks to the peer as ht, once per peer and allocation: the
// peer keeps its imports until DropChunks (dropChunks) or the connection's end. The
// pool handles' lock is held across it, so that the chunks go once and before any
// Lease that names a; waiting for it ends with ctx.
func (p *peer) sendChunks(ctx context.Context, name string, a *vmmAlloc, ht cudart.HandleType) error {
	if err := p.poolLock.Acquire(ctx, 1); err != nil {
		return fmt.Errorf("producer: send the chunks of %q: %w", name, err)
	}
	defer p.poolLock.Release(1)
	p.mu.Lock()
	sent := p.sentAllocs[a]
	p.mu.Unlock()
	if sent {
		return nil
	}
	return a.send(name, func(chunks []vmmChunk) error {
		for i, c := range chunks {
			m := &wire.ChunkHandleMsg{AllocID: a.id, Size: c.size, Index: uint32(i), Count: uint32(len(chunks)),
				HandleType: ht, Device: p.ex.deviceUUID(a.dev)}
			fd := -1
			if ht == cudart.HandleTypeFabric {
				m.Fabric = c.fab
			} else {
				fd = c.fd // sendmsg duplicates it into the peer
			}
			if err := p.c.Send(ctx, m, fd); err != nil {
				return err
			}
		}
		// Marked while a.send still holds the descriptors open: the drop, which
		// follows their close, then sees it.
		p.mu.Lock()
		p.sentAllocs[a] = true
		p.mu.Unlock()
		return nil
	})
}
