package consumer

import (
	"context"
	"errors"
	"fmt"
	"math"
	"sync"

	"github.com/cudapool/cudapool/cudart"
	"github.com/cudapool/cudapool/export"
	"github.com/cudapool/cudapool/pool"
)

// local copies is what an Importer keeps for WithLocalCopy, made at the first local copy: a
// copier per device whose memory it copies, and the count of local copies not yet freed,
// so that the pools it made outlive the Importer until the last one is released.
type localCopies struct {
	mu      sync.Mutex
	copiers map[int]*copier // by owner device
	live    int             // local copies not yet freed
	closed  bool            // the Importer closed: the pools go with the last local copy
}

// copier copies memory of one owner device into local copies on the Importer's device.
type copier struct {
	owner int // the owner device's ordinal here; -1 if this process does not see it
	// stream is a stream of the owner device, and copied an event of it recorded
	// after each copy, which the caller's stream waits on. Both are 0 when the copy
	// runs on the caller's stream: the owner is the Importer's device (or unseen).
	stream cudart.Stream
	copied cudart.Event
	// pool is where WithLocalCopy(nil) takes local copies from: this Importer's, on its
	// device, granting the owner device access, so that no user's pool changes.
	pool *pool.Pool
}

// onOwner says whether the copy runs on a stream of the owner device rather than on
// the caller's.
func (c *copier) onOwner() bool { return c.stream != 0 }

// copyLocally turns src, a Mapping just opened (s waits for the producer's writes
// already), into a local copy: memory of the Importer's device from a (nil: the
// copier's pool), filled from src through the owner device, and src released after
// the copy. The local copy holds no lease, and outlives its producer on any GPU.
func (imp *Importer) copyLocally(ctx context.Context, src *Mapping, s cudart.Stream, a pool.Allocator) (*Mapping, error) {
	c, err := imp.claimCopier(src.owner)
	if err != nil {
		return nil, errors.Join(err, src.Release(ctx, s))
	}
	b, from, err := imp.fill(ctx, c, src, s, a)
	if err != nil {
		imp.dropLocalCopy()
		return nil, errors.Join(err, src.Release(ctx, s))
	}
	// s is ordered after the copy, and Release frees the import after s.
	if err := src.Release(ctx, s); err != nil {
		err = errors.Join(err, from.Free(b, s))
		imp.dropLocalCopy()
		return nil, err
	}
	r := &Mapping{imp: imp, ptr: b.Ptr(), size: src.size, name: src.name, meta: src.meta, localCopy: b, localCopyFrom: from, refs: 1}
	return r, nil
}

// fill allocates the local copy on s and copies src into it through c, ordered after the
// work queued on s so far and before the work queued on s after it returns.
func (imp *Importer) fill(ctx context.Context, c *copier, src *Mapping, s cudart.Stream, a pool.Allocator) (*pool.Buffer, pool.Allocator, error) {
	if a == nil {
		a = c.pool
	} else if err := imp.checkLocalCopyAllocator(a, c); err != nil {
		return nil, nil, err
	}
	b, err := a.Alloc(ctx, src.size, s)
	if err != nil {
		return nil, nil, fmt.Errorf("allocate the local copy: %w", err)
	}
	if err := imp.copyThrough(c, b.Ptr(), src.ptr, src.size, s); err != nil {
		if c.onOwner() && errors.Is(err, cudart.ErrInvalidValue) {
			err = fmt.Errorf("through device %d, the exporter's (the local copy's allocator must let it write: pool.WithPeerAccess(%d)): %w", c.owner, c.owner, err)
		}
		return nil, nil, errors.Join(fmt.Errorf("copy into the local copy: %w", err), a.Free(b, s))
	}
	return b, a, nil
}

