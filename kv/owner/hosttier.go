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
	"sync"
	"time"

	"github.com/dustin/go-humanize"
	"golang.org/x/sys/unix"

	"github.com/cudapool/cudapool/cudart"
	"github.com/cudapool/cudapool/kv"
	"github.com/cudapool/cudapool/kv/internal/pages"
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
// Its pages are the device's page table's (kv/internal/pages): free, filling or
// sealed, one LRU across both tiers, a host page a restore reads or that twins a
// leased GPU page never evicted. The tier holds the memory and makes the copies the
// table asks for, each MemcpyBatchAsync on the tier's stream, one at a time in the
// order they are started, and reports each one's end (Table.CopyDone):
//
// Spill: a spiller goroutine per tier copies ahead the least recently used sealed GPU
// pages (up to hostTier.ahead of them, spillBatch at a time: Table.PickSpill), so that
// their eviction is free. The spill is never on the path of a match or an alloc. A
// page an alloc or a restore evicts before the spiller got to it is copied out by
// that call (the table's capture copy) before the page is written; one evicted
// otherwise is gone.
//
// Restore: a match whose run goes on in the host tier gets GPU pages for those
// hashes, copied back from the host pages, in the same reply (Table.Match, then
// CopyDone). The restored GPU pages keep their host pages as twins.

// spillBatch is the most pages one spill copies: one kernel launch.
const spillBatch = 512

// maxAhead bounds the pages kept copied ahead: 4 GiB of llama-0.85b pages, room for a
// few 32k prompts to be restored over pages whose eviction is free. A quarter of the
// slab and an eighth of the tier bound it too: the copies ahead hold host pages twice.
const maxAhead = 8192

// hostTier is one device's host tier: its memory, stream and copies. Everything but
// the fields set at Listen is guarded by the Owner's mu.
type hostTier struct {
	s         *slab
	fd        int    // the memfd; the owner keeps it to hand to replicas
	kept      bool   // the memfd is the keeper's, made before this Listen (keeptier.go)
	mem       []byte // its mapping, registered
	dptr      cudart.DevicePtr
	pageBytes uint64 // one host page: 2 x layers pieces
	pages     int    // host pages
	stream    cudart.Stream
	path      cudart.CopyPath
	ahead     int            // sealed GPU pages, from the LRU tail, kept copied in the host tier
	events    []cudart.Event // spare, one per copy in flight
	stats     kv.HostStats   // the bytes and times; the table counts the rest
	streamMu  sync.Mutex     // a copy and its event's record are queued together

	kick chan struct{}
	want bool // pages were sealed since the spiller last looked for pages to copy
	busy bool // the spiller copies a batch
}

// piece is the device address of layer's part (K or V) of page p of s, as l lays
// the slab out.
func (s *slab) piece(l kv.SlabLayout, layer int, part kv.Part, p uint32) cudart.DevicePtr {
	return l.Addr(s.bases, layer, part, int(p))
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
	return min(o.HostBytes/HostPageBytes(o.Geometry), 1<<31)
}

