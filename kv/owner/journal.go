package owner

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"os"
	"strconv"
	"strings"
	"sync/atomic"

	"github.com/cudapool/cudapool/internal/session"
	"github.com/cudapool/cudapool/kv"
	"github.com/cudapool/cudapool/kv/internal/index"
)

// The index file (WithIndex) is kv/internal/index's: the owner queues a record there,
// under o.mu, at each change a restarted owner needs (a page made visible or evicted,
// a host page sealed once its spill copy has completed or evicted, a replica admitted
// or gone, a lease granted to a process and its end: restart.go), in the order the
// page table returns them (slab.go), and a reply whose truth depends on a record
// waits, outside o.mu, until the index has written it (Owner.journaled): an Alloc or
// a Match (its grant, the pages it evicted), a copy into an evicted page (GPU or
// host), a Seal that waits for visibility, and a replica's admission. Only visible
// pages are journaled, so a page whose writer had not finished never becomes
// visible, also across a restart.
//
// A disk that stops taking the index's writes cannot hold o.mu, nor grow the owner's
// memory without bound: records are queued under o.mu without a syscall, up to the
// index's bound on its queue (index.WithMaxQueued; by default the most bytes an index
// file of the owner's shape holds), and the record past it fails the index, off o.mu,
// as a write error does. Its file is removed, the reason logged, and every reply
// waiting in journaled is answered: the owner serves on without an index, and a
// restart starts with no pages. Until the file is removed (a removal may hang as the
// write does), or while the queue is within its bound, a reply waits in journaled
// until the owner stops, a replica's call until its ctx ends, and o.Close until its
// own does.

// procID names a process across pid reuse: its pid and its start time in clock ticks
// since boot (/proc/PID/stat, field 22), as the index journals it.
type procID = index.Proc

// procStart is pid's start time, or an error if it has no live process.
func procStart(pid int) (uint64, error) {
	b, err := os.ReadFile("/proc/" + strconv.Itoa(pid) + "/stat")
	if err != nil {
		return 0, err
	}
	// The command name, field 2, is in parentheses and may hold spaces: count after it.
	i := bytes.LastIndexByte(b, ')')
	if i < 0 {
		return 0, fmt.Errorf("kv/owner: /proc/%d/stat: no command name", pid)
	}
	fields := strings.Fields(string(b[i+1:]))
	if len(fields) < 20 {
		return 0, fmt.Errorf("kv/owner: /proc/%d/stat: %d fields", pid, len(fields)+2)
	}
	if fields[0] == "Z" || fields[0] == "X" { // exited, not reaped yet
		return 0, fmt.Errorf("kv/owner: pid %d has exited", pid)
	}
	return strconv.ParseUint(fields[19], 10, 64) // field 22
}

// procOf is the procID of the live process pid.
func procOf(pid int) (procID, error) {
	st, err := procStart(pid)
	return procID{PID: uint32(pid), Start: st}, err
}

// indexOptions are added to the index's options by tests (SetIndexOptions).
var indexOptions []index.Option

// shape is what the owner's index may hold: its slabs, its host tiers, and an attach
// record for each connection and each replica waited for after a restart.
func (o *Owner) shape() index.Shape {
	conns := o.opts.Limits.Conns
	if conns <= 0 {
		conns = session.DefaultConns
	}
	return index.Shape{Geometry: o.geo, Devices: o.opts.Devices, HostPages: int(hostPagesOf(o.opts)), Replicas: 2 * conns,
		ReadPages: conns * o.opts.MaxLeasedPages}
}

// openIndex starts the index at o.opts.Index with hdr and the present state. It is
// called before the page server accepts anyone, without o.mu.
func (o *Owner) openIndex(hdr index.Header) error {
	snapshot := func(b *index.Batch) uint64 {
		o.mu.Lock()
		defer o.mu.Unlock()
		o.snapshotLocked(b)
		return b.Queued()
	}
	ix, err := index.Open(o.opts.Index, hdr, o.shape(), snapshot, append([]index.Option{index.WithLogger(o.log)}, indexOptions...)...)
	if err != nil {
		return fmt.Errorf("kv/owner: the index: %w", err)
	}
	o.mu.Lock()
	defer o.mu.Unlock()
	for _, s := range o.slabs {
		s.ix = ix
	}
	o.ix = ix
	return nil
}

// journaledHook, set by tests alone, is called as a reply begins to wait for the index
// (journaled). It is atomic: a test sets it while connections run, and the frames
// that follow reach the owner through recvmsg, which the race detector does not take
// for the ordering it is.
var journaledHook atomic.Pointer[func()]

// journaled waits, outside o.mu, until every record up to seq is in the index, for a
// reply or a copy whose truth depends on one (an evicted page's Free before the page
// is written). It returns nil at once without an index, and also once the index has
// failed and its file is gone: no restart reads a record of it then, so none can
// contradict the reply. It returns an error if the failed index's file was left
// behind (a restart could publish an evicted page under its old hash: no page is
// handed out for writing then), and one wrapping kv.ErrClosed if ctx ends first.
func (o *Owner) journaled(ctx context.Context, seq uint64) error {
	if hook := journaledHook.Load(); hook != nil {
		(*hook)()
	}
	err := o.ix.Wait(ctx, seq)
	if err == nil {
		err = o.ix.Err()
	}
	switch {
	case err == nil, errors.Is(err, index.ErrFailed) && !errors.Is(err, index.ErrStale):
		return nil
	case ctx.Err() != nil, errors.Is(err, index.ErrClosed):
		return fmt.Errorf("%w: the owner is closing: %w", kv.ErrClosed, err)
	}
	return fmt.Errorf("%w: no page is handed out for writing: %w", kv.ErrNoSpace, err)
}
