package owner

import (
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"syscall"
	"time"

	"github.com/dustin/go-humanize"
	"golang.org/x/sys/unix"

	"github.com/cudapool/cudapool/cudart"
	"github.com/cudapool/cudapool/export"
	"github.com/cudapool/cudapool/export/consumer"
	"github.com/cudapool/cudapool/export/producer"
	"github.com/cudapool/cudapool/internal/peercred"
	"github.com/cudapool/cudapool/kv"
	"github.com/cudapool/cudapool/kv/internal/index"
	"github.com/cudapool/cudapool/kv/internal/kvwire"
	"github.com/cudapool/cudapool/kv/internal/pages"
)

// A cache that survives its owner. The slabs live in a keeper process (Keep: the
// pools, the allocations and the exporter on dir/slab.sock, nothing else), and the
// page server (Listen given WithKeeper) imports them from it, as every replica
// does. So the page server's death changes nothing for the slabs or the replicas'
// mappings; a new page server on the same directory adopts the slabs from the live
// keeper, restores the visible pages from the index file (WithIndex, journal.go)
// and takes back the leases the replicas re-declare (Reattach). When the keeper is
// gone the slabs are gone: the next page server starts a new keeper, and says so.

// The files a page server makes in its directory besides the sockets.
const (
	LockFile  = "owner.lock" // held (flock) by the live page server
	IndexFile = "index"      // the index of visible pages, kvpoold's default WithIndex
)

// DefaultReattachGrace is how long a restarted owner waits, at most, for the replicas
// attached to its predecessor to re-declare their leases before it lets pages be
// allocated (WithReattachGrace).
const DefaultReattachGrace = 5 * time.Second

// Recovery says what Listen took back from the owner before it.
type Recovery struct {
	// Adopted says the slabs are a live keeper's, made before this Listen; false on
	// a first start, after the keeper died (the cache is gone) or for slabs the owner
	// makes itself.
	Adopted bool
	// KeeperPID is the keeper's pid (WithKeeper), else 0.
	KeeperPID int
	// Pages are the visible pages restored from the index, all devices together.
	Pages int
	// Replicas are the replicas attached before, whose leases wait for them.
	Replicas int
	// WriteLeases are the write leases granted before to processes that live: their
	// pages are kept for their writers until each re-declares them, ends its list of
	// leases without them, or exits.
	WriteLeases int
	// HostTiersKept counts the devices whose host tier memory the keeper held and
	// the page server took back (keeptier.go).
	HostTiersKept int
	// HostPages are the sealed host pages restored from the index, all devices
	// together: only those of a kept tier.
	HostPages int
	// Dropped says why the slabs, the index or a host tier's memory were not taken
	// back; "" if they were, or if there was nothing to take.
	Dropped string
}

// String is one line for a log or a first line.
func (r Recovery) String() string {
	var b strings.Builder
	switch {
	case r.Adopted:
		fmt.Fprintf(&b, "cache adopted from keeper pid %d: %d visible pages restored, %d replicas to reattach", r.KeeperPID, r.Pages, r.Replicas)
		if r.WriteLeases > 0 {
			fmt.Fprintf(&b, ", the pages of %d write leases kept for their writers", r.WriteLeases)
		}
	case r.KeeperPID != 0:
		fmt.Fprintf(&b, "new cache in keeper pid %d", r.KeeperPID)
	default:
		b.WriteString("new cache")
	}
	if r.HostTiersKept > 0 {
		fmt.Fprintf(&b, ", %d host pages restored (the host tier of %d devices kept)", r.HostPages, r.HostTiersKept)
	}
	if r.Dropped != "" {
		fmt.Fprintf(&b, " (%s)", r.Dropped)
	}
	return b.String()
}

// Recovery says what Listen took back.
func (o *Owner) Recovery() Recovery { return o.recovery }

// KeeperGone is closed when the keeper of an owner's adopted slabs has gone
// (WithKeeper: its slabs' exporter or its keep.sock connection ended): the slabs and
// the host tiers' memory it kept are gone with it, and the owner should be closed and
// started again. nil for an owner that makes its own slabs.
func (o *Owner) KeeperGone() <-chan struct{} { return o.keeperGone }

