package owner

import (
	"bufio"
	"bytes"
	"context"
	"errors"
	"fmt"
	"os"
	"runtime"
	"strconv"
	"strings"
	"time"

	"github.com/dustin/go-humanize"
	"golang.org/x/sys/unix"

	"github.com/cudapool/cudapool/cudart"
	"github.com/cudapool/cudapool/kv"
	"github.com/cudapool/cudapool/kv/internal/index"
)

// The host tier of a device (WithHostBytes): pinned host memory that holds sealed
// pages the slab evicts, so that a later match gets them back instead of a miss.
//
// Its memory is a memfd, sealed at its size, mapped and registered with the runtime
// (portable and mapped), so that the batch copy kernel reads and writes it straight
// from the GPU. A host page holds one page contiguously: every layer's K then V
// piece, layer by layer (hostOffset), 2 x layers pieces of Geometry.PageBytes each.
// The memfd is handed to every replica of the device at dial (hostsock.go): a replica
// maps it, which keeps the tier's memory alive as long as any process maps it, and
// lets a replica read host pages by itself.
//
// A host page is free, filling (a spill copy in flight into it) or sealed (in the
// tier's own index, hash -> host page, and its own LRU list). Pages leave the GPU tier
// for the host tier and the host tier for nowhere: the least recently used page of
// either tier goes first, a sealed GPU page on eviction becoming the most recent host
// page. A page is never evicted from either tier while it is leased (on the GPU) or
// while a copy reads it.
//
// Spill: a spiller goroutine per tier keeps the least recently used sealed GPU pages
// (up to hostTier.ahead of them) also in the host tier, copying them ahead in batches of
// spillBatch pages, each one MemcpyBatchAsync on the tier's stream. A GPU page whose
// bytes are in the host tier (its twin) is evicted for free: its host page stays. The
// spill is never on the path of a match or an alloc: they only read the index, and a
// GPU page being copied out is held (as a reader holds it) until the copy has
// completed, so it is never reused before. A page an alloc or a restore evicts before
// the spiller got to it is copied out by that call, before the page is written (the
// alloc answers after the copy; the restore queues it ahead of its own copy on the
// tier's stream); one evicted otherwise (by a copy from another device) is gone.
//
// Restore: a match whose run goes on in the host tier takes GPU pages for those
// hashes, copies the host pages into them in one MemcpyBatchAsync on the tier's
// stream, waits for it on the host, publishes them in the slab's index and leases the
// run, all in the same reply. The restored GPU pages keep their host pages as twins.

// spillBatch is the most pages one spill copies: one kernel launch.
const spillBatch = 512

// maxAhead bounds the pages kept copied ahead: 4 GiB of llama-0.85b pages, room for a
// few 32k prompts to be restored over pages whose eviction is free. A quarter of the
// slab and an eighth of the tier bound it too: the copies ahead hold host pages twice.
const maxAhead = 8192

// rescanEvery is how often a pick starts from the LRU tail however far the mark got.
const rescanEvery = 64

// hostTier is one device's host tier. Everything but the fields set at Listen is
// guarded by the Owner's mu.
type hostTier struct {
	s         *slab
	fd        int    // the memfd; the owner keeps it to hand to replicas
	kept      bool   // the memfd is the keeper's, made before this Listen (keeptier.go)
	mem       []byte // its mapping, registered
	dptr      cudart.DevicePtr
	pageBytes uint64 // one host page: 2 x layers pieces
	stream    cudart.Stream
	spillEv   cudart.Event // the spiller's, one batch at a time
	path      cudart.CopyPath
	ahead     int // sealed GPU pages, from the LRU tail, kept copied in the host tier

	pages      []hostPage
	free       []uint32
	index      map[kv.Hash]uint32
	head, tail uint32         // LRU of sealed host pages: head most recent
	twin       []uint32       // by GPU page: the host page holding its bytes, none, or filling
	events     []cudart.Event // spare, for copies other than the spiller's
	stats      kv.HostStats

	// capture is set while a caller that copies them takes slab pages (takeLocked):
	// sealed pages without a host copy that it evicts are put in evictedNow, each with
	// a host page, instead of being lost.
	capture    bool
	evictedNow spillTask

	mark     uint32 // the most recent slab page a pick examined, or none (pickSpillLocked)
	markSeen int    // the evictable pages from the tail to the mark, when examined
	picks    uint64 // picks made

	// lastFree is the sequence number of the latest host page eviction queued in the
	// index: a page it evicted is filled again only once the index has it.
	lastFree uint64

	kick chan struct{}
	want bool // pages were sealed since the spiller last looked for pages to copy
	busy bool // the spiller copies a batch
}