// copyThrough queues the copy of n bytes from src to dst through c, on the caller's
// stream s or ordered after it. On failure s is ordered after whatever of the copy
// was queued, or the host waited for it.
func (imp *Importer) copyThrough(c *copier, dst, src cudart.DevicePtr, n uint64, s cudart.Stream) error {
	rt := imp.rt
	if !c.onOwner() {
		return rt.MemcpyDtoDAsync(imp.dev, dst, src, n, s)
	}
	rs := &imp.localCopies
	rs.mu.Lock()
	defer rs.mu.Unlock()
	if rs.closed {
		return export.ErrClosed
	}
	// The owner's stream waits for s: the producer's writes (Open's wait), the
	// local copy's allocation and whatever used its memory before. The event is this
	// copy's own: one event recorded on several callers' streams could be reached
	// by a later record on another stream before this one has run.
	queued, err := rt.EventCreate(imp.dev, cudart.EventDisableTiming)
	if err != nil {
		return err
	}
	defer func() { _ = rt.EventDestroy(imp.dev, queued) }() // a wait queued on it holds it until done
	if err := rt.EventRecord(imp.dev, queued, s); err != nil {
		return err
	}
	if err := rt.StreamWaitEvent(c.owner, c.stream, queued); err != nil {
		return err
	}
	if err := rt.MemcpyDtoDAsync(c.owner, dst, src, n, c.stream); err != nil {
		return err
	}
	err = rt.EventRecord(c.owner, c.copied, c.stream)
	if err == nil {
		err = rt.StreamWaitEvent(imp.dev, s, c.copied)
	}
	if err != nil {
		// s is not ordered after the copy, and the local copy and the import are freed
		// after s: wait for the copy here.
		return errors.Join(err, rt.StreamSynchronize(c.owner, c.stream))
	}
	return nil
}

// claimCopier returns the copier of owner, made on first use, and counts one local copy
// more, which dropLocalCopy (or freeLocalCopy) takes back: the copiers' pools stay open
// while any is counted.
func (imp *Importer) claimCopier(owner int) (*copier, error) {
	rs := &imp.localCopies
	rs.mu.Lock()
	defer rs.mu.Unlock()
	if rs.closed {
		return nil, export.ErrClosed
	}
	c := rs.copiers[owner]
	if c == nil {
		var err error
		if c, err = imp.newCopier(owner); err != nil {
			return nil, err
		}
		if rs.copiers == nil {
			rs.copiers = map[int]*copier{}
		}
		rs.copiers[owner] = c
	}
	rs.live++
	return c, nil
}

// newCopier makes a copier of owner; on failure it leaves nothing behind. Call with
// local copies.mu held.
func (imp *Importer) newCopier(owner int) (_ *copier, err error) {
	rt := imp.rt
	c := &copier{owner: owner}
	defer func() {
		if err != nil {
			imp.stopCopies(c)
		}
	}()
	// The pool keeps the memory of released local copies for the next ones: given back at
	// each synchronisation, every local copy maps its memory afresh (256 MiB on the GPU
	// host, 2026-11-30: a local copy took 2.0 ms, a read of the buffer over NVLink
	// 0.69 ms). The memory goes with the pool, after the Importer and its local copies.
	opts := []pool.Option{
		pool.WithHandleType(cudart.HandleTypeNone), pool.WithReleaseThreshold(math.MaxUint64),
		pool.WithName(fmt.Sprintf("export local copies of device %d", owner)),
	}
	if owner >= 0 && owner != imp.dev {
		opts = append(opts, pool.WithPeerAccess(owner))
		if c.stream, err = rt.StreamCreate(owner, cudart.StreamNonBlocking); err != nil {
			return nil, fmt.Errorf("a stream of device %d, the exporter's, for local copy copies: %w", owner, err)
		}
		if c.copied, err = rt.EventCreate(owner, cudart.EventDisableTiming); err != nil {
			return nil, fmt.Errorf("the local copy copies' event on device %d: %w", owner, err)
		}
	}
	if c.pool, err = pool.New(rt, imp.dev, opts...); err != nil {
		return nil, fmt.Errorf("the local copies' pool: %w", err)
	}
	return c, nil
}

