package consumer

import (
	"errors"
	"fmt"

	"github.com/cudapool/cudapool/export/internal/wire"
)

// Errors of the consumer side. Every error this package returns about one of these
// conditions wraps the sentinel, so callers match with errors.Is; the message around it
// says which name or lease. An exporter's refusal of a request is a *RemoteError that
// wraps the sentinel it stands for.
var (
	// ErrMappingLost means a Mapping on another GPU than its exporter's must not be
	// used any more: the exporter is gone, and a read of its memory from another GPU
	// would lose this process's CUDA context (cudart.ErrContextLost, FACTS 14). Release
	// it; WithReplica avoids it. It wraps ErrExporterGone.
	ErrMappingLost = fmt.Errorf("%w: this mapping lives on another GPU than its exporter's, and reading it now would lose this process's CUDA context; release it", ErrExporterGone)
	// ErrDuplicateImporter means this process already has an Importer connected to
	// the same exporter on the same runtime: two would import the same pointers and
	// free each other's mappings (FACTS 4). Share the first one.
	ErrDuplicateImporter = errors.New("consumer: this process already has an Importer for that exporter")
	// ErrStreamDevice means a stream given to Open (or WithPushes) belongs to another
	// device than the Importer's: the import's free could not be ordered after it.
	ErrStreamDevice = errors.New("consumer: stream is on another device than the Importer's")
	// ErrOwnExporter means Dial was asked for an exporter of this very process on the
	// same runtime: its buffers are already this process's, and CUDA imports none of
	// its own pools or events. Use the buffer (its Ptr) directly.
	ErrOwnExporter = errors.New("consumer: the exporter is this process's own: use its buffers' pointers directly, they need no import")
	// ErrReleased means a Mapping was released more times than it was opened, or
	// after its Importer closed.
	ErrReleased = errors.New("consumer: mapping already released")
)

// The protocol's errors a consumer meets too, the same values as the other side's.
var (
	// ErrClosed means the Exporter or Importer was closed, or is closing.
	ErrClosed = wire.ErrClosed
	// ErrExporterGone means the exporter's connection ended (the producer exited,
	// crashed or closed): no new buffer can be opened through this Importer. Mappings
	// on the exporter's own GPU stay readable until released (FACTS 7); mappings on
	// another GPU do not (ErrMappingLost).
	ErrExporterGone = wire.ErrExporterGone
	// ErrRefused means the exporter did not admit this process; the message carries
	// the exporter's reason.
	ErrRefused = wire.ErrRefused
	// ErrVersionMismatch means the two sides speak different protocol versions; the
	// message names both.
	ErrVersionMismatch = wire.ErrVersionMismatch
	// ErrProtocol means a peer sent something the protocol does not allow: a malformed,
	// oversized or unexpected frame, or an unexpected file descriptor. The connection
	// it came on is closed.
	ErrProtocol = wire.ErrProtocol
	// ErrUnknownName means no buffer is published under the name asked for.
	ErrUnknownName = wire.ErrUnknownName
	// ErrBadName means a name is empty, too long, not UTF-8 or holds control
	// characters, bidirectional controls (which make it display as another) or line
	// separators.
	ErrBadName = wire.ErrBadName
	// ErrStaleLease means the exporter holds no such lease for this connection: it
	// was released already, it is another connection's, or it was never issued. The
	// message says which.
	ErrStaleLease = wire.ErrStaleLease
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
	// ErrExporter means the exporter failed to serve a request for a reason of its own
	// (a CUDA error, for instance); the message carries its text.
	ErrExporter = wire.ErrExporter
	// ErrBadRequest means the exporter found a request malformed in a way the frame
	// layout cannot show (a lease count of zero, for instance).
	ErrBadRequest = wire.ErrBadRequest
	// ErrBadRange means a range to publish is empty or does not lie within its buffer.
	ErrBadRange = wire.ErrBadRange
	// ErrNoLeases means the connection was made for State alone (QueryState's), so it
	// cannot take leases.
	ErrNoLeases = wire.ErrNoLeases
	// ErrTooManyGrants means a peer asked for more grants than the exporter allows one
	// connection (WithMaxGrants): release some first.
	ErrTooManyGrants = wire.ErrTooManyGrants
)