// filling marks, in hostTier.twin, a GPU page whose spill copy is in flight.
const filling = none - 1

type hostPageState uint8

const (
	hostFree hostPageState = iota
	hostFilling
	hostSealed
)

type hostPage struct {
	hash       kv.Hash
	prev, next uint32 // LRU neighbours, for a sealed host page: prev is more recent
	gpu        uint32 // the GPU page holding the same bytes, or none
	pins       uint32 // restores reading it
	state      hostPageState
}

// piece is the device address of layer's part (K or V) of page p of s: where a
// page's pieces lie in the slab's segments is segs' to say.
func (s *slab) piece(segs kv.Segments, layer int, part kv.Part, p uint32) cudart.DevicePtr {
	return segs.Addr(s.bases, layer, part, int(p))
}

// hostOffset is where layer's part (K or V) lies in a host page: K then V, layer by
// layer.
func hostOffset(g kv.Geometry, layer int, part kv.Part) uint64 {
	i := uint64(2 * layer)
	if part == kv.V {
		i++
	}
	return i * g.PageBytes()
}

// HostPageBytes is the size of one host page of g: every layer's K and V.
func HostPageBytes(g kv.Geometry) uint64 { return 2 * uint64(g.Layers) * g.PageBytes() }

// memAvailable is /proc/meminfo's MemAvailable, in bytes.
func memAvailable() (uint64, error) {
	b, err := os.ReadFile("/proc/meminfo")
	if err != nil {
		return 0, err
	}
	sc := bufio.NewScanner(bytes.NewReader(b))
	for sc.Scan() {
		f := bytes.Fields(sc.Bytes())
		if len(f) >= 2 && string(f[0]) == "MemAvailable:" {
			kb, err := strconv.ParseUint(string(f[1]), 10, 64)
			if err != nil {
				return 0, fmt.Errorf("/proc/meminfo: %w", err)
			}
			return kb << 10, nil
		}
	}
	return 0, errors.New("/proc/meminfo has no MemAvailable")
}

// checkHostBytes refuses a host tier that cannot be: smaller than one page, or, over
// every device, larger than the host's available memory.
func checkHostBytes(o options) error {
	if o.HostBytes == 0 {
		return nil
	}
	pb := HostPageBytes(o.Geometry)
	if o.HostBytes < pb {
		return fmt.Errorf("%w: a host tier of %d bytes holds no page of %s", kv.ErrGeometry, o.HostBytes, humanize.IBytes(pb))
	}
	avail, err := memAvailable()
	if err != nil {
		return fmt.Errorf("kv/owner: cannot size the host tier: %w", err)
	}
	devs := uint64(max(len(o.Devices), 1))
	if o.HostBytes > avail/devs { // not o.HostBytes*devs > avail: that may overflow
		return fmt.Errorf("%w: host tiers of %s on each of %d devices are larger than the host's available memory, %s (MemAvailable)",
			kv.ErrHostMemory, humanize.IBytes(o.HostBytes), devs, humanize.IBytes(avail))
	}
	return nil
}

// hostPagesOf is the pages of each device's host tier that o asks for.
func hostPagesOf(o options) uint64 {
	return min(o.HostBytes/HostPageBytes(o.Geometry), uint64(none-2))
}