// makeTier makes s's host tier of o.HostBytes: the memfd, sealed, mapped and
// registered, its stream and events. On failure nothing of it is left.
func (o *Owner) makeTier(s *slab) (_ *hostTier, err error) {
	pb := HostPageBytes(o.geo)
	n := hostPagesOf(o.opts)
	t := &hostTier{s: s, fd: -1, pageBytes: pb, pages: int(n), kick: make(chan struct{}, 1)}
	t.ahead = max(min(o.geo.Pages/4, int(n)/8, maxAhead), 1)
	defer func() {
		if err != nil {
			_ = o.closeTier(t) // cleanup: the first error is the one returned
		}
	}()
	size := n * pb
	if o.keeper == nil {
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
	t.stats = kv.HostStats{Bytes: size, PageBytes: pb, CopyPath: t.path.String()}
	return t, nil
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
	for _, ev := range t.events {
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

// statsLocked is the tier's stats that the owner counts (bytes, times, the copy
// path), under o.mu; the table fills in the rest.
func (t *hostTier) statsLocked() *kv.HostStats {
	st := t.stats
	return &st
}

// spiller copies the least recently used sealed GPU pages ahead into the host tier,
// until ctx ends.
func (o *Owner) spiller(ctx context.Context, t *hostTier) {
	s := t.s
	for {
		o.mu.Lock()
		var cp pages.Copy
		var after uint64
		picked := false
		if t.want { // a wake-up with nothing asked since (a stale one) changes nothing
			t.want = false
			var fx pages.Effects
			cp, fx, picked = s.tab.PickSpill(t.ahead, spillBatch)
			after = o.effectsLocked(s, fx)
		}
		t.busy = picked
		o.mu.Unlock()
		if !picked {
			select {
			case <-t.kick:
				continue
			case <-ctx.Done():
				return
			}
		}
		_, _, err := o.runCopy(ctx, s, cp, after)
		if err != nil {
			if ctx.Err() == nil {
				o.log.Error("kv: spilling pages to the host tier failed; the spiller stops", "device", s.dev, "err", err)
			}
			o.mu.Lock()
			t.busy = false
			o.mu.Unlock()
			return
		}
		o.mu.Lock()
		t.want = true // a full batch may have left more to copy
		o.mu.Unlock()
	}
}

// runCopy makes copy cp of s's table: once the index has every record up to after
// and the copies cp waits for have completed, it queues cp on the tier's stream,
// waits for it on the host and reports its end (Table.CopyDone), its effects done
// under o.mu. It returns the copy's answer (a restore's: the match) and the index's
// sequence number that answer waits for. A copy that fails, or that cannot start
// before ctx ends, is reported failed (its pages freed), and its error returned.
func (o *Owner) runCopy(ctx context.Context, s *slab, cp pages.Copy, after uint64) (pages.MatchResult, uint64, error) {
	t := s.tier
	err := o.journaled(ctx, after)
	if err == nil {
		err = o.awaitCopies(ctx, s, cp.Wait)
	}
	var ev cudart.Event
	if err == nil {
		o.mu.Lock()
		if n := len(t.events); n > 0 {
			ev = t.events[n-1]
			t.events = t.events[:n-1]
		}
		o.mu.Unlock()
		if ev == 0 {
			ev, err = o.rt.EventCreate(s.dev, cudart.EventDisableTiming)
		}
	}
	start := time.Now()
	if err == nil {
		err = o.tierCopy(ctx, t, ev, o.tierPieces(t, cp.GPU, cp.Host, cp.Kind == pages.Restore))
	}
	took := uint64(time.Since(start))
	o.mu.Lock()
	defer o.mu.Unlock()
	if ev != 0 {
		t.events = append(t.events, ev)
	}
	res, fx, derr := s.tab.CopyDone(cp.ID, err == nil)
	seq := o.effectsLocked(s, fx)
	if ch := s.copies[cp.ID]; ch != nil {
		close(ch)
		delete(s.copies, cp.ID)
	}
	if err == nil {
		n := uint64(len(cp.GPU))
		if cp.Kind == pages.Restore {
			t.stats.RestoreBytes += n * t.pageBytes
			t.stats.RestoreNanos += took
		} else {
			t.stats.SpillBytes += n * t.pageBytes
			t.stats.SpillNanos += took
		}
	}
	return res, seq, errors.Join(err, derr)
}

// tierCopy queues pieces on t's stream, records ev behind them and waits for it on
// the host, until ctx ends.
func (o *Owner) tierCopy(ctx context.Context, t *hostTier, ev cudart.Event, pieces []cudart.CopyPiece) error {
	dev := t.s.dev
	t.streamMu.Lock()
	err := o.rt.MemcpyBatchAsync(dev, pieces, t.stream)
	if err == nil {
		err = o.rt.EventRecord(dev, ev, t.stream)
	}
	t.streamMu.Unlock()
	if err != nil {
		return errors.Join(err, o.rt.StreamSynchronize(dev, t.stream))
	}
	return o.waitEvent(ctx, dev, ev)
}

// doEffects does, outside o.mu, what an operation of s's table returned that a reply
// waits for: its copies, in order (a capture copy that fails is logged: its pages
// are gone; a restore's answer is returned), the copies it awaits, and the index
// through seq (effectsLocked's).
func (o *Owner) doEffects(s *slab, fx pages.Effects, seq uint64) (pages.MatchResult, error) {
	var res pages.MatchResult
	var err error
	for _, cp := range fx.Copies {
		r, rseq, cerr := o.runCopy(o.stopped, s, cp, seq)
		switch {
		case cp.Kind == pages.Restore:
			res, seq = r, max(seq, rseq)
			if cerr != nil {
				o.log.Error("kv: restoring pages from the host tier failed; the match ends before them", "device", s.dev, "err", cerr)
			}
		case cerr != nil:
			o.log.Error("kv: spilling evicted pages to the host tier failed; they are gone", "device", s.dev, "err", cerr)
		}
	}
	if err = o.awaitCopies(o.stopped, s, fx.Await); err != nil {
		return res, err
	}
	return res, o.journaled(o.stopped, seq)
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
				pc := cudart.CopyPiece{Dst: base + cudart.DevicePtr(hostOffset(g, l, part)), Src: t.s.piece(o.layout, l, part, gp), Size: g.PageBytes()}
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
