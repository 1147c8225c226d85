package consumer

import (
	"github.com/cudapool/cudapool/cudart"
	"github.com/cudapool/cudapool/export/internal/wire"
)

// What the tests (package consumer_test) see inside an Importer.

// Client is the Importer's connection to its exporter.
func Client(imp *Importer) *wire.Client { return imp.cl }

// ReleaseStream is the stream the Importer frees imports on.
func ReleaseStream(imp *Importer) cudart.Stream { return imp.relStream }

// DeviceUUID is the UUID of the Importer's device.
func DeviceUUID(imp *Importer) cudart.UUID { return imp.devUUID }

// FreesPending counts the imports freed since the release event last completed.
func FreesPending(imp *Importer) int {
	imp.mapMu.Lock()
	defer imp.mapMu.Unlock()
	return len(imp.freed)
}

// Imports counts the buffers the Importer has imported.
func Imports(imp *Importer) int {
	imp.mapMu.Lock()
	defer imp.mapMu.Unlock()
	return len(imp.imports)
}

// OrderEvents counts the events kept to order releases after callers' streams.
func OrderEvents(imp *Importer) int {
	imp.mapMu.Lock()
	defer imp.mapMu.Unlock()
	return len(imp.orderEvents)
}

// RevokedMapped counts the imports revoked while mapped, freed at their release.
func RevokedMapped(imp *Importer) int {
	imp.mapMu.Lock()
	defer imp.mapMu.Unlock()
	n := 0
	for _, buf := range imp.imports {
		if buf.revoked && buf.views > 0 {
			n++
		}
	}
	return n
}

// MaxIdleOrderEvents is the bound OrderEvents keeps to once idle events are reaped.
const MaxIdleOrderEvents = maxIdleOrderEvents

// ReplicaPool is the pool the first local copy copier of the Importer allocates from.
func LocalCopyPool(imp *Importer) cudart.MemPool {
	imp.localCopies.mu.Lock()
	defer imp.localCopies.mu.Unlock()
	for _, c := range imp.localCopies.copiers {
		return c.pool.Handle()
	}
	return 0
}

// KeptAllocs counts the VMM allocations whose chunks the Importer keeps.
func KeptAllocs(imp *Importer) int {
	imp.mu.Lock()
	defer imp.mu.Unlock()
	return len(imp.kept)
}