// makeTier makes s's host tier of o.HostBytes: the memfd, sealed, mapped and
// registered, its stream and events. On failure nothing of it is left.
func (o *Owner) makeTier(s *slab) (_ *hostTier, err error) {
	pb := HostPageBytes(o.geo)
	n := hostPagesOf(o.opts)
	t := &hostTier{s: s, fd: -1, pageBytes: pb, index: make(map[kv.Hash]uint32), head: none, tail: none, mark: none,
		pages: make([]hostPage, n), free: make([]uint32, n), twin: make([]uint32, len(s.pages)),
		kick: make(chan struct{}, 1)}
	for i := range t.free {
		t.free[i] = uint32(n - 1 - uint64(i))
		t.pages[i] = hostPage{prev: none, next: none, gpu: none}
	}
	for i := range t.twin {
		t.twin[i] = none
	}
	t.ahead = max(min(len(s.pages)/4, int(n)/8, maxAhead), 1)
	defer func() {
		if err != nil {
			_ = o.closeTier(t) // cleanup: the first error is the one returned
		}
	}()
	size := n * pb
	if o.imp == nil {
		if t.fd, err = makeTierFD(s.dev, size); err != nil {
			return nil, err
		}
	} else {
		// The keeper's slabs: the keeper holds the memfd too (keeptier.go).
		ctx, cancel := context.WithTimeout(context.Background(), keeperTimeout)
		var dropped string
		t.fd, t.kept, dropped, err = o.keptTierFD(ctx, s.dev, size, func() (int, error) { return makeTierFD(s.dev, size) })
		cancel()
		if err != nil {
			return nil, err
		}
		if t.kept {
			o.recovery.HostTiersKept++
		}
		if dropped != "" {
			o.recovery.Dropped = strings.TrimPrefix(o.recovery.Dropped+"; "+dropped, "; ")
		}
	}
	if t.mem, err = unix.Mmap(t.fd, 0, int(size), unix.PROT_READ|unix.PROT_WRITE, unix.MAP_SHARED); err != nil {
		return nil, fmt.Errorf("kv/owner: host tier of device %d: mapping %s: %w", s.dev, humanize.IBytes(size), err)
	}
	if err = o.rt.HostRegister(s.dev, t.mem, cudart.HostRegisterPortable|cudart.HostRegisterMapped); err != nil {
		mem := t.mem
		t.mem = nil
		_ = unix.Munmap(mem) // cleanup: the registration's failure is the error returned
		return nil, fmt.Errorf("kv/owner: host tier of device %d: the runtime cannot register (pin) %s of host memory: %w", s.dev, humanize.IBytes(size), err)
	}
	if t.dptr, err = o.rt.HostDevicePointer(s.dev, t.mem); err != nil {
		return nil, fmt.Errorf("kv/owner: host tier of device %d: %w", s.dev, err)
	}
	if t.path, err = o.rt.BatchCopyPath(s.dev); err != nil {
		return nil, fmt.Errorf("kv/owner: host tier of device %d: %w", s.dev, err)
	}
	if t.stream, err = o.rt.StreamCreate(s.dev, cudart.StreamNonBlocking); err != nil {
		return nil, fmt.Errorf("kv/owner: host tier of device %d: %w", s.dev, err)
	}
	if t.spillEv, err = o.rt.EventCreate(s.dev, cudart.EventDisableTiming); err != nil {
		return nil, fmt.Errorf("kv/owner: host tier of device %d: %w", s.dev, err)
	}
	t.stats = kv.HostStats{Bytes: size, Pages: int(n), PageBytes: pb, CopyPath: t.path.String()}
	return t, nil
}