// Keeper holds the slabs of a directory for the page servers that come and go: it
// makes a pool and a slab on each device and publishes them on dir/slab.sock, as
// Listen does, and serves no pages. It holds file descriptors too, on dir/keep.sock
// (keeptier.go): the host tiers' memfds, so that they outlive the page server as the
// slabs do. A Keeper of KeepFiles holds the descriptors alone.
type Keeper struct {
	o     *Owner // the slabs; nil for KeepFiles
	files keptFiles
}

// Keep makes a Keeper on dir of slabs of geometry geo, with the devices, segment
// bound, policy, logger, limits and announcement opts set (WithKeeper and the page
// server's other options have no effect), and serves dir/keep.sock. A live keeper (or
// owner of its own slabs) on dir makes it fail with an error wrapping
// producer.ErrAddressInUse. On failure nothing is left behind.
func Keep(dir string, rt cudart.Runtime, geo kv.Geometry, opts ...Option) (*Keeper, error) {
	o := optionsOf(geo, opts)
	ow, err := listen(dir, rt, o, roleKeeper)
	if err != nil {
		return nil, err
	}
	k := &Keeper{o: ow}
	if err := k.files.serve(dir, ow.opts); err != nil {
		_ = ow.Close(context.Background()) // cleanup: the socket's error is the one returned
		return nil, err
	}
	return k, nil
}

// Importers counts the processes that map the keeper's slabs (page servers and
// replicas); 0 for a Keeper of KeepFiles, which sees no mapping.
func (k *Keeper) Importers() int {
	if k.o == nil {
		return 0
	}
	return len(k.o.ex.Peers())
}

// Close ends the keeper: the descriptors it holds are closed first (their memory lives
// on while a process holds or maps it); then the exporter waits, until ctx ends, for
// the importers to unmap the slabs, and frees them. A second Close returns
// kv.ErrClosed.
func (k *Keeper) Close(ctx context.Context) error {
	closed := k.files.close()
	if k.o != nil {
		return k.o.Close(ctx)
	}
	if !closed {
		return kv.ErrClosed
	}
	return nil
}

// role is what listen makes.
type role int

const (
	roleWhole  role = iota // slabs and pages in one process: Listen without Keeper
	roleKeeper             // the slabs alone: Keep
	rolePages              // the pages, over a keeper's slabs: Listen with Keeper
)

// lockDir takes the lock file name on dir (who takes it: "an owner", "a keeper"), or
// fails naming the holder with an error wrapping producer.ErrAddressInUse.
func lockDir(dir, name, who string) (*os.File, error) {
	path := filepath.Join(dir, name)
	f, err := os.OpenFile(path, os.O_RDWR|os.O_CREATE, 0o600)
	if err != nil {
		return nil, fmt.Errorf("kv/owner: the lock: %w", err)
	}
	if err := unix.Flock(int(f.Fd()), unix.LOCK_EX|unix.LOCK_NB); err != nil {
		holder, _ := os.ReadFile(path) // best effort: it only names the holder
		_ = f.Close()                  // cleanup: the lock's error is the one returned
		if errors.Is(err, unix.EWOULDBLOCK) {
			return nil, fmt.Errorf("kv/owner: %s already serves %s (%s holds %s): %w", who, dir, strings.TrimSpace(string(holder)), path, producer.ErrAddressInUse)
		}
		return nil, fmt.Errorf("kv/owner: locking %s: %w", path, err)
	}
	// The holder's pid, for the message above; the lock is what counts.
	if err := f.Truncate(0); err == nil {
		_, _ = fmt.Fprintf(f, "pid %d\n", os.Getpid()) // best effort: only messages read it
	}
	return f, nil
}

// keeperTimeout bounds the dial of the keeper, and its start.
const keeperTimeout = 30 * time.Second

