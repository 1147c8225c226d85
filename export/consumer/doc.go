// Package consumer owns the importing side of cudapool's sharing protocol: an [Importer]
// connects to an exporter (package producer), leases the buffers it publishes by name
// and maps them into this process as Mappings on its device, with the producer's writes
// ordered before the consumer's stream and the consumer's frees before the producer's.
// The frames are in docs/PROTOCOL.md, the words in docs/GLOSSARY.md.
//
// # Overview
//
//	imp, err := consumer.Dial(ctx, "/run/app/kv.sock", rt, device, consumer.WaitForExporter())
//	m, err := imp.Open(ctx, "layer-0", stream, consumer.WaitForName()) // stream waits for the writes
//	... use m.Ptr() on stream ...
//	err = m.Release(ctx, stream) // the import is freed after the work on stream
//	err = imp.Close(ctx)
//
// Open makes the stream wait on the producer's ready event; the host does not wait.
// Release frees the import on the Importer's release stream after the caller's stream
// and tells the exporter. Opening a buffer the Importer already holds returns the same
// *Mapping, counted once more (two imports of one record would alias, FACTS 4); ranges
// of one buffer share one import of it. OpenAll and ReleaseAll carry up to [export.MaxBatch]
// leases in one request and one answer. [WithPushes] accepts buffers the exporter pushes.
//
// A name may be a VMM allocation (producer.Exporter.PublishChunks, the vmm route) rather
// than a pool buffer: Open then maps its chunks in order into one range of this
// process's addresses (package vmm), and returns the same [Mapping], so that code using
// it does not care which route the memory came by. Mappings of ranges of one allocation
// share its range. The chunks' descriptors come once per connection, and the imports
// are kept while the allocation is published, as a pool's import is kept: a reopen
// maps them again at once. The last Release of an allocation unmaps it, once the work
// queued on its streams has run (the host waits for that: the driver must not unmap
// memory in use); once it is unpublished (or its exporter is gone) the imports are
// closed, so nothing here holds the producer's memory that no lease maps. Such a
// Mapping outlives its exporter on any GPU: its import holds the memory (FACTS 26).
//
// The Importer watches the exporter's process (a pidfd where it can, else the
// connection). When it is gone, Done is closed, Err says why, and Opens fail with
// [export.ErrExporterGone]. Mappings on the exporter's own GPU stay readable until released
// (FACTS 7); on another GPU the next read would lose this process's CUDA context
// (FACTS 14), so each such [Mapping]'s Context ends with [ErrMappingLost] at once. Release
// them: that is safe. [WithLocalCopy] copies the buffer at Open into this process's own
// memory, through a stream of the exporter's device (FACTS 14), and releases the lease:
// the copy outlives its producer on any GPU.
//
// # Caveats
//
// Release mappings before the process exits or the Importer closes: Close frees (and
// unmaps) what is still mapped without ordering that after your streams.
//
// One process holds one Importer per exporter and runtime: a second [Dial] fails with
// [ErrDuplicateImporter], because two would import the same pointers. A stream given to
// Open belongs to the Importer's device ([ErrStreamDevice]).
//
// A consumer on another GPU than its producer's must never read a mapping from its own
// device once the producer is gone, not even to copy it ([cudart.ErrContextLost]; restart
// the process). Stop at ErrMappingLost, or open with WithLocalCopy, whose allocator must
// let the exporter's device write it ([pool.WithPeerAccess]).
//
// The pool is the unit of trust: a Mapping exposes its whole pool to this process, not
// only its range (FACTS 2). A pointer used after its Release reads whatever the producer
// put there since.
package consumer
