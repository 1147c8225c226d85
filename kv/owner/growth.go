package owner

import (
	"context"
	"errors"
	"fmt"
	"math/rand/v2"

	"github.com/dustin/go-humanize"
	"golang.org/x/sys/unix"

	"github.com/cudapool/cudapool/cudart"
	"github.com/cudapool/cudapool/kv"
	"github.com/cudapool/cudapool/kv/internal/kvwire"
	"github.com/cudapool/cudapool/kv/internal/slabmap"
	"github.com/cudapool/cudapool/vmm"
)

// A slab on the VMM route (kv.SlabLayout): the owner reserves each region's addresses
// for the slab's bound, makes chunks (vmm.NewChunk) as pages are needed, maps them
// itself (its copies use them) and passes each chunk's descriptor to every replica on
// its connection (Grow frames, SCM_RIGHTS), which maps it in place. A growth reaches
// every welcomed connection before it returns, and so before any reply that grants a
// page in its chunks; a replica maps a Grow before it reads the next frame.

// layoutOf is the layout of geo's slabs on device dev with chunks of chunk bytes (0:
// kv.DefaultChunkBytes), checked against the device's granularity for ht.
func layoutOf(rt cudart.Runtime, dev int, geo kv.Geometry, chunk uint64, ht cudart.HandleType) (kv.SlabLayout, error) {
	if err := geo.Validate(); err != nil {
		return kv.SlabLayout{}, err
	}
	g, err := vmm.Granularity(rt, dev, ht)
	if err != nil {
		return kv.SlabLayout{}, fmt.Errorf("kv/owner: %w", err)
	}
	if chunk == 0 {
		chunk = kv.DefaultChunkBytes(geo, g)
	}
	if chunk%g != 0 {
		return kv.SlabLayout{}, fmt.Errorf("%w: chunks of %d bytes (%s): not a multiple of device %d's granularity, %s",
			kv.ErrGeometry, chunk, humanize.IBytes(chunk), dev, humanize.IBytes(g))
	}
	return geo.SlabLayout(chunk)
}

// handleTypeOf is the handle type the slabs' chunks are made for.
func handleTypeOf(o options) cudart.HandleType {
	if o.Fabric {
		return cudart.HandleTypePosixFD | cudart.HandleTypeFabric
	}
	return cudart.HandleTypePosixFD
}

// probeFabric makes and releases one FABRIC chunk of the granularity on dev: where the
// driver refuses them (vmm.ErrFabricNotPermitted, no IMEX channel) Listen fails before
// it has made anything, a keeper started included.
func probeFabric(rt cudart.Runtime, dev int) error {
	ht := cudart.HandleTypePosixFD | cudart.HandleTypeFabric
	g, err := vmm.Granularity(rt, dev, ht)
	if err != nil {
		return fmt.Errorf("kv/owner: %w", err)
	}
	c, err := vmm.NewChunk(rt, dev, g, vmm.WithFabric())
	if err != nil {
		return fmt.Errorf("kv/owner: FABRIC chunks on device %d: %w", dev, err)
	}
	return c.Close()
}

// mapSlab reserves device s.dev's regions, with access for the devices of peers, and
// names the slab.
func (o *Owner) mapSlab(s *slab, peers []int) error {
	access := []cudart.AccessDesc{{Location: cudart.DeviceLocation(s.dev), Flags: cudart.AccessReadWrite}}
	for _, p := range peers {
		access = append(access, cudart.AccessDesc{Location: cudart.DeviceLocation(p), Flags: cudart.AccessReadWrite})
	}
	m, err := slabmap.New(o.rt, s.dev, o.layout, vmm.WithAccess(access...))
	if err != nil {
		return fmt.Errorf("kv/owner: the slab of device %d: %w", s.dev, err)
	}
	s.m, s.bases = m, m.Bases()
	s.id = rand.Uint64()
	s.name = kvwire.SlabName(s.dev, s.id)
	return nil
}

// initialChunks is the chunks a slab of l maps at its start for WithInitialPages(n).
func initialChunks(l kv.SlabLayout, n int) int {
	return l.ChunksFor(max(n, 1))
}