// adoptSlabs imports each device's slab from the keeper on dir/slab.sock, starting one
// (WithKeeper's start) if none is alive or if the live one keeps slabs of another
// geometry or other devices, which it stops first.
func (o *Owner) adoptSlabs() error {
	ctx, cancel := context.WithTimeout(context.Background(), keeperTimeout)
	defer cancel()
	path := filepath.Join(o.dir, SlabSocket)
	started := false
	start := func() error {
		if o.opts.StartKeeper == nil {
			return fmt.Errorf("kv/owner: no keeper serves %s, and WithKeeper's start is nil", path)
		}
		if err := o.opts.StartKeeper(ctx); err != nil {
			return fmt.Errorf("kv/owner: starting the keeper: %w", err)
		}
		started = true
		return nil
	}
	for attempt := 0; ; attempt++ {
		var dopts []consumer.DialOption
		if started {
			dopts = append(dopts, consumer.WaitForExporter())
		}
		imp, err := consumer.Dial(ctx, path, o.rt, o.opts.Devices[0], append(dopts, consumer.WithLogger(o.log))...)
		if errors.Is(err, export.ErrExporterGone) && !started {
			if err := start(); err != nil {
				return err
			}
			continue
		}
		if err != nil {
			return fmt.Errorf("kv/owner: the keeper: %w", err)
		}
		o.imp = imp
		why, err := o.openSlabs(ctx)
		if err != nil {
			return err
		}
		if why == "" {
			o.recovery.Adopted = !started
			o.recovery.KeeperPID = imp.ExporterPID()
			return nil
		}
		if started || attempt > 0 {
			return fmt.Errorf("kv/owner: the keeper it started: %s", why)
		}
		// Refuse the old slabs: stop their keeper, and start one of this geometry.
		o.recovery.Dropped = why + ": the old slabs and index are dropped, and their host tiers (kept by that keeper) with them"
		pid := imp.ExporterPID()
		o.log.Warn("kv: the live keeper's slabs do not fit; stopping it", "pid", pid, "why", why)
		if err := o.closeImport(ctx); err != nil {
			return err
		}
		if err := StopKeeper(ctx, pid); err != nil {
			return err
		}
		if err := start(); err != nil {
			return err
		}
	}
}

// openSlabs maps each device's slab, segment by segment, through o.imp; why says what
// does not fit.
func (o *Owner) openSlabs(ctx context.Context) (why string, err error) {
	for _, d := range o.opts.Devices {
		s := newSlab(d)
		s.name = kvwire.SlabName(d)
		o.slabs = append(o.slabs, s)
		o.byDev[d] = s
		if s.stream, err = o.rt.StreamCreate(d, cudart.StreamNonBlocking); err != nil {
			return "", fmt.Errorf("kv/owner: stream on device %d: %w", d, err)
		}
		if s.done, err = o.rt.EventCreate(d, cudart.EventDisableTiming); err != nil {
			return "", fmt.Errorf("kv/owner: event on device %d: %w", d, err)
		}
		for i := range o.segs.Count() {
			// The stream of the Importer's device maps every segment; copies run on
			// each slab's own stream, on its device.
			m, err := o.imp.Open(ctx, SlabName(d, i), o.slabs[0].stream)
			if errors.Is(err, export.ErrUnknownName) {
				return fmt.Sprintf("the keeper (pid %d) keeps no segment %d for device %d", o.imp.ExporterPID(), i, d), nil
			}
			if err != nil {
				return "", fmt.Errorf("kv/owner: mapping the kept segment %d of device %d: %w", i, d, err)
			}
			s.ms = append(s.ms, m)
			got, _, err := kvwire.ParseSegmentMeta(m.Meta())
			if err != nil {
				return "", fmt.Errorf("kv/owner: the kept segment %d of device %d: %w", i, d, err)
			}
			want := kvwire.SegmentMeta{Geometry: o.geo, Bound: o.segs.Bound(), Count: o.segs.Count(), Index: i}
			if got != want || m.Size() < o.segs.Bytes(i) {
				return fmt.Sprintf("the keeper (pid %d) keeps slabs of %v in segments of %s, this owner serves %v in segments of %s",
					o.imp.ExporterPID(), got.Geometry, humanize.IBytes(got.Bound), o.geo, humanize.IBytes(o.segs.Bound())), nil
			}
			s.bases = append(s.bases, m.Ptr())
		}
	}
	return "", nil
}

// closeImport unmaps the adopted slabs and disconnects from their keeper.
func (o *Owner) closeImport(ctx context.Context) error {
	var errs []error
	for _, s := range o.slabs {
		for _, m := range s.ms {
			if err := m.Release(ctx, o.slabs[0].stream); err != nil {
				errs = append(errs, err)
			}
		}
		s.ms, s.bases = nil, nil
	}
	if o.imp != nil {
		if err := o.imp.Close(ctx); err != nil {
			errs = append(errs, err)
		}
		o.imp = nil
	}
	for _, s := range o.slabs {
		if s.stream != 0 {
			errs = append(errs, o.rt.StreamSynchronize(s.dev, s.stream))
		}
		if s.done != 0 {
			errs = append(errs, o.rt.EventDestroy(s.dev, s.done))
		}
		if s.stream != 0 {
			errs = append(errs, o.rt.StreamDestroy(s.dev, s.stream))
		}
	}
	o.slabs, o.byDev = nil, map[int]*slab{}
	return errors.Join(errs...)
}