// restoreTier seals the host pages the index held (least recent first) in t, a tier
// whose memory the keeper kept, and journals them again. A page out of the tier's
// range, or a hash held already, is skipped. It returns how many it restored.
func (t *hostTier) restoreTier(sealed []index.Page) int {
	n := 0
	for _, sp := range sealed {
		if int(sp.Page) >= len(t.pages) || t.pages[sp.Page].state != hostFree {
			continue
		}
		if _, dup := t.index[sp.Hash]; dup {
			continue
		}
		t.seal(sp.Page, sp.Hash, none)
		n++
	}
	if n == 0 {
		return 0
	}
	t.free = t.free[:0]
	for p := len(t.pages) - 1; p >= 0; p-- {
		if t.pages[p].state == hostFree {
			t.free = append(t.free, uint32(p))
		}
	}
	return n
}

// makeTierFD makes device dev's host tier memfd of size bytes, sealed at that size.
// On failure no descriptor is left open.
func makeTierFD(dev int, size uint64) (_ int, err error) {
	fd, err := unix.MemfdCreate(fmt.Sprintf("cudapool-kv-host-%d", dev), unix.MFD_CLOEXEC|unix.MFD_ALLOW_SEALING)
	if err != nil {
		return -1, fmt.Errorf("kv/owner: host tier of device %d: memfd_create: %w", dev, err)
	}
	if err = unix.Ftruncate(fd, int64(size)); err != nil {
		_ = unix.Close(fd) // cleanup: the size's error is the one returned
		return -1, fmt.Errorf("kv/owner: host tier of device %d: sizing the memfd to %s: %w", dev, humanize.IBytes(size), err)
	}
	if _, err = unix.FcntlInt(uintptr(fd), unix.F_ADD_SEALS, unix.F_SEAL_SHRINK|unix.F_SEAL_GROW|unix.F_SEAL_SEAL); err != nil {
		_ = unix.Close(fd) // cleanup: the seal's error is the one returned
		return -1, fmt.Errorf("kv/owner: host tier of device %d: sealing the memfd: %w", dev, err)
	}
	return fd, nil
}

// closeTier undoes makeTier, once the spiller has stopped and no restore runs: the
// tier's stream is synchronised first, so that nothing touches the memory after.
func (o *Owner) closeTier(t *hostTier) error {
	var errs []error
	dev := t.s.dev
	if t.stream != 0 {
		if err := o.rt.StreamSynchronize(dev, t.stream); err != nil {
			errs = append(errs, fmt.Errorf("kv/owner: the host tier's stream of device %d: %w", dev, err))
		}
	}
	for _, ev := range append(t.events, t.spillEv) {
		if ev != 0 {
			if err := o.rt.EventDestroy(dev, ev); err != nil {
				errs = append(errs, err)
			}
		}
	}
	if t.stream != 0 {
		if err := o.rt.StreamDestroy(dev, t.stream); err != nil {
			errs = append(errs, err)
		}
	}
	if t.mem != nil {
		if err := o.rt.HostUnregister(dev, t.mem); err != nil {
			errs = append(errs, fmt.Errorf("kv/owner: unregistering the host tier of device %d: %w", dev, err))
		}
		if err := unix.Munmap(t.mem); err != nil {
			errs = append(errs, err)
		}
		t.mem = nil
	}
	if t.fd >= 0 {
		_ = unix.Close(t.fd) // cleanup: nothing is left to do if closing fails
		t.fd = -1
	}
	return errors.Join(errs...)
}

// unlink takes sealed host page p out of the LRU list.
func (t *hostTier) unlink(p uint32) { lruRemove(&t.head, &t.tail, p, t.links) }

// pushFront makes host page p the most recent; p must not be in the list.
func (t *hostTier) pushFront(p uint32) { lruPushFront(&t.head, &t.tail, p, t.links) }

// links are host page p's LRU neighbours.
func (t *hostTier) links(p uint32) (prev, next *uint32) { return &t.pages[p].prev, &t.pages[p].next }

// touch makes sealed host page p the most recent.
func (t *hostTier) touch(p uint32) {
	if t.head != p {
		t.unlink(p)
		t.pushFront(p)
	}
}

