// Package inspect lets the module's tests look inside a consumer.Importer, as gRPC-Go's
// internal package does: package consumer sets these at init, and nothing else in a
// program uses them.
package inspect

import (
	"github.com/cudapool/cudapool/cudart"
	"github.com/cudapool/cudapool/export/internal/wire"
)

// The Importer's insides, each taking a *consumer.Importer.
var (
	// Client is the Importer's connection to its exporter.
	Client func(imp any) *wire.Client
	// ReleaseStream is the stream the Importer frees imports on.
	ReleaseStream func(imp any) cudart.Stream
	// DeviceUUID is the UUID of the Importer's device.
	DeviceUUID func(imp any) cudart.UUID
	// FreesPending counts the imports freed since the release event last completed.
	FreesPending func(imp any) int
	// Imports counts the buffers the Importer has imported.
	Imports func(imp any) int
	// OrderEvents counts the events kept to order releases after callers' streams.
	OrderEvents func(imp any) int
	// RevokedMapped counts the imports revoked while mapped, freed at their release.
	RevokedMapped func(imp any) int
	// MaxIdleOrderEvents is the bound OrderEvents keeps to once idle events are reaped.
	MaxIdleOrderEvents int
	// ReplicaPool is the pool the first replica copier of the Importer allocates from.
	ReplicaPool func(imp any) cudart.MemPool
)