// checkLocalCopyAllocator refuses an allocator of another device, or one whose pool does
// not let the owner device write it (the copy runs there). An allocator that does not
// say its pool (no Handle method) is taken at its word: the copy fails if it lied.
func (imp *Importer) checkLocalCopyAllocator(a pool.Allocator, c *copier) error {
	if a.Device() != imp.dev {
		return fmt.Errorf("the local copy's allocator is on device %d, the Importer on %d", a.Device(), imp.dev)
	}
	h, ok := a.(interface{ Handle() cudart.MemPool })
	if !c.onOwner() || !ok {
		return nil
	}
	flags, err := imp.rt.MemPoolGetAccess(imp.dev, h.Handle(), cudart.DeviceLocation(c.owner))
	if err != nil {
		return fmt.Errorf("ask whether device %d may write the local copy's pool: %w", c.owner, err)
	}
	if flags != cudart.AccessReadWrite {
		return fmt.Errorf("%w: the local copy is copied through device %d, the exporter's, which its pool does not let write it: make the pool with pool.WithPeerAccess(%d)",
			pool.ErrNoPeerAccess, c.owner, c.owner)
	}
	return nil
}

// freeLocalCopy frees m's local copy after the work queued on s. Call with mapMu held.
func (imp *Importer) freeLocalCopy(m *Mapping, s cudart.Stream) error {
	if err := m.localCopyFrom.Free(m.localCopy, s); err != nil {
		return fmt.Errorf("consumer: release %q: free the local copy: %w", m.name, err)
	}
	imp.dropLocalCopy()
	return nil
}

// dropLocalCopy counts one local copy less; the last of a closed Importer closes the
// copiers' pools.
func (imp *Importer) dropLocalCopy() {
	rs := &imp.localCopies
	rs.mu.Lock()
	defer rs.mu.Unlock()
	if rs.live--; rs.live == 0 && rs.closed {
		imp.closeLocalCopyPools()
	}
}

// closeLocalCopies destroys the copiers' streams and events once their copies are done,
// and their pools now if no local copy is left (else with the last one). Errors are
// logged: they leave nothing the caller could act on.
func (imp *Importer) closeLocalCopies() {
	rs := &imp.localCopies
	rs.mu.Lock()
	defer rs.mu.Unlock()
	if rs.closed {
		return
	}
	rs.closed = true
	for _, c := range rs.copiers {
		imp.stopCopies(c)
	}
	if rs.live == 0 {
		imp.closeLocalCopyPools()
	}
}

// stopCopies destroys c's stream and event once its copies are done. Call with
// local copies.mu held.
func (imp *Importer) stopCopies(c *copier) {
	rt := imp.rt
	if c.stream != 0 {
		imp.logCleanup("local copy copies' stream sync", rt.StreamSynchronize(c.owner, c.stream))
	}
	if c.copied != 0 {
		imp.logCleanup("local copy copies' event", rt.EventDestroy(c.owner, c.copied))
	}
	if c.stream != 0 {
		imp.logCleanup("local copy copies' stream", rt.StreamDestroy(c.owner, c.stream))
	}
	c.stream, c.copied = 0, 0
}

// closeLocalCopyPools closes the copiers' pools, which hold no local copy any more. Call
// with local copies.mu held.
func (imp *Importer) closeLocalCopyPools() {
	for _, c := range imp.localCopies.copiers {
		imp.closePool(c)
	}
	imp.localCopies.copiers = nil
}

func (imp *Importer) closePool(c *copier) {
	if c.pool != nil {
		_, err := c.pool.Close(context.Background())
		imp.logCleanup("local copies' pool", err)
		c.pool = nil
	}
}

func (imp *Importer) logCleanup(what string, err error) {
	if err != nil {
		imp.log.Warn("consumer: importer cleanup", "what", what, "err", err)
	}
}

// ordinalOf is the ordinal in this process of the device whose UUID is u, or -1 if
// the process does not see it (another host's, or one CUDA_VISIBLE_DEVICES hides).
func (imp *Importer) ordinalOf(u cudart.UUID) int {
	if u == imp.devUUID {
		return imp.dev
	}
	n, err := imp.rt.DeviceCount()
	if err != nil {
		return -1
	}
	for i := range n {
		if v, err := imp.rt.DeviceUUID(i); err == nil && v == u {
			return i
		}
	}
	return -1
}
