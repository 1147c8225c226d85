// Package index owns the KV owner's index file: the journal of the pages a restarted
// owner may serve again (visible pages, sealed host pages), of the replicas attached
// and of the write leases granted, to which process, until their pages are visible or
// free again. It owns the file's format, its reading (Load, a stream with a bound) and
// its writing (Index): records are queued in memory by the caller, under the caller's
// lock and without a syscall, and written, in batches, and compacted, by the index's
// own goroutine; Wait tells the caller when a record is on disk.
//
// The file is only ever a regular file: a named pipe, a device, a socket, a directory
// or a symbolic link at its path is refused, never opened for writing or read through.
// A compaction writes the header and a snapshot the caller provides into path+".new",
// created anew (O_EXCL, without following a link: whatever was at that name is removed
// first), synced (fsync) before it is renamed over path, and the directory is synced
// after the rename, so that a crash of the host leaves the old file or the new one,
// whole. Appended records are not synced: they guard against the death of the owner's
// process, which the page cache survives; a crash of the host ends the keeper, and
// with it the slabs the records are about.
//
// A disk that stops taking writes (an NFS mount that hangs, a device that is full or
// failing, a write blocked in the kernel) cannot hold the caller: the queue is bounded
// ([WithMaxQueued]; by default the most bytes a file of the shape holds, and 16 MiB at
// least), and the record that takes it past its bound drops it, without a syscall and
// without waiting, under the caller's lock as any record is queued. The index then
// fails as it does after a write error, off the caller's lock: its file is removed (or
// emptied), then every [Index.Wait] returns an error wrapping [ErrFailed], the reason
// (the bytes queued, the bound, the last record written) is logged once, and later
// records are dropped, so that the caller carries on without an index. What holds on
// each side:
//
//   - The caller: queueing never blocks and never grows its memory past the bound
//     (and one batch, which the writer holds). A Wait returns nil only once its record
//     is in the file; ErrFailed only once the file is gone, so that no start reads a
//     record of it (with [ErrStale] where it could not be removed); until either, it
//     waits, bounded by its ctx. [Index.Close] is bounded by its ctx.
//   - The disk: a write in progress is never interrupted (a write blocked in the kernel
//     cannot be), and the index sets no timer on it: it cannot tell a hung write from
//     a slow one, only a queue that outgrew its bound. A disk that hangs while the
//     caller queues nothing leaves its Waits to their ctx; one that hangs while the
//     caller goes on fails the index once the bound is passed, as soon as its file can
//     be removed (a removal that hangs too leaves the Waits to their ctx). A write or a
//     compaction that returns after the failure writes nothing more: a compaction's
//     new file is never renamed over the path once the index has failed.
package index

import (
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"log/slog"
	"math"
	"os"
	"path/filepath"
	"sync"

	"golang.org/x/sys/unix"

	"github.com/cudapool/cudapool/kv"
)

// Snapshot appends the caller's present state to b (Batch's methods) and returns the
// sequence number of the latest record the state reflects, b.Queued(): it must hold,
// for the whole call, the lock under which the caller appends, so that the state is
// exactly that of the records up to that number. It is called from the index's
// goroutine at each compaction, and from Open.
type Snapshot func(b *Batch) uint64

// Batch is the records a Snapshot appends: the visible pages and sealed host pages of
// each device, least recent first, and the replicas attached.
type Batch struct {
	ix *Index
	b  []byte
	n  int
}

// Seal appends that page of dev is visible under h.
func (b *Batch) Seal(dev int, page uint32, h kv.Hash) { b.page(Seal, dev, page, h) }

// HostSeal appends that host page of dev's host tier holds h.
func (b *Batch) HostSeal(dev int, page uint32, h kv.Hash) { b.page(HostSeal, dev, page, h) }

// Attach appends that replica p is attached (once per connection).
func (b *Batch) Attach(p Proc) {
	b.b = AppendProc(b.b, Attach, p)
	b.n++
}

