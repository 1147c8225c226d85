package replica

import (
	"context"
	"errors"
	"fmt"
	"net"

	"golang.org/x/sys/unix"

	"github.com/cudapool/cudapool/cudart"
	"github.com/cudapool/cudapool/internal/session"
	"github.com/cudapool/cudapool/kv"
	"github.com/cudapool/cudapool/kv/internal/kvwire"
)

// streamNotifier is how the owner learns that the replica's work on one stream has
// completed: an eventfd the stream adds 1 to at each point (cudart.StreamNotify),
// registered once on a connection (a Notifier frame carries it), and a local event
// recorded after each point, which Close, teardown and a reconnection's drain wait for.
// A connection gets eventfds of its own, counting from 0: an owner may still read the
// eventfds of a connection it lost.
type streamNotifier struct {
	ev     cudart.Event  // local; recorded after each point
	id     uint32        // the notifier's id on nc
	fd     int           // the eventfd, -1 until the first point
	nc     *net.UnixConn // the connection fd is registered on
	points uint64        // StreamNotify calls queued through fd
	reg    *registration // fd's Notifier frame on nc
	// oldFDs are eventfds of earlier connections whose writes may still be queued:
	// closed once ev says they have run, else left to the process's exit.
	oldFDs []int
}

// registration is the sending of a Notifier frame: done is closed once it was sent,
// or failed (err: the points queued through it are lost, and the next point
// registers an eventfd anew).
type registration struct {
	done chan struct{}
	err  error
}

// point queues a point on s and returns it: the Target'th StreamNotify through s's
// notifier on the current connection, registered there first if it is not yet; where
// the runtime says that s's work has all completed (cudart.StreamQuerier) it queues
// nothing and returns kvwire.Now (a point costs a turn of the GPU for this process's
// context, docs/FACTS.md 23). The notifier's eventfd is written once the work queued
// on s before the call has completed.
func (r *Replica) point(ctx context.Context, s cudart.Stream) (kvwire.Point, error) {
	r.mu.Lock()
	w, nc := r.w, r.nc
	r.mu.Unlock()
	r.evMu.Lock()
	if r.evClosed {
		r.evMu.Unlock()
		return kvwire.Now, kv.ErrClosed
	}
	n, ok := r.notifiers[s]
	if !ok {
		if n = r.reuseLocked(); n == nil {
			ev, err := r.rt.EventCreate(r.dev, cudart.EventDisableTiming)
			if err != nil {
				r.evMu.Unlock()
				return kvwire.Now, err
			}
			n = &streamNotifier{ev: ev, fd: -1}
		}
		r.notifiers[s] = n
	}
	if q, ok := r.rt.(cudart.StreamQuerier); ok {
		if done, err := q.StreamQuery(r.dev, s); err == nil && done {
			r.evMu.Unlock()
			return kvwire.Now, nil
		}
	}
	send := n.nc != nc
	if send {
		if err := r.renewLocked(n, nc); err != nil {
			r.evMu.Unlock()
			return kvwire.Now, err
		}
	}
	id, fd, reg := n.id, n.fd, n.reg
	at := kvwire.Now
	err := r.rt.StreamNotify(r.dev, s, fd)
	if err == nil {
		n.points++
		at = kvwire.Point{Notifier: id, Target: n.points}
		err = r.rt.EventRecord(r.dev, n.ev, s)
	}
	r.evMu.Unlock()
	if send { // sent whatever the point's fate: other calls wait for it
		if err := w.WriteFD(ctx, fd, func(b []byte) ([]byte, error) { return kvwire.AppendNotifier(b, kvwire.Notifier{ID: id}) }); err != nil {
			reg.err = fmt.Errorf("kv/replica: registering the stream's notifier with the owner: %w", err)
			r.evMu.Lock()
			if n.reg == reg {
				n.nc = nil // the next point registers an eventfd anew
			}
			r.evMu.Unlock()
			if errors.Is(err, session.ErrBroken) {
				r.failConn(nc, err) // a frame cut short: the owner cannot read on
			}
		}
		close(reg.done)
	}
	select {
	case <-reg.done:
	case <-ctx.Done():
		return kvwire.Now, ctx.Err()
	}
	if reg.err != nil {
		return kvwire.Now, reg.err
	}
	if err != nil {
		return kvwire.Now, err
	}
	return at, nil
}

