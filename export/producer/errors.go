package producer

import (
	"errors"

	"github.com/cudapool/cudapool/export/internal/wire"
)

// Errors of the producer side. Every error this package returns about one of these
// conditions wraps the sentinel, so callers match with errors.Is; the message around it
// says which peer, name or lease.
var (
	// ErrAbandoned means Exporter.Close ended while consumers still mapped buffers: their
	// leases were kept, not ended, and each buffer is freed once its consumer releases
	// it or exits.
	ErrAbandoned = errors.New("producer: leases abandoned at close: each buffer is freed once its consumer releases it or exits")
	// ErrSocketPath means a socket path cannot be used: it is longer than the kernel
	// allows a Unix socket address (108 bytes, with the socket's temporary name in the
	// same directory).
	ErrSocketPath = errors.New("producer: socket path too long for a Unix socket (the kernel allows 108 bytes)")
	// ErrNameInUse means a buffer is already published under that name.
	ErrNameInUse = errors.New("producer: name already published")
	// ErrNoPeer means no connected peer has the pid Push was given.
	ErrNoPeer = errors.New("producer: no such peer")
	// ErrAddressInUse means a live exporter already answers on the socket path.
	ErrAddressInUse = errors.New("producer: socket path in use by a live exporter")
	// ErrMetaTooLong means metadata to publish is longer than MaxMetaLen.
	ErrMetaTooLong = errors.New("producer: metadata too long")
)

// The protocol's errors a producer meets too, the same values as the other side's.
var (
	// ErrNotSocket means the socket path exists and is not a socket; it is left alone.
	ErrNotSocket = wire.ErrNotSocket
	// ErrClosed means the Exporter or Importer was closed, or is closing.
	ErrClosed = wire.ErrClosed
	// ErrUnknownName means no buffer is published under the name asked for.
	ErrUnknownName = wire.ErrUnknownName
	// ErrBadName means a name is empty, too long, not UTF-8 or holds control
	// characters, bidirectional controls (which make it display as another) or line
	// separators.
	ErrBadName = wire.ErrBadName
	// ErrBufferGone means the buffer was freed (or its pool closed) before it could be
	// leased: the library never hands out export data of a freed buffer (FACTS 3).
	ErrBufferGone = wire.ErrBufferGone
	// ErrIMEXRequired means a FABRIC pool could not be exported because the host has
	// no IMEX channel (the driver answers operation not permitted, FACTS 11).
	ErrIMEXRequired = wire.ErrIMEXRequired
	// ErrHandleType means the pool's handle type cannot travel to this peer: a POSIX
	// fd pool to a peer on a byte stream without descriptor passing, a pool the peer
	// cannot import, or a pool that is not shareable at all.
	ErrHandleType = wire.ErrHandleType
	// ErrBadRange means a range to publish is empty or does not lie within its buffer.
	ErrBadRange = wire.ErrBadRange
	// ErrTooManyGrants means a peer asked for more grants than the exporter allows one
	// connection (WithMaxGrants): release some first.
	ErrTooManyGrants = wire.ErrTooManyGrants
	// ErrStaleLease means the exporter holds no such lease for this connection: it
	// was released already, it is another connection's, or it was never issued. The
	// message says which.
	ErrStaleLease = wire.ErrStaleLease
	// ErrProtocol means a peer sent something the protocol does not allow: a malformed,
	// oversized or unexpected frame, or an unexpected file descriptor. The connection
	// it came on is closed.
	ErrProtocol = wire.ErrProtocol
	// ErrBadRequest means the exporter found a request malformed in a way the frame
	// layout cannot show (a lease count of zero, for instance).
	ErrBadRequest = wire.ErrBadRequest
	// ErrVersionMismatch means the two sides speak different protocol versions; the
	// message names both.
	ErrVersionMismatch = wire.ErrVersionMismatch
	// ErrRefused means the exporter did not admit this process; the message carries
	// the exporter's reason.
	ErrRefused = wire.ErrRefused
)