// growFor grows s, before an Alloc of n pages evicts, where its table has fewer than
// n free pages and room to grow: enough whole steps for the difference. It is called
// without o.mu. It says whether the table grew; a growth that fails (the device's
// memory) is logged, and the Alloc evicts instead.
func (o *Owner) growFor(s *slab, n int) bool {
	o.mu.Lock()
	st := s.tab.Stats()
	o.mu.Unlock()
	if st.Free >= n || st.Pages >= st.Bound {
		return false
	}
	want := o.layout.ChunksFor(min(st.Bound, st.Pages+n-st.Free))
	s.grow.Lock()
	to := s.mayGrowTo(want)
	more := to - len(s.fds)
	s.grow.Unlock()
	if more <= 0 {
		return true // another Alloc grew it meanwhile
	}
	if err := o.growSlab(s, more); err != nil {
		o.log.Warn("kv: the slab cannot grow; pages are evicted instead", "device", s.dev, "err", err)
	} else {
		o.log.Info("kv: the slab grew", "device", s.dev, "chunks", to)
	}
	return true
}

// growSlab maps n more chunks into s, made here, passes each to every replica
// connection of s as soon as it is mapped here (one that cannot take it is cut off),
// so that a replica maps a chunk while the next is made, and then grows s's table to
// the pages they hold, if it has one: no reply grants a page in them before every
// connection has them. On failure the chunks made before the one that failed stay
// mapped, passed and in the table.
func (o *Owner) growSlab(s *slab, n int) error {
	s.grow.Lock()
	defer s.grow.Unlock()
	from := len(s.fds)
	var err error
	for range n {
		if err = o.makeChunk(s); err != nil {
			break
		}
		i := len(s.fds) - 1
		for c := range s.reached {
			if werr := c.sendChunks(i, s.fds[i:]); werr != nil {
				o.log.Warn("kv: a replica cannot take the slab's growth; it is cut off", "pid", c.cred.PID, "err", werr)
				delete(s.reached, c)
				_ = c.nc.Close() // cleanup: the write's failure is what ends the connection
			}
		}
	}
	if len(s.fds) == from {
		return err
	}
	o.mu.Lock()
	s.chunks = len(s.fds)
	if s.tab != nil {
		if to := o.layout.MappedPages(s.chunks); to > s.tab.Mapped() {
			if gerr := s.tab.Grow(to); gerr != nil {
				err = errors.Join(err, fmt.Errorf("kv/owner: the table of device %d: %w", s.dev, gerr))
			}
			s.spaceLocked()
		}
	}
	o.mu.Unlock()
	return err
}

// makeChunk makes s's next chunk, maps it and keeps its descriptor; s.grow is held.
func (o *Owner) makeChunk(s *slab) error {
	var copts []vmm.ChunkOption
	if o.opts.Fabric {
		copts = append(copts, vmm.WithFabric())
	}
	i := len(s.fds)
	c, err := vmm.NewChunk(o.rt, s.dev, o.layout.ChunkBytes(), copts...)
	if err != nil {
		return fmt.Errorf("kv/owner: chunk %d of the slab of device %d (%s, %s mapped): %w", i, s.dev,
			humanize.IBytes(o.layout.ChunkBytes()), humanize.IBytes(o.layout.MappedBytes(i)), err)
	}
	// The mapping and the descriptor keep the memory: the handle goes either way.
	defer func() { _ = c.Close() }()
	if err := s.m.Grow(c); err != nil {
		return fmt.Errorf("kv/owner: mapping chunk %d of device %d: %w", i, s.dev, err)
	}
	fd, err := c.Export()
	if err != nil {
		return errors.Join(fmt.Errorf("kv/owner: exporting chunk %d of device %d: %w", i, s.dev, err), s.m.Shrink(1))
	}
	if o.keeper != nil { // kept before any page in it is granted, so that a restart finds it
		ctx, cancel := context.WithTimeout(o.stopped, keeperTimeout)
		err := o.keeper.Put(ctx, o.chunkName(s, i), fd, o.layout.ChunkBytes())
		cancel()
		if err != nil {
			_ = unix.Close(fd) // cleanup: the chunk goes with its mapping
			return errors.Join(fmt.Errorf("kv/owner: giving chunk %d of device %d to the keeper: %w", i, s.dev, err), s.m.Shrink(1))
		}
	}
	s.fds = append(s.fds, fd)
	return nil
}

