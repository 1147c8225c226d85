package consumer

import "github.com/cudapool/cudapool/export/internal/wire"

// The protocol's limits, as package producer gives them too.
const (
	// ProtocolVersion is the version of the sharing protocol this package speaks. Both
	// sides must speak the same one.
	ProtocolVersion = wire.ProtocolVersion
	// MaxBatch is the most names an OpenAll and the most Mappings a ReleaseAll may
	// carry.
	MaxBatch = wire.MaxBatch
	// MaxMetaLen is the most metadata a Mapping can carry (Mapping.Meta), in bytes.
	MaxMetaLen = wire.MaxMetaLen
)

// RemoteError is a request the exporter refused: Text is the exporter's message, and
// errors.Is matches Err, the sentinel it stands for (ErrUnknownName, ErrStaleLease, ...).
type RemoteError = wire.RemoteError
