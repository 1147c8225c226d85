// Package poolshare owns the part of package pool that only the sharing protocol
// (package producer) uses, kept out of pool's API: a Lease keeps a shared buffer from
// going back to its pool, a Completion lets leases end without a stream wait, and a
// Retention holds a buffer's memory past its leases. Package pool implements them and
// sets the functions below at init; pool's package documentation ("Ordered release")
// says what they guarantee.
package poolshare

import (
	"errors"

	"github.com/cudapool/cudapool/cudart"
)

var (
	// ErrLeaseEnded means a lease or retention was ended again.
	ErrLeaseEnded = errors.New("pool: lease already ended")
	// ErrNotLeased means Retain was given a buffer without a live lease.
	ErrNotLeased = errors.New("pool: buffer not leased")
)

// Lease keeps a shared buffer from going back to its pool: while any lease on a buffer
// lives, Free only marks it. The sharing layer takes one per grant.
type Lease interface {
	// End ends the lease. releaseEvent is an event on the pool's device, owned by the
	// caller, whose last record covers the importer's free of its import; 0 means that
	// free is known to have completed (the importer synchronized, or exited). The
	// release stream waits for releaseEvent as it is now, so the caller may destroy or
	// re-record it as soon as End returns.
	//
	// If this was the last lease of a buffer that Free was called on, End issues the
	// deferred free; if that fails, the lease has still ended, and the error wraps
	// pool.ErrFreeFailed. Ending a lease twice fails with ErrLeaseEnded. If
	// waiting for releaseEvent fails, the lease is still live and End may be called
	// again. After the pool's Close began, End only ends the lease: the buffer has been
	// abandoned and will not be freed.
	End(releaseEvent cudart.Event) error
	// EndAt ends the lease now, as End does, but leaves the wait for the importer's
	// free to the buffer's own free or reuse: it waits for c's latest record then, if
	// that has not completed. It fails with ErrLeaseEnded if the lease has ended,
	// and with pool.ErrInvalidOption if c belongs to another pool or was closed.
	EndAt(c Completion) error
}

// Completion is an importer's event, recorded after each of its frees, always on one
// in-order stream, so that its latest record covers every earlier one. Its owner
// keeps the event alive until Close has returned.
type Completion interface {
	// Close settles what the completion is still owed, so that its event can be
	// destroyed: with wait, the release stream waits for the event's latest record
	// (unless it has completed); without (the importer's process has exited, and its
	// frees with it), the buffers owe it nothing any more. A second Close does nothing.
	Close(wait bool) error
}

// Retention is one importer's hold on a buffer's memory past the buffer's leases.
type Retention interface {
	// End ends the retention once the importer has freed its mapping. releaseEvent is an
	// event on the pool's device whose last record covers that free, or 0 if it is
	// known to have completed. If this was the last retention of memory the pool is
	// taking back, End frees it (a failure wraps pool.ErrFreeFailed). Ending a
	// retention twice fails with ErrLeaseEnded.
	End(releaseEvent cudart.Event) error
}

var (
	// Take takes a lease on buf, a *pool.Buffer, to be ended with the importer's
	// completion. Take it before exporting the buffer's record, so that the buffer
	// cannot be freed while being shared. It fails with pool.ErrNotShareable on a
	// local pool and with pool.ErrFreed once Free was called or the pool closed.
	Take func(buf any) (Lease, error)
	// Retain keeps buf's memory (buf a *pool.Buffer) from going back to the driver
	// until the Retention ends, across the buffers the memory passes to. It needs a
	// live lease on buf. revoke is called (without the pool's locks held, never twice,
	// and it must not block) when the pool wants the memory back: the caller then has
	// the importer free its mapping and ends the Retention. It fails with
	// pool.ErrNotShareable on a local pool, ErrNotLeased without a live lease and
	// pool.ErrClosed after Close.
	Retain func(buf any, revoke func()) (Retention, error)
	// NewCompletion returns the Completion of ev, an event on the device of p (a
	// *pool.Pool), for Lease.EndAt. ev must be recorded only on one stream, in order,
	// after each free it stands for; Close it before destroying ev. gone, if not nil,
	// is asked before each use of ev: once the importer's process has exited, its
	// event is waited for no more. It is nil if p is not a *pool.Pool.
	NewCompletion func(p any, ev cudart.Event, gone func() bool) Completion
)
