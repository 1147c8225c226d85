package export

import (
	"errors"
	"fmt"
)

// Errors of the sharing protocol. Every error export returns that is about one of these
// conditions wraps the sentinel, so callers match with errors.Is; the message around it
// says which peer, name or lease.
var (
	// ErrClosed means the Exporter or Importer was closed, or is closing.
	ErrClosed = errors.New("export: closed")
	// ErrExporterGone means the exporter's connection ended (the producer exited,
	// crashed or closed): no new buffer can be opened through this Importer. Mappings
	// on the exporter's own GPU stay readable until released (FACTS 7); mappings on
	// another GPU do not (ErrMappingLost).
	ErrExporterGone = errors.New("export: exporter is gone")
	// ErrMappingLost means a Mapping on another GPU than its exporter's must not be
	// used any more: the exporter is gone, and a read of its memory from another GPU
	// would lose this process's CUDA context (cudart.ErrContextLost, FACTS 14). Release
	// it; WithReplica avoids it. It wraps ErrExporterGone.
	ErrMappingLost = fmt.Errorf("%w: this mapping lives on another GPU than its exporter's, and reading it now would lose this process's CUDA context; release it", ErrExporterGone)
	// ErrAbandoned means Exporter.Close ended while consumers still mapped buffers: their
	// leases were kept, not ended, and each buffer is freed once its consumer releases
	// it or exits.
	ErrAbandoned = errors.New("export: leases abandoned at close: each buffer is freed once its consumer releases it or exits")
	// ErrTooManyGrants means a peer asked for more grants than the exporter allows one
	// connection (WithMaxGrants): release some first.
	ErrTooManyGrants = errors.New("export: too many grants held by this connection")
	// ErrSocketPath means a socket path cannot be used: it is longer than the kernel
	// allows a Unix socket address (108 bytes, with the socket's temporary name in the
	// same directory).
	ErrSocketPath = errors.New("export: socket path too long for a Unix socket (the kernel allows 108 bytes)")
	// ErrRefused means the exporter did not admit this process; the message carries
	// the exporter's reason.
	ErrRefused = errors.New("export: refused by exporter")
	// ErrVersionMismatch means the two sides speak different protocol versions; the
	// message names both.
	ErrVersionMismatch = errors.New("export: protocol version mismatch")
	// ErrProtocol means a peer sent something the protocol does not allow: a malformed,
	// oversized or unexpected frame, or an unexpected file descriptor. The connection
	// it came on is closed.
	ErrProtocol = errors.New("export: protocol violation")
	// ErrUnknownName means no buffer is published under the name asked for.
	ErrUnknownName = errors.New("export: no buffer published under that name")
	// ErrNameInUse means a buffer is already published under that name.
	ErrNameInUse = errors.New("export: name already published")
	// ErrBadName means a name is empty, too long, not UTF-8 or holds control
	// characters, bidirectional controls (which make it display as another) or line
	// separators.
	ErrBadName = errors.New("export: invalid name")
	// ErrStaleLease means the lease id was issued to this connection but has ended:
	// a second release, or a replay.
	ErrStaleLease = errors.New("export: stale lease")
	// ErrForeignLease means the lease id was issued to another connection.
	ErrForeignLease = errors.New("export: lease belongs to another connection")
	// ErrForgedLease means the exporter never issued the lease id.
	ErrForgedLease = errors.New("export: lease id was never issued")
	// ErrBufferGone means the buffer was freed (or its pool closed) before it could be
	// leased: the library never hands out export data of a freed buffer (FACTS 3).
	ErrBufferGone = errors.New("export: buffer freed")
	// ErrNoPeer means no connected peer has the pid Push was given.
	ErrNoPeer = errors.New("export: no such peer")
	// ErrAddressInUse means a live exporter already answers on the socket path.
	ErrAddressInUse = errors.New("export: socket path in use by a live exporter")
	// ErrNotSocket means the socket path exists and is not a socket; it is left alone.
	ErrNotSocket = errors.New("export: path exists and is not a socket")
	// ErrIMEXRequired means a FABRIC pool could not be exported because the host has
	// no IMEX channel (the driver answers operation not permitted, FACTS 11).
	ErrIMEXRequired = errors.New("export: FABRIC export needs an IMEX channel, and this host has none")
	// ErrHandleType means the pool's handle type cannot travel to this peer: a POSIX
	// fd pool to a peer on a byte stream without descriptor passing, a pool the peer
	// cannot import, or a pool that is not shareable at all.
	ErrHandleType = errors.New("export: pool handle type cannot be shared with this peer")
	// ErrBadDir means the announce directory is not private to this user.
	ErrBadDir = errors.New("export: announce directory is not private")
	// ErrExporter means the exporter failed to serve a request for a reason of its own
	// (a CUDA error, for instance); the message carries its text.
	ErrExporter = errors.New("export: exporter failed")
	// ErrBadRequest means the exporter found a request malformed in a way the frame
	// layout cannot show (a lease count of zero, for instance).
	ErrBadRequest = errors.New("export: bad request")
	// ErrDuplicateImporter means this process already has an Importer connected to
	// the same exporter on the same runtime: two would import the same pointers and
	// free each other's mappings (FACTS 4). Share the first one.
	ErrDuplicateImporter = errors.New("export: this process already has an Importer for that exporter")
	// ErrStreamDevice means a stream given to Open (or WithPushes) belongs to another
	// device than the Importer's: the import's free could not be ordered after it.
	ErrStreamDevice = errors.New("export: stream is on another device than the Importer's")
	// ErrReleased means a Mapping was released more times than it was opened, or
	// after its Importer closed.
	ErrReleased = errors.New("export: mapping already released")
	// ErrBadRange means a range to publish is empty or does not lie within its buffer.
	ErrBadRange = errors.New("export: range outside the buffer")
	// ErrMetaTooLong means metadata to publish is longer than MaxMetaLen.
	ErrMetaTooLong = errors.New("export: metadata too long")
	// ErrNoLeases means the connection was made for State alone (QueryState's), so it
	// cannot take leases.
	ErrNoLeases = errors.New("export: connection cannot hold leases")
)

// RemoteError is a request the exporter refused: Text is the exporter's message, and
// errors.Is matches Err, the sentinel it stands for (ErrUnknownName, ErrStaleLease, ...).
type RemoteError struct {
	Err  error
	Text string
}

func (e *RemoteError) Error() string { return "exporter: " + e.Text }
func (e *RemoteError) Unwrap() error { return e.Err }

// replyErr turns an Error frame into the error it stands for.
func replyErr(m *errorMsg) error {
	return &RemoteError{Err: codeErrs[m.Code], Text: m.Text}
}
