package owner

import (
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"syscall"
	"time"

	"golang.org/x/sys/unix"

	"github.com/cudapool/cudapool/cudart"
	"github.com/cudapool/cudapool/export/producer"
	"github.com/cudapool/cudapool/internal/peercred"
	"github.com/cudapool/cudapool/kv"
	"github.com/cudapool/cudapool/kv/internal/index"
	"github.com/cudapool/cudapool/kv/internal/keep"
	"github.com/cudapool/cudapool/kv/internal/kvwire"
	"github.com/cudapool/cudapool/kv/internal/pages"
)

// A cache that survives its owner. The slabs' chunks are held by a keeper process
// (Keep: a keep.Server on dir/keep.sock, holding descriptors by name and nothing else,
// no CUDA context): the page server (Listen given WithKeeper) gives it each chunk's
// descriptor as it makes the chunk, before any page in it is granted. So the page
// server's death changes nothing for the chunks or the replicas' mappings; a new page
// server on the same directory takes the chunks back from the live keeper and maps
// them, restores the visible pages from the index file (WithIndex, journal.go) and
// takes back the leases the replicas re-declare (Reattach). When the keeper is gone
// the chunks are gone (once the replicas unmap them): the next page server starts a
// new keeper, and says so.

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

// KeeperGone is closed when the keeper of an owner's chunks has gone (WithKeeper: its
// keep.sock connection ended): the cache and the host tiers' memory it kept are gone
// with it (their memory once the replicas unmap it), and the owner should be closed
// and started again. nil for an owner that keeps its own chunks.
func (o *Owner) KeeperGone() <-chan struct{} { return o.keeperGone }

// Keeper holds the descriptors of a directory's chunks and host tiers for the page
// servers that come and go, on dir/keep.sock (keeptier.go), and nothing else: it
// maps nothing and makes no CUDA context.
type Keeper struct {
	files keptFiles
}

// Keep is [KeepFiles] of dir with opts: rt and geo have no effect (the page server
// gives the keeper its chunks whatever their geometry). A live keeper on dir makes it
// fail with an error wrapping producer.ErrAddressInUse. On failure nothing is left
// behind.
func Keep(dir string, _ cudart.Runtime, _ kv.Geometry, opts ...Option) (*Keeper, error) {
	return KeepFiles(dir, opts...)
}

// Close closes the descriptors the keeper holds (their memory lives on while a
// process holds or maps it) and stops dir/keep.sock. A second Close returns
// kv.ErrClosed.
func (k *Keeper) Close(context.Context) error {
	if !k.files.close() {
		return kv.ErrClosed
	}
	return nil
}

// role is what listen makes.
type role int