// StopKeeper sends the keeper pid SIGTERM, which makes it close (Keeper.Close), and
// waits, until ctx ends, for it to exit. A keeper gone already is no error.
func StopKeeper(ctx context.Context, pid int) error {
	p, err := peercred.OpenProcess(pid)
	if err != nil {
		return nil // gone already
	}
	defer func() { _ = p.Close() }() // cleanup: the wait is over
	if err := syscall.Kill(pid, syscall.SIGTERM); err != nil && !errors.Is(err, syscall.ESRCH) {
		return fmt.Errorf("kv/owner: stopping the keeper (pid %d): %w", pid, err)
	}
	if err := p.Wait(ctx); err != nil {
		return fmt.Errorf("kv/owner: stopping the keeper (pid %d): %w", pid, err)
	}
	return nil
}

// restore takes back the index at o.opts.Index if it is of these slabs, and starts
// the index anew. It is called before the page server accepts anyone. Something other
// than a regular file at the index's path fails it (index.ErrNotRegular); any other
// index that cannot be taken back is dropped, and Recovery says why.
func (o *Owner) restore() error {
	hdr := index.Header{Epoch: 1, Keeper: o.keeperID, Geometry: o.geo, Devices: o.opts.Devices}
	st, err := index.Load(o.opts.Index, o.shape())
	switch {
	case errors.Is(err, index.ErrNoIndex):
	case errors.Is(err, index.ErrNotRegular):
		return fmt.Errorf("kv/owner: the index: %w", err)
	case errors.Is(err, index.ErrOtherShape):
		hdr.Epoch = st.Header.Epoch + 1
		if st.Header.Geometry != o.geo {
			o.dropIndex(fmt.Sprintf("the index is of %v, not %v", st.Header.Geometry, o.geo))
		} else {
			o.dropIndex(fmt.Sprintf("the index is of devices %v, not %v", st.Header.Devices, o.opts.Devices))
		}
	case err != nil:
		o.dropIndex(fmt.Sprintf("the index %s is corrupt (%v)", o.opts.Index, err))
		// Past the epochs a readable header names; a random one where it is not, so
		// that no lease id of the owner before is likely issued again.
		hdr.Epoch = 1<<22 | rand.Uint64N(1<<22)
		if st != nil {
			hdr.Epoch = st.Header.Epoch + 1
		}
	default:
		hdr.Epoch = st.Header.Epoch + 1
		switch {
		case o.imp != nil && !o.recovery.Adopted:
			o.dropIndex(fmt.Sprintf("no keeper was alive: the slabs of %v are gone, and the %d visible pages of the index with them", st.Header.Keeper, countSealed(st)))
		case st.Header.Keeper != o.keeperID:
			o.dropIndex(fmt.Sprintf("the index is of the slabs of %v, gone", st.Header.Keeper))
		case o.imp == nil:
			// The same process's own slabs, from an earlier Listen: made anew since.
			o.dropIndex(fmt.Sprintf("this owner makes its own slabs, new at each start: the %d visible pages of the index are gone with the old ones", countSealed(st)))
		default:
			o.apply(st)
		}
	}
	o.epoch, o.hdr = hdr.Epoch, hdr // no lease id of an earlier epoch is issued again
	return nil
}

func countSealed(st *index.State) (n int) {
	for _, ps := range st.Sealed {
		n += len(ps)
	}
	return n
}

// dropIndex records why the index is not taken back.
func (o *Owner) dropIndex(why string) {
	o.log.Warn("kv: the index is dropped; the pool starts with no visible pages", "why", why)
	if o.recovery.Dropped == "" {
		o.recovery.Dropped = why
	}
}

// apply keeps st, for makeTables to make its pages visible again and its leases
// wait for their holders.
func (o *Owner) apply(st *index.State) { o.recState = st }

// unknownReplicas stands for the replicas of a process whose leases the index holds
// but none of whose connections it does (given up at an earlier restart's grace): no
// count of lists of leases can vouch for all of them, so its leases not re-declared
// wait for its exit.
const unknownReplicas = 1 << 30