// Grant appends write lease g, granted and not ended.
func (b *Batch) Grant(g *Grant) {
	b.b = AppendGrant(b.b, g)
	b.n += g.records()
}

func (b *Batch) page(k Kind, dev int, page uint32, h kv.Hash) {
	b.b = AppendPage(b.b, k, dev, page, h)
	b.n++
}

// Queued is the sequence number of the latest record queued (Index.Queued).
func (b *Batch) Queued() uint64 { return b.ix.Queued() }

// Option is an option of Open.
type Option func(*options)

type options struct {
	log         *slog.Logger
	beforeWrite func() error
	maxQueued   int
	onRename    func(done bool) // a test's seam: called as a compaction is about to rename its new file, and once it did
}

// WithLogger sets where the index's failure is logged; by default nowhere.
func WithLogger(l *slog.Logger) Option { return func(o *options) { o.log = l } }

// WithMaxQueued bounds the bytes of records queued and not yet taken by the writer:
// the record that takes the queue past n fails the index ([ErrFailed]: its file
// removed, as after a write error; see the package doc). By default, or with n <= 0, the bound is the
// most bytes a file of Open's shape holds, and 16 MiB at least: a queue that long
// holds more changes than a snapshot of the whole state, some 340,000 records at
// least (seconds of a busy owner's changes, through a compaction's fsync), which a
// disk that takes writes empties one batch a write, long before; and it is little
// next to the memory of the pages it is about.
func WithMaxQueued(n int) Option { return func(o *options) { o.maxQueued = n } }

// minQueued is the least default bound on the queue (WithMaxQueued).
const minQueued = 16 << 20

// BeforeWrite makes the index's goroutine call f before each write of records to
// the file: a test's seam, to hold the writer (f blocks) or fail it (f returns an
// error, as a write that failed would).
func BeforeWrite(f func() error) Option { return func(o *options) { o.beforeWrite = f } }

// Index writes an index file. Its methods are safe for concurrent use; those that
// queue records (Seal, Free, HostSeal, HostFree, Attach, Detach, Grant, End) make no syscall and
// may be called under the caller's locks, and a nil *Index queues nothing (its
// sequence numbers are 0, and Wait returns nil at once).
type Index struct {
	path     string
	hdr      Header
	base     int // the records past which it compacts, for a snapshot of no replica
	most     int // the records a snapshot may hold: Shape.limit
	snapshot Snapshot
	opts     options
	kick     chan struct{} // a record was queued, or Close began
	done     chan struct{} // closed when the writer has returned

	// fileMu orders a compaction's rename after a check that the index has not failed,
	// and a failure's removal of the file after that rename: no file is renamed over
	// the path once it was removed. It is never held with ix.mu taken before it.
	fileMu sync.Mutex
	failed bool // under fileMu: the failure was logged, and is being set as err

	// Owned by the writer's goroutine (and Open's, before it starts).
	f       *os.File
	records int // records in the file after its header
	limit   int // the records past which it compacts: base, or twice the latest snapshot
	scratch []byte

	mu       sync.Mutex
	queue    []byte        // records queued, from head on
	head     int           //
	queued   uint64        // the sequence number of the latest record queued
	written  uint64        // every record up to it is in the file (or in a snapshot)
	err      error         // why the index stopped; wraps ErrFailed
	overflow error         // why the queue was dropped (past its bound): err follows, once the file is removed
	closing  bool          //
	progress chan struct{} // closed and replaced when written or err changes
}

