package pool

import "errors"

var (
	// ErrFreed means the buffer was freed (or its free is pending until its leases
	// end, or Close released it): it can no longer be freed, leased or exported.
	ErrFreed = errors.New("pool: buffer already freed")
	// ErrForeignBuffer means a buffer was given to a pool that did not allocate it
	// (or a nil buffer was given).
	ErrForeignBuffer = errors.New("pool: buffer belongs to another pool")
	// ErrClosed means the pool has been closed (or is being force-closed).
	ErrClosed = errors.New("pool: closed")
	// ErrBusy means Close without [Force] found live or shared buffers, or calls in
	// flight; the pool is unchanged.
	ErrBusy = errors.New("pool: busy")
	// ErrNotShareable means the pool has handle type none (or is a device's default
	// pool) and cannot be exported or leased.
	ErrNotShareable = errors.New("pool: not shareable")
	// ErrUnsupportedHandleType means the device cannot share pools that way.
	ErrUnsupportedHandleType = errors.New("pool: handle type not supported by the device")
	// ErrMisaligned means the driver returned a pointer of an exportable pool that does
	// not start on a granule, which would let the buffer share pages with another.
	ErrMisaligned = errors.New("pool: driver returned a misaligned pointer")
	// ErrZeroSize means an allocation of 0 bytes was asked for.
	ErrZeroSize = errors.New("pool: zero-size allocation")
	// ErrInvalidOption means an option of [New] was out of range.
	ErrInvalidOption = errors.New("pool: invalid option")
	// ErrNoPeerAccess means a peer device given to [WithPeerAccess] cannot reach the
	// pool's device.
	ErrNoPeerAccess = errors.New("pool: peer device cannot access the pool's device")
	// ErrFreeFailed means a free the pool deferred until the buffer's leases ended
	// failed when it was finally issued. The buffer's memory stays reserved; [Stats]
	// counts it and Close reports it.
	ErrFreeFailed = errors.New("pool: deferred free failed")
	// ErrLeaseEnded means a [Lease] or [Retention] was ended again.
	ErrLeaseEnded = errors.New("pool: lease already ended")
	// ErrNotLeased means Retain was given a buffer without a live [Lease].
	ErrNotLeased = errors.New("pool: buffer not leased")
)