// evictable says whether sealed host page p may go: no restore reads it, and the GPU
// page it twins (if any) is not leased.
func (t *hostTier) evictable(p uint32) bool {
	pg := &t.pages[p]
	return pg.pins == 0 && (pg.gpu == none || t.s.pages[pg.gpu].readers == 0)
}

// take returns a host page to fill: a free one, else the least recent evictable
// sealed one, evicted: the caller waits for t.lastFree (Owner.journaled) before it
// fills the page. ok is false if there is none.
func (t *hostTier) take() (uint32, bool) {
	if n := len(t.free); n > 0 {
		p := t.free[n-1]
		t.free = t.free[:n-1]
		t.pages[p].state = hostFilling
		return p, true
	}
	for p := t.tail; p != none; p = t.pages[p].prev {
		if t.evictable(p) {
			t.evict(p) // its record is queued; the filler waits for t.lastFree
			return t.take()
		}
	}
	return 0, false
}

// evict drops sealed host page p: out of the index and the LRU list, to free.
func (t *hostTier) evict(p uint32) {
	pg := &t.pages[p]
	delete(t.index, pg.hash)
	t.lastFree = t.s.ix.HostFree(t.s.dev, p)
	t.unlink(p)
	if pg.gpu != none {
		t.twin[pg.gpu] = none
	}
	t.stats.Evictions++
	t.release(p)
}

// release makes host page p free.
func (t *hostTier) release(p uint32) {
	t.pages[p] = hostPage{prev: none, next: none, gpu: none}
	t.free = append(t.free, p)
}

// seal makes host page hp hold hash h, a copy of GPU page gp (none if that page is no
// longer h), unless h is held already: then hp is freed and the holder is linked.
func (t *hostTier) seal(hp uint32, h kv.Hash, gp uint32) {
	if have, dup := t.index[h]; dup {
		t.release(hp)
		hp = have
	} else {
		pg := &t.pages[hp]
		pg.state, pg.hash = hostSealed, h
		t.index[h] = hp
		t.pushFront(hp)
		t.s.ix.HostSeal(t.s.dev, hp, h) // its spill copy has completed
	}
	if gp != none {
		t.link(gp, hp)
	}
}

// link makes host page hp the twin of GPU page gp.
func (t *hostTier) link(gp, hp uint32) {
	if old := t.pages[hp].gpu; old != none && old != gp {
		t.twin[old] = none
	}
	t.pages[hp].gpu = gp
	t.twin[gp] = hp
}

// evicted is told that the slab evicts sealed GPU page gp, which held h: its host twin
// becomes the most recent host page; without one, the page is gone.
func (t *hostTier) evicted(gp uint32, h kv.Hash) {
	hp := t.twin[gp]
	t.twin[gp] = none
	if t.markSeen > 0 {
		t.markSeen-- // evictions take the tail, below the mark
	}
	if hp != none && hp != filling { // filling cannot be: a page being copied out is held
		t.pages[hp].gpu = none
		t.touch(hp)
		t.stats.Spilled++
		return
	}
	if _, ok := t.index[h]; ok {
		return // the host tier holds the hash already
	}
	if t.capture {
		if hp, ok := t.take(); ok {
			e := &t.evictedNow
			e.gpu, e.host, e.hashes = append(e.gpu, gp), append(e.host, hp), append(e.hashes, h)
			return
		}
	}
	t.stats.Lost++
}

// takeLocked is s.take for a caller that will write the pages it gets: sealed pages it
// evicts that the host tier holds no copy of are given host pages, and returned, to be
// copied out (copyEvicted) before the pages are written. Under o.mu.
//
// The task's wait is the sequence number of the evictions' records (GPU and host
// pages), 0 if it evicted nothing: no page it evicted may be written before the index
// has them (Owner.journaled), lest a restart publish the page under its old hash.
func (o *Owner) takeLocked(s *slab, n int) ([]uint32, bool, spillTask) {
	t := s.tier
	evictions := s.stats.Evictions
	if t == nil {
		pages, ok := s.take(n, make([]uint32, 0, n))
		task := spillTask{}
		if s.stats.Evictions != evictions {
			task.wait = s.lastFree
		}
		return pages, ok, task
	}
	hostEvictions := t.stats.Evictions
	t.capture = true
	pages, ok := s.take(n, make([]uint32, 0, n))
	t.capture = false
	task := t.evictedNow
	t.evictedNow = spillTask{}
	if s.stats.Evictions != evictions || t.stats.Evictions != hostEvictions {
		task.wait = max(s.lastFree, t.lastFree)
	}
	return pages, ok, task
}