// Open starts a fresh index at path: the file holds hdr and snapshot's records once
// it returns, and the index's goroutine writes what is queued from then on. A path
// where something other than a regular file is refuses it with an error wrapping
// ErrNotRegular, and a shape whose snapshot would not fit its bound with one wrapping
// ErrCorrupt; on failure nothing is left running, and path is as it was. Close ends
// it.
func Open(path string, hdr Header, shape Shape, snapshot Snapshot, opts ...Option) (*Index, error) {
	if f, _, err := openRegular(path); err == nil {
		_ = f.Close() // it was only looked at
	} else if !errors.Is(err, ErrNoIndex) {
		return nil, err
	}
	ix := &Index{path: path, hdr: hdr, base: 2*shape.pages() + 1024, most: shape.limit(), snapshot: snapshot,
		kick: make(chan struct{}, 1), done: make(chan struct{}), progress: make(chan struct{})}
	for _, o := range opts {
		if o != nil {
			o(&ix.opts)
		}
	}
	if ix.opts.maxQueued <= 0 {
		ix.opts.maxQueued = int(min(max(shape.maxBytes(), minQueued), math.MaxInt))
	}
	if err := ix.compact(); err != nil {
		return nil, err
	}
	go ix.run()
	return ix, nil
}

// Queued is the sequence number of the latest record queued: Wait for it waits for
// every record queued so far.
func (ix *Index) Queued() uint64 {
	if ix == nil {
		return 0
	}
	ix.mu.Lock()
	defer ix.mu.Unlock()
	return ix.queued
}

// Err is why the index stopped (wrapping ErrFailed, and ErrStale where its file was
// left behind), or nil while it writes, and after a Close.
func (ix *Index) Err() error {
	if ix == nil {
		return nil
	}
	ix.mu.Lock()
	defer ix.mu.Unlock()
	return ix.err
}

// Seal queues that page of dev became visible under h, and returns its sequence
// number.
func (ix *Index) Seal(dev int, page uint32, h kv.Hash) uint64 { return ix.page(Seal, dev, page, h) }

// Free queues that visible page of dev was evicted.
func (ix *Index) Free(dev int, page uint32) uint64 { return ix.page(Free, dev, page, kv.Hash{}) }

// HostSeal queues that host page of dev's host tier holds h, its copy completed.
func (ix *Index) HostSeal(dev int, page uint32, h kv.Hash) uint64 {
	return ix.page(HostSeal, dev, page, h)
}

// HostFree queues that sealed host page of dev's host tier was evicted.
func (ix *Index) HostFree(dev int, page uint32) uint64 {
	return ix.page(HostFree, dev, page, kv.Hash{})
}

// Attach queues that replica p was admitted.
func (ix *Index) Attach(p Proc) uint64 { return ix.proc(Attach, p) }

// Detach queues that a connection of replica p ended.
func (ix *Index) Detach(p Proc) uint64 { return ix.proc(Detach, p) }

// Grant queues write lease g's grant and pages, and returns the sequence number of
// the last of their records: the lease is not to be answered before that is written.
func (ix *Index) Grant(g *Grant) uint64 {
	if ix == nil {
		return 0
	}
	ix.mu.Lock()
	defer ix.mu.Unlock()
	if ix.queueingLocked() {
		ix.queue = AppendGrant(ix.queue, g)
	}
	ix.queued += uint64(g.records() - 1)
	return ix.queuedLocked()
}

// End queues that write lease id's pages are visible or free again.
func (ix *Index) End(id uint64) uint64 {
	if ix == nil {
		return 0
	}
	ix.mu.Lock()
	defer ix.mu.Unlock()
	if ix.queueingLocked() {
		ix.queue = AppendEnd(ix.queue, id)
	}
	return ix.queuedLocked()
}

func (ix *Index) page(k Kind, dev int, page uint32, h kv.Hash) uint64 {
	if ix == nil {
		return 0
	}
	ix.mu.Lock()
	defer ix.mu.Unlock()
	if ix.queueingLocked() {
		ix.queue = AppendPage(ix.queue, k, dev, page, h)
	}
	return ix.queuedLocked()
}

func (ix *Index) proc(k Kind, p Proc) uint64 {
	if ix == nil {
		return 0
	}
	ix.mu.Lock()
	defer ix.mu.Unlock()
	if ix.queueingLocked() {
		ix.queue = AppendProc(ix.queue, k, p)
	}
	return ix.queuedLocked()
}