const (
	roleWhole role = iota // slabs and pages in one process: Listen without Keeper
	rolePages             // the pages, over a keeper's chunks: Listen with Keeper
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

// adoptSlabs connects to the keeper on dir/keep.sock, starting one (WithKeeper's
// start) if none is alive, and makes each device's slab of the chunks it keeps, or
// anew where it keeps none that fit.
func (o *Owner) adoptSlabs() error {
	started, err := o.dialKeeper()
	if err != nil {
		return err
	}
	o.watchKeeper()
	ctx, cancel := context.WithTimeout(o.stopped, keeperTimeout)
	defer cancel()
	o.recovery.KeeperPID = o.keeper.KeeperPID()
	adopted := !started
	for _, d := range o.opts.Devices {
		s, took, err := o.adoptSlab(ctx, d)
		if s != nil {
			o.slabs = append(o.slabs, s)
			o.byDev[d] = s
		}
		if err != nil {
			return err
		}
		adopted = adopted && took
	}
	o.recovery.Adopted = adopted
	return nil
}

// chunkPrefix is what the names of device d's chunks in the keeper begin with.
func chunkPrefix(d int) string { return "kv/slab/" + strconv.Itoa(d) + "/" }

// chunkName is the name chunk i of s is kept under: the slab's id, its geometry and
// chunk size, and the chunk's index, so that a restarted owner takes back only the
// chunks of its own layout.
func (o *Owner) chunkName(s *slab, i int) string {
	return chunkPrefix(s.dev) + strconv.FormatUint(s.id, 16) + "/" + o.shapeName() + "/" + strconv.Itoa(i)
}

// shapeName is the geometry and chunk size in a chunk's name.
func (o *Owner) shapeName() string {
	g := o.geo
	return fmt.Sprintf("%dx%dx%dx%dx%sx%d-%d", g.Layers, g.KVHeads, g.HeadDim, g.TokensPerPage, g.DType, g.Pages, o.layout.ChunkBytes())
}

// adoptSlab makes device d's slab of the chunks the keeper keeps for it, if they are
// of this layout (took), else anew, the old ones dropped and Recovery saying why.
func (o *Owner) adoptSlab(ctx context.Context, d int) (_ *slab, took bool, err error) {
	s, err := o.newSlabOf(d)
	if err != nil {
		return s, false, err
	}
	kept, err := o.keeper.List(ctx, chunkPrefix(d))
	if err != nil {
		return s, false, fmt.Errorf("kv/owner: the keeper's chunks of device %d: %w", d, err)
	}
	id, why := o.keptChunks(d, kept)
	if why == "" && len(kept) > 0 {
		s.id, s.name = id, kvwire.SlabName(d, id)
		if err := o.takeChunks(ctx, s, len(kept)); err != nil {
			return s, false, err
		}
		return s, true, nil
	}
	if why != "" {
		o.log.Warn("kv: the keeper's chunks do not fit; they are dropped", "device", d, "why", why)
		if o.recovery.Dropped == "" {
			o.recovery.Dropped = why + ": the old chunks and index are dropped"
		}
		for _, e := range kept {
			if err := o.keeper.Drop(ctx, e.Name); err != nil {
				return s, false, fmt.Errorf("kv/owner: dropping the keeper's chunk %s: %w", e.Name, err)
			}
		}
	}
	return s, false, o.growSlab(s, initialChunks(o.layout, o.opts.InitialPages))
}

// keptChunks checks that kept are chunks 0 to len(kept)-1 of one slab of this layout,
// and returns its id; why says what does not fit.
func (o *Owner) keptChunks(d int, kept []keep.Entry) (id uint64, why string) {
	seen := make([]bool, len(kept))
	for _, e := range kept {
		parts := strings.Split(strings.TrimPrefix(e.Name, chunkPrefix(d)), "/")
		if len(parts) != 3 {
			return 0, fmt.Sprintf("the keeper keeps %q for device %d, no chunk's name", e.Name, d)
		}
		if parts[1] != o.shapeName() || e.Size != o.layout.ChunkBytes() {
			return 0, fmt.Sprintf("the keeper keeps chunks of %s (%d bytes) for device %d, this owner serves %s", parts[1], e.Size, d, o.shapeName())
		}
		sid, err1 := strconv.ParseUint(parts[0], 16, 64)
		i, err2 := strconv.Atoi(parts[2])
		switch {
		case err1 != nil || err2 != nil:
			return 0, fmt.Sprintf("the keeper keeps %q for device %d, no chunk's name", e.Name, d)
		case id != 0 && sid != id:
			return 0, fmt.Sprintf("the keeper keeps chunks of two slabs for device %d", d)
		case i < 0 || i >= len(kept) || seen[i] || i >= o.layout.Chunks():
			return 0, fmt.Sprintf("the keeper keeps %d chunks for device %d, not chunks 0 to %d (%q)", len(kept), d, len(kept)-1, e.Name)
		}
		id, seen[i] = sid, true
	}
	return id, ""
}

// takeChunks takes chunks 0 to n-1 of s back from the keeper and maps them.
func (o *Owner) takeChunks(ctx context.Context, s *slab, n int) error {
	s.grow.Lock()
	defer s.grow.Unlock()
	for i := range n {
		fd, _, err := o.keeper.Take(ctx, o.chunkName(s, i))
		if err != nil {
			return fmt.Errorf("kv/owner: taking chunk %d of device %d back from the keeper: %w", i, s.dev, err)
		}
		if err := s.m.Import(i, []int{fd}); err != nil {
			_ = unix.Close(fd) // cleanup: the import's error is the one returned
			return fmt.Errorf("kv/owner: mapping the kept chunk %d of device %d: %w", i, s.dev, err)
		}
		s.fds = append(s.fds, fd)
	}
	s.chunks = len(s.fds)
	return nil
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
		case o.keeper != nil && !o.recovery.Adopted && o.recovery.Dropped != "": // the keeper's chunks did not fit
			o.dropIndex(o.recovery.Dropped)
		case o.keeper != nil && !o.recovery.Adopted:
			o.dropIndex(fmt.Sprintf("no keeper was alive: the slabs of %v are gone, and the %d visible pages of the index with them", st.Header.Keeper, countSealed(st)))
		case st.Header.Keeper != o.keeperID:
			o.dropIndex(fmt.Sprintf("the index is of the slabs of %v, gone", st.Header.Keeper))
		case o.keeper == nil:
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
		cfg := pages.Config{Pages: o.layout.MappedPages(len(s.fds)), Bound: o.geo.Pages, Epoch: o.epoch, Stride: uint64(len(o.slabs)), Offset: uint64(i)}
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