// copyEvicted copies the pages takeLocked evicted into their host pages, on the tier's
// stream, then more: restore (nil: none) is queued behind it, in the same stream
// order, so that a restore into pages just evicted reads nothing overwritten. It
// waits for the evictions' records first (task.wait: no evicted page, GPU or host, is
// written before the index has it), then for the copies on the host, then seals the
// host pages (their slab pages are reused: no twins). On failure the host pages are
// freed, and the error returned.
func (o *Owner) copyEvicted(s *slab, task spillTask, restore []cudart.CopyPiece) error {
	t := s.tier
	if t == nil || (len(task.gpu) == 0 && len(restore) == 0) {
		return nil
	}
	var ev cudart.Event
	err := o.journaled(o.stopped, task.wait)
	if err == nil {
		o.mu.Lock()
		ev, err = t.eventLocked(o)
		o.mu.Unlock()
	}
	start := time.Now()
	if err == nil && len(task.gpu) > 0 {
		err = o.rt.MemcpyBatchAsync(s.dev, o.tierPieces(t, task.gpu, task.host, false), t.stream)
	}
	spilled := time.Since(start)
	if err == nil && len(restore) > 0 {
		err = o.rt.MemcpyBatchAsync(s.dev, restore, t.stream)
	}
	if err == nil {
		err = o.rt.EventRecord(s.dev, ev, t.stream)
	}
	if err == nil {
		err = o.waitEvent(o.stopped, s.dev, ev)
	} else {
		err = fmt.Errorf("%w (and the stream: %w)", err, o.rt.StreamSynchronize(s.dev, t.stream))
	}
	took := time.Since(start)
	o.mu.Lock()
	defer o.mu.Unlock()
	if ev != 0 {
		t.events = append(t.events, ev)
	}
	for i, hp := range task.host {
		if err != nil {
			t.release(hp)
			t.stats.Lost++
			continue
		}
		t.seal(hp, task.hashes[i], none)
		t.stats.Spilled++
	}
	if err != nil {
		return err
	}
	if n := uint64(len(task.gpu)); n > 0 {
		t.stats.Spills += n
		t.stats.SpillBytes += n * t.pageBytes
		if len(restore) == 0 {
			spilled = took
		}
		t.stats.SpillNanos += uint64(spilled) // with a restore behind it: its submission, a bound below
	}
	if len(restore) > 0 {
		t.stats.RestoreNanos += uint64(took)
	}
	return nil
}

// eventLocked is an event for one copy: a spare one, or a new one. The caller puts it
// back in events when done. Under o.mu.
func (t *hostTier) eventLocked(o *Owner) (cudart.Event, error) {
	if n := len(t.events); n > 0 {
		ev := t.events[n-1]
		t.events = t.events[:n-1]
		return ev, nil
	}
	return o.rt.EventCreate(t.s.dev, cudart.EventDisableTiming)
}

// wake tells the spiller that the slab has new sealed pages, under o.mu. Evictions do
// not wake it: the pages they free are about to be written, and the spiller copies
// once they are sealed.
func (t *hostTier) wake() {
	t.want = true
	kick(t.kick)
}

func kick(ch chan struct{}) {
	select {
	case ch <- struct{}{}:
	default:
	}
}

// snapshot is the tier's stats, its pages counted by state.
func (t *hostTier) snapshot() *kv.HostStats {
	st := t.stats
	st.Free = len(t.free)
	for i := range t.pages {
		switch pg := &t.pages[i]; pg.state {
		case hostFilling:
			st.Filling++
		case hostSealed:
			st.Sealed++
			if pg.gpu != none {
				st.Twins++
			}
		}
	}
	return &st
}