// makeTables makes each slab's page table: from the index taken back (its visible
// pages, its host pages where the keeper kept the tier's memory, its leases stranded
// until their holders reattach them, declare or exit), else empty. A table the
// journal cannot rebuild is made empty, and Recovery says why.
func (o *Owner) makeTables() {
	o.issued = o.epoch << 40
	o.prior = map[pages.Holder]bool{}
	st := o.recState
	o.recState = nil
	replicas := map[pages.Holder]int{}
	if st != nil {
		alive := map[procID]bool{}
		for _, id := range append(slices.Clone(st.Attached), grantHolders(st)...) {
			if _, seen := alive[id]; !seen {
				now, err := procOf(int(id.PID))
				alive[id] = err == nil && now == id
			}
		}
		for _, id := range st.Attached {
			if alive[id] {
				replicas[pages.Holder(id)]++
				o.recovery.Replicas++
			}
		}
		for _, g := range st.Grants {
			h := pages.Holder(g.Holder)
			if alive[g.Holder] && replicas[h] == 0 {
				replicas[h] = unknownReplicas
			}
			if alive[g.Holder] && !g.Read {
				o.recovery.WriteLeases++
				o.kept = append(o.kept, pages.LeaseID(g.Lease))
			}
		}
		for h := range replicas {
			o.prior[h] = true
		}
	}
	for i, s := range o.slabs {
		cfg := pages.Config{Pages: o.geo.Pages, Epoch: o.epoch, Stride: uint64(len(o.slabs)), Offset: uint64(i)}
		if s.tier != nil {
			cfg.HostPages = s.tier.pages
		}
		if st != nil {
			rec := recovered(st, s.dev, s.tier != nil && s.tier.kept)
			rec.Replicas = replicas
			tab, err := pages.Restart(cfg, rec)
			if err == nil {
				s.tab = tab
				o.recovery.Pages += len(rec.Sealed)
				o.recovery.HostPages += len(rec.Host)
				continue
			}
			o.dropIndex(fmt.Sprintf("the index of device %d does not describe one state (%v)", s.dev, err))
		}
		tab, err := pages.New(cfg)
		if err != nil {
			panic(err) // the geometry and the devices are checked by Listen
		}
		s.tab = tab
	}
}

// grantHolders are the holders of st's leases.
func grantHolders(st *index.State) []procID {
	ids := make([]procID, len(st.Grants))
	for i, g := range st.Grants {
		ids[i] = g.Holder
	}
	return ids
}

// recovered is what st says of device dev: its visible pages, its host pages (if the
// tier was kept) and its leases.
func recovered(st *index.State, dev int, kept bool) pages.Recovered {
	var rec pages.Recovered
	for _, p := range st.Sealed[dev] {
		rec.Sealed = append(rec.Sealed, pages.PageHash{Page: p.Page, Hash: p.Hash})
	}
	if kept {
		for _, p := range st.Host[dev] {
			rec.Host = append(rec.Host, pages.PageHash{Page: p.Page, Hash: p.Hash})
		}
	}
	for _, g := range st.Grants {
		if g.Dev == dev {
			rec.Leases = append(rec.Leases, pages.Record{Kind: pages.RecLeased, Lease: pages.LeaseID(g.Lease), Holder: pages.Holder(g.Holder),
				Write: !g.Read, Pages: g.Pages, Hashes: g.Hashes})
		}
	}
	return rec
}

// keptLocked counts the pages of s kept for the writers of before the restart (their
// write leases stranded), under o.mu.
func (o *Owner) keptLocked(s *slab) (n int) {
	for _, id := range o.kept {
		if l, ok := s.tab.Lease(id); ok && l.Stranded && l.Write {
			n += len(l.Pages)
		}
	}
	return n
}

// expectedLocked are the processes the reattach window waits for, every device's,
// under o.mu.
func (o *Owner) expectedLocked() []pages.Holder {
	var hs []pages.Holder
	for _, s := range o.slabs {
		if s.tab == nil {
			continue
		}
		for _, h := range s.tab.Expected() {
			if !slices.Contains(hs, h) {
				hs = append(hs, h)
			}
		}
	}
	return hs
}

