package export

import (
	"errors"
)

// The errors both sides meet: those that travel as the protocol's error codes
// (docs/PROTOCOL.md's error table) and those of the handshake. Every error that package
// producer, consumer or discover returns about one of these conditions wraps the
// sentinel, so callers match with [errors.Is]; the message around it says which peer,
// name or lease.
var (
	// ErrNotSocket means the socket path exists and is not a socket; it is left alone.
	ErrNotSocket = errors.New("cudapool: path exists and is not a socket")
	// ErrClosed means the Exporter or Importer was closed, or is closing.
	ErrClosed = errors.New("cudapool: closed")
	// ErrExporterGone means the exporter's connection ended (the producer exited,
	// crashed or closed): no new buffer can be opened through this Importer. Mappings
	// on the exporter's own GPU stay readable until released (FACTS 7); mappings on
	// another GPU do not (consumer.ErrMappingLost).
	ErrExporterGone = errors.New("cudapool: exporter is gone")
	// ErrTooManyGrants means a peer asked for more grants than the exporter allows one
	// connection (producer.WithMaxGrants): release some first.
	ErrTooManyGrants = errors.New("cudapool: too many grants held by this connection")
	// ErrRefused means the exporter did not admit this process; the message carries
	// the exporter's reason.
	ErrRefused = errors.New("cudapool: refused by exporter")
	// ErrVersionMismatch means the two sides speak different protocol versions; the
	// message names both.
	ErrVersionMismatch = errors.New("cudapool: protocol version mismatch")
	// ErrProtocol means a peer sent something the protocol does not allow: a malformed,
	// oversized or unexpected frame, or an unexpected file descriptor. The connection
	// it came on is closed.
	ErrProtocol = errors.New("cudapool: protocol violation")
	// ErrUnknownName means no buffer is published under the name asked for.
	ErrUnknownName = errors.New("cudapool: no buffer published under that name")
	// ErrBadName means a name is empty, too long, not UTF-8 or holds control
	// characters, bidirectional controls (which make it display as another) or line
	// separators.
	ErrBadName = errors.New("cudapool: invalid name")
	// ErrStaleLease means the exporter holds no such lease for this connection: it
	// was released already (a second release, a replay), it is another connection's,
	// or it was never issued. The message says which.
	ErrStaleLease = errors.New("cudapool: stale lease")
	// ErrBufferGone means the buffer was freed (or its pool closed) before it could be
	// leased: the library never hands out export data of a freed buffer (FACTS 3). The
	// free unpublished its names, so it is an ErrUnknownName too: errors.Is matches
	// both, and C and Python report the name as unknown (CUDAPOOL_ENOTFOUND, NotFound).
	ErrBufferGone error = nameUnpublished{}
	// ErrIMEXRequired means a FABRIC pool could not be exported because the host has
	// no IMEX channel (the driver answers operation not permitted, FACTS 11).
	ErrIMEXRequired = errors.New("cudapool: FABRIC export needs an IMEX channel, and this host has none")
	// ErrHandleType means the pool's handle type cannot travel to this peer: a POSIX
	// fd pool to a peer on a byte stream without descriptor passing, a pool the peer
	// cannot import, or a pool that is not shareable at all.
	ErrHandleType = errors.New("cudapool: pool handle type cannot be shared with this peer")
	// ErrExporter means the exporter failed to serve a request for a reason of its own
	// (a CUDA error, for instance); the message carries its text.
	ErrExporter = errors.New("cudapool: exporter failed")
	// ErrBadRequest means the exporter found a request malformed in a way the frame
	// layout cannot show (a lease count of zero, for instance).
	ErrBadRequest = errors.New("cudapool: bad request")
	// ErrBadRange means a range to publish is empty or does not lie within its buffer.
	ErrBadRange = errors.New("cudapool: range outside the buffer")
	// ErrNoLeases means the connection was made for [State] alone (discover.QueryState's),
	// so it cannot take leases.
	ErrNoLeases = errors.New("cudapool: connection cannot hold leases")
)

// nameUnpublished is ErrBufferGone: an ErrUnknownName of its own.
type nameUnpublished struct{}

func (nameUnpublished) Error() string { return "cudapool: buffer freed, its name unpublished" }

// Is says that a freed buffer's name is an unknown one.
func (nameUnpublished) Is(target error) bool { return target == ErrUnknownName }

// RemoteError is a request a server refused with a message of its own, the one form
// of such a refusal in cudapool: an exporter's, and a KV owner's
// ([github.com/cudapool/cudapool/kv.RemoteError] is this type). Text is the server's
// message, and [errors.Is] matches Err, the sentinel it stands for ([ErrUnknownName],
// [ErrStaleLease], [github.com/cudapool/cudapool/kv.ErrNoSpace], ...), where there is
// one. Peer names the server in Error; empty is "exporter".
type RemoteError struct {
	Err  error
	Text string
	Peer string
}

func (e *RemoteError) Error() string {
	if e.Peer == "" {
		return "exporter: " + e.Text
	}
	return e.Peer + ": " + e.Text
}

// Unwrap is the sentinel the refusal stands for.
func (e *RemoteError) Unwrap() error { return e.Err }
