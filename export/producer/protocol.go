package producer

import "github.com/cudapool/cudapool/export/internal/wire"

// The protocol's limits, as package consumer gives them too.
const (
	// ProtocolVersion is the version of the sharing protocol this package speaks. Both
	// sides must speak the same one.
	ProtocolVersion = wire.ProtocolVersion
	// MaxNameLen is the longest name a buffer can be published under, in bytes.
	MaxNameLen = wire.MaxNameLen
	// MaxMetaLen is the most metadata a publish can carry (WithMeta), in bytes.
	MaxMetaLen = wire.MaxMetaLen
	// MaxBatch is the most entries a batch request may carry.
	MaxBatch = wire.MaxBatch
)