// snapshotLocked appends the records of the present state to b, under o.mu: each
// slab's visible pages and its host tier's sealed pages, least recent first, its
// leases, and the replicas attached.
func (o *Owner) snapshotLocked(b *index.Batch) {
	for _, s := range o.slabs {
		for _, r := range s.tab.Snapshot() {
			switch r.Kind {
			case pages.RecSeal:
				b.Seal(s.dev, r.Page, r.Hash)
			case pages.RecHostSeal:
				b.HostSeal(s.dev, r.Page, r.Hash)
			case pages.RecLeased:
				b.Grant(grantOf(s.dev, r))
			}
		}
	}
	for c := range o.conns {
		if c.welcomed && c.id.PID != 0 {
			b.Attach(c.id)
		}
	}
}

// holdAllocs makes allocations, matches and restores wait while a table's reattach
// window is open: until every process with leases from before the restart has
// re-declared them or exited, or the grace has passed (Table.CloseWindow). Past
// the grace, a stranded lease's pages stay out of reach until its process reattaches
// it, declares, or exits: no page a writer of before may still write is handed to
// another.
func (o *Owner) holdAllocs() {
	o.mu.Lock()
	expected := o.expectedLocked()
	o.mu.Unlock()
	if len(expected) == 0 {
		close(o.resumed)
		return
	}
	grace := o.opts.ReattachGrace
	if grace <= 0 {
		grace = DefaultReattachGrace
	}
	t := time.AfterFunc(grace, func() {
		o.mu.Lock()
		defer o.mu.Unlock()
		if late := o.expectedLocked(); len(late) > 0 {
			o.log.Warn("kv: replicas attached before the restart did not reattach in time; their leases' pages stay out of reach until they reattach, declare or exit", "grace", grace, "replicas", fmt.Sprint(late))
		}
		for _, s := range o.slabs {
			s.tab.CloseWindow()
		}
		o.resumeLocked()
	})
	context.AfterFunc(o.stopped, func() { t.Stop() })
	for _, h := range expected {
		p, err := peercred.OpenProcess(int(h.PID))
		if now, nerr := procOf(int(h.PID)); nerr != nil || pages.Holder(now) != h { // checked after the pidfd: it names h
			if err == nil {
				_ = p.Close() // cleanup: another process, or none
			}
			o.holderDead(h) // gone, or its pid another process's
			continue
		}
		if err != nil { // alive: its leases stay its own until it re-declares them or declares
			o.log.Warn("kv: cannot watch a replica's process of before the restart", "replica", h.String(), "err", err)
			continue
		}
		o.waiters.Add(1)
		go func() {
			defer o.waiters.Done()
			defer func() { _ = p.Close() }() // cleanup: the wait is over
			if p.Wait(o.stopped) == nil {
				o.holderDead(h)
			}
		}()
	}
}

// holderDead ends every lease of process h, which has exited (Table.HolderDead).
func (o *Owner) holderDead(h pages.Holder) {
	o.mu.Lock()
	defer o.mu.Unlock()
	for _, s := range o.slabs {
		o.effectsLocked(s, s.tab.HolderDead(h))
	}
	o.resumeLocked()
}

// resumeLocked lets allocations go on once no table's window is open, under o.mu.
func (o *Owner) resumeLocked() {
	for _, s := range o.slabs {
		if s.tab.Window() {
			return
		}
	}
	select {
	case <-o.resumed:
	default:
		close(o.resumed)
	}
}

// awaitResumed waits until allocations may go on (holdAllocs); false if the owner is
// closing.
func (o *Owner) awaitResumed() bool {
	select {
	case <-o.resumed:
		return true
	default:
	}
	if windowHook != nil {
		windowHook()
	}
	select {
	case <-o.resumed:
		return true
	case <-o.stopped.Done():
		return false
	}
}

// windowHook, set by tests alone, is called when a request begins to wait for the
// reattach window.
var windowHook func()

// attachedLocked journals that c, of process id (err: not known), was admitted,
// under o.mu, and returns the record's sequence number (0: none), for the caller to
// wait for outside o.mu.
func (o *Owner) attachedLocked(c *conn, id procID, err error) uint64 {
	if err != nil {
		return 0
	}
	c.id = id
	return o.ix.Attach(id)
}

// detachedLocked journals that c's connection ended, under o.mu.
func (o *Owner) detachedLocked(c *conn) {
	if c.id.PID != 0 {
		o.ix.Detach(c.id)
	}
}