// queueingLocked says whether a record is to be queued, under ix.mu: not once the
// index failed, its queue dropped, or Close began.
func (ix *Index) queueingLocked() bool {
	return ix.err == nil && ix.overflow == nil && !ix.closing
}

// queuedLocked numbers the record just queued and wakes the writer, under ix.mu. A
// queue past its bound is dropped, and the index fails on a goroutine of its own
// (this one holds the caller's lock, and makes no syscall).
func (ix *Index) queuedLocked() uint64 {
	ix.queued++
	if n := len(ix.queue) - ix.head; n > ix.opts.maxQueued && ix.overflow == nil {
		ix.overflow = fmt.Errorf("%d bytes of records queued, over the bound of %d: the disk has taken no record past %d of %d (a write hangs, or is too slow)",
			n, ix.opts.maxQueued, ix.written, ix.queued)
		ix.queue, ix.head = nil, 0
		go ix.fail(ix.overflow, nil)
	}
	select {
	case ix.kick <- struct{}{}:
	default:
	}
	return ix.queued
}

// Wait waits until every record up to seq is in the file, and returns nil. It
// returns an error wrapping ErrFailed if the index stopped before (its file then
// removed, so that no start reads a record of it: with ErrStale too where it could
// not be), ErrClosed if it was closed before, or ctx's error if ctx ends first.
func (ix *Index) Wait(ctx context.Context, seq uint64) error {
	if ix == nil {
		return nil
	}
	for {
		ix.mu.Lock()
		written, err, closing, ch := ix.written, ix.err, ix.closing, ix.progress
		ix.mu.Unlock()
		switch {
		case seq <= written:
			return nil
		case err != nil:
			return err
		}
		select {
		case <-ch:
		case <-ix.done:
			if closing {
				ix.mu.Lock()
				written, err = ix.written, ix.err
				ix.mu.Unlock()
				if seq <= written {
					return nil
				}
				if err != nil {
					return err
				}
				return fmt.Errorf("%w: %s, before record %d was written", ErrClosed, ix.path, seq)
			}
		case <-ctx.Done():
			return ctx.Err()
		}
	}
}

// Close writes what is queued and closes the file; records queued after it began are
// dropped. It waits until ctx ends at most (a write that hangs then finishes on the
// index's goroutine, which closes the file after) and returns ctx's error then. An
// index that failed was logged then, and closes with no error; a second Close does
// nothing.
func (ix *Index) Close(ctx context.Context) error {
	if ix == nil {
		return nil
	}
	ix.mu.Lock()
	ix.closing = true
	ix.mu.Unlock()
	select {
	case ix.kick <- struct{}{}:
	default:
	}
	select {
	case <-ix.done:
		return nil
	case <-ctx.Done():
		return fmt.Errorf("kv/internal/index: closing %s: %w", ix.path, ctx.Err())
	}
}

// run writes the queue until Close, or a failure.
func (ix *Index) run() {
	defer close(ix.done)
	defer func() {
		if ix.f != nil {
			_ = ix.f.Close() // cleanup: everything written was written through it already
		}
	}()
	for {
		batch, last, n, closing, overflow := ix.take()
		if overflow != nil {
			ix.fail(overflow, ix.f)
			return
		}
		if n == 0 {
			if closing {
				return
			}
			<-ix.kick
			continue
		}
		if err := ix.write(batch); err != nil {
			ix.fail(err, ix.f)
			return
		}
		ix.records += n
		if overflow := ix.advance(last); overflow != nil {
			ix.fail(overflow, ix.f)
			return
		}
		if ix.records > ix.limit {
			if err := ix.compact(); err != nil {
				ix.fail(err, ix.f)
				return
			}
		}
	}
}