// spillTask is one spill: GPU pages and the host pages they go to, and the sequence
// number of the evictions' records to wait for before the copy (0: none).
type spillTask struct {
	gpu, host []uint32
	hashes    []kv.Hash
	wait      uint64
}

// spiller copies the least recently used sealed GPU pages ahead into the host tier,
// until ctx ends.
func (o *Owner) spiller(ctx context.Context, t *hostTier) {
	var task spillTask
	for {
		o.mu.Lock()
		task.gpu = task.gpu[:0]
		if t.want { // a wake-up with nothing asked since (a stale one) changes nothing
			t.want = false
			o.pickSpillLocked(t, &task)
		}
		t.busy = len(task.gpu) > 0
		wait := t.lastFree // the host pages it evicted are free in the index before they are filled
		o.mu.Unlock()
		if !t.busy {
			select {
			case <-t.kick:
				continue
			case <-ctx.Done():
				return
			}
		}
		err := o.journaled(ctx, wait)
		if err == nil {
			err = o.spill(ctx, t, &task)
		}
		o.mu.Lock()
		for i, gp := range task.gpu {
			t.s.pages[gp].readers--
			t.twin[gp] = none
			if err != nil {
				t.release(task.host[i])
				continue
			}
			t.seal(task.host[i], task.hashes[i], gp)
		}
		if err == nil {
			t.stats.Spills += uint64(len(task.gpu))
			t.stats.SpillBytes += uint64(len(task.gpu)) * t.pageBytes
			t.want = true // a full batch may have left more to copy
		}
		o.mu.Unlock()
		if err != nil {
			if ctx.Err() == nil {
				o.log.Error("kv: spilling pages to the host tier failed; the spiller stops", "device", t.s.dev, "err", err)
			}
			return
		}
	}
}

// pickSpillLocked fills task with up to spillBatch sealed GPU pages without a host
// copy among the t.ahead least recent evictable ones, and host pages for them, under
// o.mu. Each GPU page is held (a reader) until its copy has completed. A page whose
// hash the host tier holds already is linked to it, without a copy.
//
// It goes on from t.mark, the most recent page an earlier pick examined, rather than
// from the LRU tail: pages enter the list at its head only, so what lies below the
// mark was examined, and a pick costs the pages it adds, not a walk of the whole
// window under o.mu at every seal (BenchmarkPickSpill). The mark is dropped when its page leaves the list, and the next pick starts
// from the tail, as does every rescanEvery'th: markSeen only guesses once pages below
// the mark leave the list other than by eviction, and a page below the mark that
// becomes evictable again (its readers gone) is not copied ahead until then (its
// eviction copies it meanwhile, takeLocked).
func (o *Owner) pickSpillLocked(t *hostTier, task *spillTask) {
	s := t.s
	task.gpu, task.host, task.hashes = task.gpu[:0], task.host[:0], task.hashes[:0]
	t.picks++
	if t.picks%rescanEvery == 0 {
		t.mark, t.markSeen = none, 0
	}
	p, seen := s.tail, 0
	if t.mark != none {
		p, seen = s.pages[t.mark].prev, t.markSeen
	}
	for ; p != none && seen < t.ahead && len(task.gpu) < spillBatch; p = s.pages[p].prev {
		if !s.evictable(p) {
			t.mark = p
			continue // leased: it stays in the slab, and so does its copy, if any
		}
		if t.twin[p] == none {
			h := s.pages[p].hash
			if hp, ok := t.index[h]; ok {
				t.link(p, hp)
			} else {
				hp, ok := t.take()
				if !ok {
					return
				}
				t.twin[p] = filling
				s.pages[p].readers++
				task.gpu, task.host, task.hashes = append(task.gpu, p), append(task.host, hp), append(task.hashes, h)
			}
		}
		seen++
		t.mark, t.markSeen = p, seen
	}
}