// reattach answers Reattach: a lease c's process held from before the restart is
// its again, on c, within c's caps, if the predecessor granted it to that process
// with those pages (Table.Reattach), else lost, saying why. Lease 0 ends the list:
// one replica of c's process has re-declared what it holds (Table.Declared), which
// is answered once journaled.
func (c *conn) reattach(h kvwire.Header, p []byte) error {
	o, s := c.o, c.s
	m, err := kvwire.ParseReattach(p, c.scratch[:0])
	if err != nil {
		return err
	}
	answer := func(status uint32, reason string) error {
		return c.write(func(b []byte) ([]byte, error) { return kvwire.AppendReattached(b, h.ID, status, reason) })
	}
	c.lock()
	if m.Lease == 0 {
		if !c.returned {
			c.returned = true
			for _, s := range o.slabs {
				o.effectsLocked(s, s.tab.Declared(c.holder))
			}
			o.resumeLocked()
		}
		seq := o.ix.Queued()
		c.unlock()
		// Answered once the index has what the end freed, lest the next restart keep
		// it for the replica as well.
		if err := o.journaled(o.stopped, seq); errors.Is(err, kv.ErrClosed) {
			return err
		}
		return answer(kvwire.ReattachKept, "")
	}
	why := o.reattachLocked(c, s, m)
	c.unlock()
	if why != "" {
		return answer(kvwire.ReattachLost, why)
	}
	return answer(kvwire.ReattachKept, "")
}

// reattachLocked takes m back for c, or says why not, under o.mu. A lease is taken
// back only by the process it was granted to, as the index says, with the same pages
// (a read lease's: visible under the same hashes), within c's caps.
func (o *Owner) reattachLocked(c *conn, s *slab, m kvwire.Reattach) string {
	if l, ok := o.leases[m.Lease]; ok {
		// The same process's lease over a connection that ended (without the owner's
		// death) moves to this one.
		if l.c != c && l.write == m.Write && slices.Equal(l.pages, m.Pages) && o.adoptLocked(c, l) {
			return ""
		}
		return fmt.Sprintf("lease %d is held already", m.Lease)
	}
	if m.Lease >= o.epoch<<40 {
		return fmt.Sprintf("lease %d was not issued before this owner", m.Lease)
	}
	if len(m.Pages) == 0 || (!m.Write && len(m.Hashes) != len(m.Pages)) || (m.Write && len(m.Hashes) != 0) {
		return fmt.Sprintf("lease %d: %d pages and %d hashes", m.Lease, len(m.Pages), len(m.Hashes))
	}
	if err := c.roomLocked(len(m.Pages)); err != nil {
		return fmt.Sprintf("lease %d: %v", m.Lease, err)
	}
	info, held := s.tab.Lease(pages.LeaseID(m.Lease))
	held = held && info.Stranded && info.Write == m.Write
	if m.Write {
		switch {
		case !held:
			return fmt.Sprintf("lease %d is no write lease granted before the restart that is still kept", m.Lease)
		case info.Holder != c.holder:
			return fmt.Sprintf("lease %d was granted to another process", m.Lease)
		}
	} else {
		if !o.prior[c.holder] {
			return fmt.Sprintf("lease %d: pid %d is not a process the owner before this one served", m.Lease, c.cred.PID)
		}
		seen := map[uint32]bool{}
		for i, pg := range m.Pages {
			switch st, hh, _ := s.tab.Page(min(pg, uint32(o.geo.Pages-1))); {
			case int(pg) >= o.geo.Pages:
				return fmt.Sprintf("page %d of %d", pg, o.geo.Pages)
			case seen[pg]:
				return fmt.Sprintf("page %d is listed twice", pg)
			case st != pages.Sealed || hh != m.Hashes[i]:
				return fmt.Sprintf("page %d is no longer visible under its hash", pg)
			}
			seen[pg] = true
		}
		if !held || info.Holder != c.holder {
			return fmt.Sprintf("lease %d is no read lease granted before the restart to pid %d that is still held", m.Lease, c.cred.PID)
		}
	}
	if err := s.tab.Reattach(c.holder, pages.LeaseID(m.Lease), m.Write, m.Pages, m.Hashes); err != nil {
		return fmt.Sprintf("lease %d was granted other pages (%v)", m.Lease, err)
	}
	l := &lease{id: m.Lease, c: c, s: s, holder: c.holder, write: m.Write, pages: slices.Clone(m.Pages)}
	o.leases[l.id] = l
	c.held[l.id] = l
	c.heldPgs += len(l.pages)
	return ""
}