// unmapChunks shrinks s to its first keep chunks, a whole number of steps, once its
// table has given back the pages past them (pages.Table.Shrink, then Shrunk): every
// replica connection is told (a Shrink frame; one that cannot take it is cut off),
// this process unmaps them, the keeper drops them and their descriptors close, so
// that their memory goes back to the driver once every replica has unmapped them
// too. It fails, changing nothing, where the table still has pages in them or keep
// is not a whole number of steps below the chunks mapped.
func (o *Owner) unmapChunks(s *slab, keep int) error {
	s.grow.Lock()
	defer s.grow.Unlock()
	n := len(s.fds)
	if err := o.keepable(n, keep); err != nil {
		return err
	}
	o.mu.Lock()
	pages := 0
	if s.tab != nil {
		pages = s.tab.Mapped() // past the chunks kept while a shrink is not over (Shrunk)
	}
	o.mu.Unlock()
	if keepPages := o.layout.MappedPages(keep); pages > keepPages {
		return fmt.Errorf("%w: the table of device %d has %d pages, %d chunks hold %d: give them back first", kv.ErrGeometry, s.dev, pages, keep, keepPages)
	}
	for c := range s.reached {
		if err := c.w.Write(context.Background(), func(b []byte) ([]byte, error) { return kvwire.AppendShrink(b, kvwire.Shrink{Chunks: uint32(keep)}) }); err != nil {
			o.log.Warn("kv: a replica cannot take the slab's shrink; it is cut off", "pid", c.cred.PID, "err", err)
			delete(s.reached, c)
			_ = c.nc.Close() // cleanup: the write's failure is what ends the connection
		}
	}
	if err := s.m.Shrink(n - keep); err != nil {
		return fmt.Errorf("kv/owner: unmapping chunks %d to %d of device %d: %w", keep, n-1, s.dev, err)
	}
	var errs []error
	for i := n - 1; i >= keep; i-- {
		if o.keeper != nil {
			ctx, cancel := context.WithTimeout(o.stopped, keeperTimeout)
			if err := o.keeper.Drop(ctx, o.chunkName(s, i)); err != nil {
				errs = append(errs, fmt.Errorf("kv/owner: the keeper's chunk %d of device %d: %w", i, s.dev, err))
			}
			cancel()
		}
		_ = unix.Close(s.fds[i]) // cleanup: the chunk goes once every mapping of it has
	}
	s.fds = s.fds[:keep]
	o.mu.Lock()
	s.chunks = keep
	o.mu.Unlock()
	return errors.Join(errs...)
}

// keepable says why a slab of n chunks cannot shrink to keep: a whole number of
// steps, at least one, fewer than n.
func (o *Owner) keepable(n, keep int) error {
	if keep < o.layout.Regions() || keep >= n || keep%o.layout.Regions() != 0 {
		return fmt.Errorf("%w: keep %d of %d chunks: a whole number of steps of %d, at least one, fewer than mapped", kv.ErrGeometry, keep, n, o.layout.Regions())
	}
	return nil
}

// welcome answers a replica's Hello (request id) with the Welcome and every chunk of
// s, and makes c one that later growths reach.
func (c *conn) welcome(s *slab, id uint32) error {
	o := c.o
	s.grow.Lock()
	defer s.grow.Unlock()
	err := c.write(func(b []byte) ([]byte, error) {
		return kvwire.AppendWelcome(b, id, kvwire.Welcome{Geometry: o.geo, ChunkBytes: o.layout.ChunkBytes(), Chunks: uint32(len(s.fds)), Keeper: uint32(o.recovery.KeeperPID), Slab: s.name})
	})
	if err == nil {
		err = c.sendChunks(0, s.fds)
	}
	if err != nil {
		return err
	}
	s.reached[c] = struct{}{}
	return nil
}

// unreach makes c one that growths no longer reach.
func (c *conn) unreach(s *slab) {
	s.grow.Lock()
	delete(s.reached, c)
	s.grow.Unlock()
}

// sendChunks sends chunks from on, fds, a Grow frame each.
func (c *conn) sendChunks(from int, fds []int) error {
	for i, fd := range fds {
		m := kvwire.Grow{Chunk: uint32(from + i)}
		if err := c.w.WriteFD(context.Background(), fd, func(b []byte) ([]byte, error) { return kvwire.AppendGrow(b, m) }); err != nil {
			return err
		}
	}
	return nil
}

// closeSlab unmaps s's chunks and closes their descriptors: the memory lives on while
// a replica maps it (or the keeper holds a descriptor). The work queued on s's stream
// must have completed.
func (s *slab) closeSlab() error {
	s.grow.Lock()
	defer s.grow.Unlock()
	for _, fd := range s.fds {
		_ = unix.Close(fd) // cleanup: the memory lives on in its mappings
	}
	s.fds = nil
	if s.m == nil {
		return nil
	}
	return s.m.Close()
}