// take copies up to maxBatch queued records into the writer's scratch and takes them
// off the queue: last is the sequence number of the last of the n taken. It takes
// nothing, and returns why, once the queue was dropped past its bound.
func (ix *Index) take() (batch []byte, last uint64, n int, closing bool, overflow error) {
	ix.mu.Lock()
	defer ix.mu.Unlock()
	if ix.overflow != nil {
		return nil, 0, 0, ix.closing, ix.overflow
	}
	q := ix.queue[ix.head:]
	end := 0
	for end < len(q) && n < maxBatch {
		end += frame + int(binary.LittleEndian.Uint32(q[end:]))
		n++
	}
	ix.scratch = append(ix.scratch[:0], q[:end]...)
	ix.dropLocked(end)
	return ix.scratch, ix.written + uint64(n), n, ix.closing, nil
}

// dropLocked takes the queue's first end bytes of records off it, under ix.mu.
func (ix *Index) dropLocked(end int) {
	ix.head += end
	if ix.head == len(ix.queue) {
		ix.queue, ix.head = ix.queue[:0], 0
	} else if ix.head > len(ix.queue)/2 {
		k := copy(ix.queue, ix.queue[ix.head:])
		ix.queue, ix.head = ix.queue[:k], 0
	}
}

// write appends batch to the file.
func (ix *Index) write(batch []byte) error {
	if f := ix.opts.beforeWrite; f != nil {
		if err := f(); err != nil {
			return err
		}
	}
	if _, err := ix.f.Write(batch); err != nil {
		return fmt.Errorf("writing %s: %w", ix.path, err)
	}
	return nil
}

// advance says that every record up to seq is written, and returns why the queue was
// dropped, if it was meanwhile: the writer stops then.
func (ix *Index) advance(seq uint64) (overflow error) {
	ix.mu.Lock()
	defer ix.mu.Unlock()
	if seq > ix.written {
		ix.written = seq
		close(ix.progress)
		ix.progress = make(chan struct{})
	}
	return ix.overflow
}

// compact writes the header and a snapshot into a new file and renames it over the
// index; the records queued that the snapshot reflects are taken off the queue.
func (ix *Index) compact() error {
	b := &Batch{ix: ix, b: AppendHeader(ix.scratch[:0], ix.hdr)}
	seq := ix.snapshot(b)
	ix.scratch = b.b[:0]
	if b.n > ix.most {
		return fmt.Errorf("a snapshot of %d records, over the %d its shape bounds", b.n, ix.most)
	}
	f, err := ix.writeNew(b.b)
	if err != nil {
		return err
	}
	if ix.f != nil {
		_ = ix.f.Close() // cleanup: its file was replaced, and every write to it is done
	}
	ix.f, ix.records, ix.limit = f, b.n, min(max(ix.base, 2*b.n), ix.most)
	ix.mu.Lock()
	defer ix.mu.Unlock()
	if ix.overflow != nil {
		return ix.overflow // the queue is gone: run stops at it
	}
	if first := ix.written + 1; seq >= first {
		// The queue holds the records after written, in order: those up to seq are
		// in the snapshot.
		q, end := ix.queue[ix.head:], 0
		for range seq - ix.written {
			end += frame + int(binary.LittleEndian.Uint32(q[end:]))
		}
		ix.dropLocked(end)
		ix.written = seq
		close(ix.progress)
		ix.progress = make(chan struct{})
	}
	return nil
}

// writeNew writes b into path+".new", made anew, syncs it, renames it over path and
// syncs the directory; it returns the file, open for appending. On failure the new
// file is removed.
func (ix *Index) writeNew(b []byte) (_ *os.File, err error) {
	tmp := ix.path + ".new"
	f, err := createNew(tmp)
	if err != nil {
		return nil, err
	}
	defer func() {
		if err != nil {
			_ = f.Close()      // cleanup: the first error is the one returned
			_ = os.Remove(tmp) // best effort: a leftover is removed by the next compaction
		}
	}()
	if _, err = f.Write(b); err != nil {
		return nil, fmt.Errorf("kv/internal/index: writing %s: %w", tmp, err)
	}
	if err = f.Sync(); err != nil {
		return nil, fmt.Errorf("kv/internal/index: syncing %s: %w", tmp, err)
	}
	if err = ix.rename(tmp); err != nil {
		return nil, err
	}
	if err = syncDir(filepath.Dir(ix.path)); err != nil {
		return nil, fmt.Errorf("kv/internal/index: syncing the directory of %s: %w", ix.path, err)
	}
	return f, nil
}