// reuseLocked takes the notifier of a stream given to Forget whose work has all
// completed (its event's last record, after its last point, has), under r.evMu, for
// a new stream: the eventfd counts on from the points it counted, which have all
// been written, so a target of the new stream's is reached only by its own points.
// The owner's notifiers so stay as many as the streams the replica uses at once. Nil
// if none has completed.
func (r *Replica) reuseLocked() *streamNotifier {
	for i, n := range r.retired {
		if done, err := r.rt.EventQuery(r.dev, n.ev); err == nil && done {
			r.retired = append(r.retired[:i], r.retired[i+1:]...)
			return n
		}
	}
	return nil
}

// renewLocked gives n an eventfd of its own on nc, counting from 0, under r.evMu: the
// caller sends its Notifier frame. The eventfd n had is closed where the stream's
// writes to it have all run, and else kept among n's old ones.
func (r *Replica) renewLocked(n *streamNotifier, nc *net.UnixConn) error {
	fd, err := unix.Eventfd(0, unix.EFD_NONBLOCK|unix.EFD_CLOEXEC)
	if err != nil {
		return err
	}
	r.openFDs.Add(1)
	if n.fd >= 0 {
		n.oldFDs = append(n.oldFDs, n.fd)
	}
	r.lastNotifier++
	n.id, n.fd, n.nc, n.points, n.reg = r.lastNotifier, fd, nc, 0, &registration{done: make(chan struct{})}
	n.closeOld(r)
	return nil
}

// closeOld closes n's old eventfds if the stream has run every write queued
// to them (its event's last record, queued after them, has completed); it says
// whether none is left.
func (n *streamNotifier) closeOld(r *Replica) bool {
	if len(n.oldFDs) == 0 {
		return true
	}
	if done, err := r.rt.EventQuery(r.dev, n.ev); err != nil || !done {
		return false
	}
	for _, fd := range n.oldFDs {
		_ = unix.Close(fd) // cleanup: nothing writes to it any more
		r.openFDs.Add(-1)
	}
	n.oldFDs = nil
	return true
}

// finalPoint queues the point Close's Bye carries: on the replica's own stream, after
// the work queued so far on every stream the replica has sealed or released on.
func (r *Replica) finalPoint(ctx context.Context) (kvwire.Point, error) {
	r.evMu.Lock()
	for s, n := range r.notifiers {
		if s == r.stream {
			continue
		}
		if err := r.rt.EventRecord(r.dev, n.ev, s); err != nil {
			r.evMu.Unlock()
			return kvwire.Now, err
		}
		if err := r.rt.StreamWaitEvent(r.dev, r.stream, n.ev); err != nil {
			r.evMu.Unlock()
			return kvwire.Now, err
		}
	}
	for _, n := range r.retired { // their streams' last records, made by Forget
		if err := r.rt.StreamWaitEvent(r.dev, r.stream, n.ev); err != nil {
			r.evMu.Unlock()
			return kvwire.Now, err
		}
	}
	r.evMu.Unlock()
	return r.point(ctx, r.stream)
}

// endNotifiers destroys the events of ns and closes their eventfds whose writes have
// all run: the others are left to the process's exit, as a write still queued to a
// closed descriptor would go to whatever file took its number. Nothing here waits for
// the GPU. It returns the errors met.
func (r *Replica) endNotifiers(ns []*streamNotifier) []error {
	var errs []error
	left := 0
	for _, n := range ns {
		if n.fd >= 0 {
			n.oldFDs = append(n.oldFDs, n.fd)
			n.fd = -1
		}
		if !n.closeOld(r) {
			left += len(n.oldFDs)
		}
		if err := r.rt.EventDestroy(r.dev, n.ev); err != nil {
			errs = append(errs, err)
		}
	}
	if left > 0 {
		r.log.Debug("kv: eventfds whose streams still run are left to the process's exit", "eventfds", left)
	}
	return errs
}
