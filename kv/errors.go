package kv

import (
	"errors"

	"github.com/cudapool/cudapool/export"
)

// MaxBatch is the most pages (or hashes, or leases) one request may carry.
const MaxBatch = 4096

// Errors of the KV page pool. Every error the pool returns about one of these
// conditions wraps the sentinel, so callers match with [errors.Is].
var (
	// ErrNoSpace means an alloc found not enough free or evictable pages; nothing was
	// leased.
	ErrNoSpace = errors.New("kv: not enough free pages")
	// ErrStaleLease means the owner holds no such lease for this connection: it was
	// released already, belongs to another replica, or was never issued.
	ErrStaleLease = errors.New("kv: stale lease")
	// ErrOwnerGone means the owner's process died or its connection ended.
	ErrOwnerGone = errors.New("kv: owner is gone")
	// ErrClosed means the replica (or owner) was closed.
	ErrClosed = errors.New("kv: closed")
	// ErrGeometry means a request does not fit the geometry: a page count out of
	// range, a hash count that does not match, a wrong device, an invalid geometry.
	ErrGeometry = errors.New("kv: does not fit the geometry")
	// ErrHostMemory means a host tier asked for is larger than the host's available
	// memory; nothing was made.
	ErrHostMemory = errors.New("kv: not enough host memory")
	// ErrTooLarge means a batch is over [MaxBatch] (or a frame over the wire's limit).
	ErrTooLarge = errors.New("kv: batch too large")
	// ErrRefused means the owner did not admit the replica: its policy, the protocol
	// version or the Hello.
	ErrRefused = errors.New("kv: refused")
	// ErrLimit means a cap of the owner's is full (connections, leases or event
	// handles of one connection); the error names the cap. Nothing was granted.
	ErrLimit = errors.New("kv: limit reached")
	// ErrLeaseLost means a lease held when the owner died was not re-established by
	// the owner that took its place: its pages may have been reused, so nothing read
	// from or written to them since can be trusted.
	ErrLeaseLost = errors.New("kv: lease lost in an owner's restart")
)

// RemoteError is a failure the owner reported with a message of its own: Err is the
// sentinel it stands for where there is one ([ErrNoSpace], [ErrStaleLease], ...), else
// nil, and Peer is "kv: owner". It is [export.RemoteError], the one form of a
// server's refusal.
type RemoteError = export.RemoteError
