package producer

import (
	"errors"
)

// Errors of the producer side; those it shares with the consumer side are package
// export's ([export.ErrClosed], [export.ErrUnknownName], ...). Every error this package returns about one of these
// conditions wraps the sentinel, so callers match with [errors.Is]; the message around it
// says which peer, name or lease.
var (
	// ErrAbandoned means [Exporter.Close] ended while consumers still mapped buffers: their
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
	// ErrMetaTooLong means metadata to publish is longer than [export.MaxMetaLen].
	ErrMetaTooLong = errors.New("producer: metadata too long")
)