// rename renames tmp over the index's path, unless the index failed meanwhile (its
// queue past its bound): its file was removed then, or is about to be, and no other
// may take its place.
func (ix *Index) rename(tmp string) error {
	if f := ix.opts.onRename; f != nil {
		f(false)
	}
	ix.fileMu.Lock()
	defer ix.fileMu.Unlock()
	ix.mu.Lock()
	overflow := ix.overflow
	ix.mu.Unlock()
	if overflow != nil {
		return overflow
	}
	if err := os.Rename(tmp, ix.path); err != nil {
		return fmt.Errorf("kv/internal/index: %w", err)
	}
	if f := ix.opts.onRename; f != nil {
		f(true)
	}
	return nil
}

// createNew creates path for writing, mode 0600, where nothing is: whatever is at
// path (a compaction's leftover, or a link planted there) is removed first, not
// followed, and a file that appears meanwhile makes it fail.
func createNew(path string) (*os.File, error) {
	if err := os.Remove(path); err != nil && !errors.Is(err, os.ErrNotExist) {
		return nil, fmt.Errorf("kv/internal/index: removing %s: %w", path, err)
	}
	fd, err := unix.Open(path, unix.O_WRONLY|unix.O_CREAT|unix.O_EXCL|unix.O_NOFOLLOW|unix.O_CLOEXEC, 0o600)
	if err != nil {
		return nil, fmt.Errorf("kv/internal/index: creating %s: %w", path, err)
	}
	return os.NewFile(uintptr(fd), path), nil
}

// syncDir syncs directory dir, so that a rename in it lasts.
func syncDir(dir string) error {
	fd, err := unix.Open(dir, unix.O_RDONLY|unix.O_DIRECTORY|unix.O_CLOEXEC, 0)
	if err != nil {
		return err
	}
	defer func() { _ = unix.Close(fd) }() // cleanup: read only
	return unix.Fsync(fd)
}

// fail stops the index after err: its file is emptied and removed, so that no start
// serves from an index that missed a change, and every Wait returns the error; the
// first failure is logged, and a second call (the writer's, after a failure its queue
// caused) does nothing more than remove the file again. f is the file the writer
// holds, or nil from a goroutine other than the writer's, which leaves it to the
// writer and removes the path only.
func (ix *Index) fail(err error, f *os.File) {
	ix.fileMu.Lock()
	defer ix.fileMu.Unlock()
	ferr := fmt.Errorf("%w: %s: %w", ErrFailed, ix.path, err)
	var terr error
	if f != nil {
		terr = f.Truncate(0) // the file this index wrote, wherever its name went
	}
	rerr := os.Remove(ix.path)
	stale := rerr != nil && !errors.Is(rerr, os.ErrNotExist) && (f == nil || terr != nil)
	switch {
	case stale && f == nil:
		ferr = fmt.Errorf("%w; %w: it could not be removed (%v): remove it before the next start", ferr, ErrStale, rerr)
	case stale:
		ferr = fmt.Errorf("%w; %w: it could be neither emptied (%v) nor removed (%v): remove it before the next start", ferr, ErrStale, terr, rerr)
	}
	if ix.failed {
		return // the first failure was logged, and every Wait returns it
	}
	ix.failed = true
	if l := ix.opts.log; l != nil { // before any Wait returns the failure, and not under ix.mu
		if stale {
			l.Error("kv: the index cannot be written, nor removed: remove it before the next start", "path", ix.path, "err", ferr)
		} else {
			l.Error("kv: the index cannot be written; it is removed, and a restart starts with no pages", "path", ix.path, "err", ferr)
		}
	}
	ix.mu.Lock()
	defer ix.mu.Unlock()
	ix.err = ferr
	ix.queue, ix.head = nil, 0
	close(ix.progress)
	ix.progress = make(chan struct{})
}
