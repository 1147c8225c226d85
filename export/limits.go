package export

// ProtocolVersion is the version of the sharing protocol that packages producer,
// consumer and discover speak. Both sides must speak the same one. Version 2 leases a
// range of a buffer and carries the publish's metadata with each lease, and adds
// retained imports: Welcome's flags, Release's retain flag, Revoke and Revoked. Version
// 3 carries VMM allocations: ChunkHandle and the Lease flag vmm.
const ProtocolVersion = 3

// The protocol's limits.
const (
	// MaxNameLen is the longest name a buffer can be published under, in bytes.
	MaxNameLen = 255
	// MaxMetaLen is the most metadata a publish can carry (producer.WithMeta), and so
	// a Mapping (consumer.Mapping.Meta), in bytes.
	MaxMetaLen = 4096
	// MaxBatch is the most names an OpenBatch (consumer.Importer.OpenAll) and the most
	// leases a ReleaseBatch (ReleaseAll) may carry.
	MaxBatch = 1024
	// MaxChunks is the most chunks one published VMM allocation may have
	// (producer.Exporter.PublishChunks): 8 TiB in chunks of 2 GiB.
	MaxChunks = 4096
)
