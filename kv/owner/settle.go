package owner

import (
	"encoding/binary"
	"errors"
	"fmt"
	"math"
	"os"

	"golang.org/x/sys/unix"

	"github.com/cudapool/cudapool/kv/internal/kvwire"
	"github.com/cudapool/cudapool/kv/internal/pages"
)

// record is work that waits for one point of a replica's notifier: a sealed write
// lease to settle (its pages made visible, or, if the writer dies first, freed) and
// leases released whose pages settle (Table.SealDone, Table.ReleaseDone).
type record struct {
	s        *slab
	target   uint64          // the notifier's running total at which it settles
	seal     pages.LeaseID   // the lease sealed, 0 if none
	released []pages.LeaseID // the leases released
	// wait is the request to answer once the seal is settled (a Seal with FlagWait).
	wait    uint32
	waiting bool
	// Set when settled.
	done               bool
	visible, duplicate int
}

// notifier is one of a replica's eventfds as its Notifier frame registered it: the
// owner's copy of the descriptor, nonblocking, which its own goroutine (watch) reads
// through Go's netpoller, and the records that wait for its points. The replica's
// stream adds 1 to it at each point it reaches, in stream order (cudart.StreamNotify),
// so its running total is the number of the stream's points that have completed.
type notifier struct {
	c       *conn
	id      uint32
	f       *os.File
	total   uint64    // completions counted so far; guarded by Owner.mu
	pending []*record // in the order they came, of any target; guarded by Owner.mu
}

// settle applies rec under o.mu: the sealed lease's pages become visible if publish
// (else they are freed: their writer died first), the released leases end. A lease
// the table no longer holds (its holder was declared dead after a restart) is skipped.
func (o *Owner) settle(rec *record, publish bool) {
	s := rec.s
	if rec.seal != 0 {
		if v, d, fx, err := s.tab.SealDone(rec.seal, publish); err == nil {
			rec.visible, rec.duplicate = v, d
			o.effectsLocked(s, fx)
		}
	}
	for _, id := range rec.released {
		if fx, err := s.tab.ReleaseDone(id); err == nil {
			o.effectsLocked(s, fx)
		}
	}
	rec.done = true
	s.spaceLocked()
}

// settleReachedLocked settles n's records whose target n's total has reached, under
// o.mu, or, with publish false (the replica's process has exited: its points will
// never be reached, and its work on the GPU ended with it), every record of n,
// publishing nothing. It returns owed with the answers owed to Seals that waited.
func (o *Owner) settleReachedLocked(n *notifier, publish bool, owed []answer) []answer {
	k := 0
	for _, rec := range n.pending {
		if publish && rec.target > n.total {
			n.pending[k] = rec
			k++
			continue
		}
		o.settle(rec, publish)
		if rec.waiting {
			owed = append(owed, answer{c: n.c, id: rec.wait, sealed: kvwire.Sealed{Visible: uint32(rec.visible), Duplicates: uint32(rec.duplicate)}, dead: !publish, seq: o.ix.Queued()})
		}
	}
	clear(n.pending[k:])
	n.pending = n.pending[:k]
	if k == 0 && n.c.idle != nil {
		o.signalIdle(n.c)
	}
	return owed
}

// answer is a reply owed to a Seal that waited, sent once o.mu is released.
type answer struct {
	c      *conn
	id     uint32
	sealed kvwire.Sealed
	dead   bool   // the writer died: nobody to answer
	seq    uint64 // the seal's records: it is answered once the index has them
}

// send sends owed, each on a goroutine of its own once the index has its records: a
// waiter never waits for a replica that does not read, nor for the index.
func (o *Owner) send(owed []answer) {
	for _, a := range owed {
		if !a.dead {
			go func() {
				_ = o.journaled(o.stopped, a.seq) // visible already: an index that failed, or a close, was said elsewhere
				a.c.sendSealed(a.id, a.sealed)
			}()
		}
	}
}

// errNotifier is why a Notifier frame closes its connection.
var errNotifier = errors.New("kv/owner: a bad Notifier")

// newNotifier checks that fd, received with Notifier id, is an eventfd and makes it
// nonblocking, so that reading it parks a goroutine in Go's netpoller. On success n
// owns fd; on failure fd is closed and the error wraps errNotifier.
func newNotifier(c *conn, id uint32, fd int) (*notifier, error) {
	link, err := os.Readlink(fmt.Sprintf("/proc/self/fd/%d", fd))
	if err == nil && link != "anon_inode:[eventfd]" {
		err = fmt.Errorf("its descriptor is %q, not an eventfd", link)
	}
	if err == nil {
		err = unix.SetNonblock(fd, true)
	}
	if err != nil {
		_ = unix.Close(fd) // cleanup: the check's error is the one returned
		return nil, fmt.Errorf("%w: notifier %d: %v", errNotifier, id, err)
	}
	return &notifier{c: c, id: id, f: os.NewFile(uintptr(fd), fmt.Sprintf("notifier %d of pid %d", id, c.cred.PID))}, nil
}

// watch reads n's eventfd until it is closed (its connection ended: close), each read
// adding what the replica's stream counted since the last to n's total and settling
// the records that total has reached: a goroutine per notifier, parked in the
// netpoller while nothing completes. It makes no driver call. A read that fails
// otherwise is logged, and n's records then wait for the replica's exit.
func (o *Owner) watch(n *notifier) {
	defer o.waiters.Done()
	var b [8]byte
	var owed []answer
	for {
		k, err := n.f.Read(b[:])
		if err != nil || k != len(b) {
			if !errors.Is(err, os.ErrClosed) {
				o.log.Warn("kv: reading a replica's notifier failed; its pending seals and releases wait for the replica's exit", "pid", n.c.cred.PID, "notifier", n.id, "read", k, "err", err)
			}
			return
		}
		o.wakes.Add(1)
		v := binary.NativeEndian.Uint64(b[:])
		o.mu.Lock()
		if n.total > math.MaxUint64-v { // a replica that writes its eventfd itself
			n.total = math.MaxUint64
		} else {
			n.total += v
		}
		owed = o.settleReachedLocked(n, true, owed)
		o.mu.Unlock()
		o.send(owed)
		clear(owed)
		owed = owed[:0]
	}
}

// Pace counts what the owner does about replicas' points since it started: Wakes
// (reads of a replica's eventfd that returned a count) and how many notifiers have
// records pending now (Waiting). It makes no driver call for them: a point pending
// costs a goroutine parked in the netpoller, nothing more.
type Pace struct {
	Wakes   uint64
	Waiting int
	// AllocWaits counts the Allocs that waited for pages to settle.
	AllocWaits uint64
}

// Pace is a snapshot of the owner's pace.
func (o *Owner) Pace() Pace {
	o.mu.Lock()
	n := 0
	for c := range o.conns {
		for _, nt := range c.notifiers {
			if len(nt.pending) > 0 {
				n++
			}
		}
	}
	o.mu.Unlock()
	return Pace{Wakes: o.wakes.Load(), Waiting: n, AllocWaits: o.allocWaits.Load()}
}

// closeNotifiers closes the eventfds of ns, without o.mu: their watchers return.
func closeNotifiers(ns map[uint32]*notifier) {
	for _, n := range ns {
		_ = n.f.Close() // cleanup: closing is what ends its watcher
	}
}