// unlinked is told that the slab takes page p out of its LRU list (evicted, or
// touched to its head): if p is the mark, the next pick starts from the tail.
func (t *hostTier) unlinked(p uint32) {
	if p == t.mark {
		t.mark, t.markSeen = none, 0
	}
}

// spill copies task's GPU pages into their host pages, one batch on the tier's stream,
// and waits for it.
func (o *Owner) spill(ctx context.Context, t *hostTier, task *spillTask) error {
	pieces := o.tierPieces(t, task.gpu, task.host, false)
	start := time.Now()
	if err := o.rt.MemcpyBatchAsync(t.s.dev, pieces, t.stream); err != nil {
		return errors.Join(err, o.rt.StreamSynchronize(t.s.dev, t.stream))
	}
	if err := o.rt.EventRecord(t.s.dev, t.spillEv, t.stream); err != nil {
		return errors.Join(err, o.rt.StreamSynchronize(t.s.dev, t.stream))
	}
	err := o.waitEvent(ctx, t.s.dev, t.spillEv)
	o.mu.Lock()
	t.stats.SpillNanos += uint64(time.Since(start))
	o.mu.Unlock()
	return err
}

// tierPieces are the copies of GPU pages gpu to host pages host (restore: the other
// way), every layer's K and V piece.
func (o *Owner) tierPieces(t *hostTier, gpu, host []uint32, restore bool) []cudart.CopyPiece {
	g := o.geo
	pieces := make([]cudart.CopyPiece, 0, len(gpu)*2*g.Layers)
	for i, gp := range gpu {
		base := t.dptr + cudart.DevicePtr(uint64(host[i])*t.pageBytes)
		for l := range g.Layers {
			for _, part := range [2]kv.Part{kv.K, kv.V} {
				pc := cudart.CopyPiece{Dst: base + cudart.DevicePtr(hostOffset(g, l, part)), Src: t.s.piece(o.segs, l, part, gp), Size: g.PageBytes()}
				if restore {
					pc.Dst, pc.Src = pc.Src, pc.Dst
				}
				pieces = append(pieces, pc)
			}
		}
	}
	return pieces
}

// WaitSpills waits until every device's spiller has copied ahead all it means to,
// for now, and the index (WithIndex) has written what was queued by then: the least
// recently used sealed pages of each slab are also in its host tier, so that evicting
// them is free, and a restart now restores them. It returns at once without host
// tiers, and ctx's error if ctx ends first. A later seal or eviction gives the spiller
// more to do.
func (o *Owner) WaitSpills(ctx context.Context) error {
	for {
		o.mu.Lock()
		idle := true
		for _, s := range o.slabs {
			if t := s.tier; t != nil && (t.want || t.busy) {
				idle = false
			}
		}
		o.mu.Unlock()
		if idle {
			if err := o.ix.Wait(ctx, o.ix.Queued()); err != nil && ctx.Err() != nil {
				return ctx.Err()
			}
			return nil // an index that failed said so in the log
		}
		t := time.NewTimer(100 * time.Microsecond)
		select {
		case <-t.C:
		case <-ctx.Done():
			t.Stop()
			return ctx.Err()
		}
	}
}

// waitEvent waits on the host until ev has completed or ctx has ended: it asks at once,
// then yields a while, then sleeps, 20 µs up to 100 µs: a restore is a reply waited on.
func (o *Owner) waitEvent(ctx context.Context, dev int, ev cudart.Event) error {
	sleep := 20 * time.Microsecond
	for i := 0; ; i++ {
		done, err := o.rt.EventQuery(dev, ev)
		if err != nil || done {
			return err
		}
		if i < 64 {
			runtime.Gosched()
			continue
		}
		t := time.NewTimer(sleep)
		select {
		case <-t.C:
		case <-ctx.Done():
			t.Stop()
			return ctx.Err()
		}
		sleep = min(2*sleep, 100*time.Microsecond)
	}
}
