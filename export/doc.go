// Package export owns cudapool's sharing protocol: a producer process shares buffers
// of its IPC-capable pools with consumer processes over a Unix socket, with leases
// that keep a buffer alive while any consumer maps it and stream-ordered events that
// keep every side's GPU work in the right order, without the host waiting.
//
// # Overview
//
// The producer calls Listen to create an Exporter on a socket and Publish to make a
// pool.Buffer available under a name, ready once the work queued on a stream before the
// call (the producer's writes) has completed. A consumer calls Dial to connect an
// Importer, Open to lease a buffer by name and map it into its own process, and
// Mapping.Release to give it back:
//
//	ex, err := export.Listen("/run/app/kv.sock", rt)
//	err = ex.Publish(ctx, "layer-0", buf, stream)
//
//	imp, err := export.Dial(ctx, "/run/app/kv.sock", rt, device)
//	m, err := imp.Open(ctx, "layer-0", stream) // stream waits for the writes
//	... use m.Ptr() on stream ...
//	err = m.Release(ctx, stream) // the import is freed after the work on stream
//
// Open makes the consumer's stream wait on an IPC event that Publish recorded on the
// producer's stream. Release frees the import on the Importer's release stream after
// the caller's stream, records the Importer's release event there and tells the
// exporter, which ends the lease at once: the pool frees or reuses a buffer only after
// every importer's free of it has completed (pool's ordered release), waiting then for
// the latest record of each releasing importer's event, which covers its earlier frees
// (pool.Lease.EndAt), rather than at every Release. Either side first
// asks whether the other process's event has completed already, and then leaves the
// wait out: work that is done needs no ordering, and each wait left out is one less
// dependency between two processes' GPU work. The producer may
// Free a published buffer at any time; its memory goes back to the pool once the last
// consumer released it, and Opens after the Free fail with ErrBufferGone.
//
// Replicas start together: WaitForExporter makes Dial wait for the exporter to listen,
// and WaitForName makes Open wait for the name to be published, each with backoff
// until its context ends. An unknown name's error lists a few names that are published.
// The stream given to Open belongs to the Importer's device (ErrStreamDevice otherwise).
//
// Opening a buffer the Importer already holds returns the same *Mapping, counted once
// more: the driver would return the same pointer, and freeing either import would
// unmap both (FACTS 4). The exporter grants the second Open under the same lease id,
// and only the last Release frees the import and returns every grant of the lease.
//
// # Ranges and metadata
//
// Publish with Range shares part of a buffer (a tensor inside a segment, a KV block
// inside a slab) and WithMeta sends up to MaxMetaLen bytes of the producer's (a dtype
// and shape) to every consumer with its lease (Mapping.Meta). A range has its own name,
// ready event and lease grants, ordered as a whole buffer's are; the consumer's process
// imports the whole buffer once, and each Mapping is a range of that import: Ptr is the
// range's start, Size its length. The import is freed when the last Mapping of any of
// its ranges is released. Ranges need not be aligned to anything; the buffer they lie
// in is rounded to the granularity.
//
// # Glossary
//
// One word names one idea, in the API, the code and the messages:
//
//   - publish: the producer puts a buffer under a name (Exporter.Publish); a buffer is
//     published until Unpublish, or until it is freed.
//   - open: a consumer asks for the buffer under a name (Importer.Open, the Open
//     frame); the exporter answers with a grant.
//   - push: the exporter grants a buffer to a consumer unasked (Exporter.Push,
//     Exporter.PushAll, the Push frame).
//   - lease: a connection's hold on one buffer, named by a lease id that only the
//     exporter can make. A lease lives while the connection has grants of it.
//   - grant: one Open's or one Push's share of a lease, backed by one pool.Lease.
//     Opening a buffer the connection holds adds a grant to its lease;
//     PeerState.Leases counts leases, PeerState.Grants the grants behind them.
//   - release: an importer gives grants back (Mapping.Release, the Release frame);
//     a lease ends with its last grant.
//   - range: the part of a buffer a name is published for (Range), the whole buffer by
//     default; metadata: the bytes published with it (WithMeta).
//   - mapping: a published range imported into the consumer's process (Mapping); the
//     import is of the whole buffer, shared by the Mappings of its ranges.
//   - batch: many opens or releases in one request and one answer (Importer.OpenAll,
//     Importer.ReleaseAll; the OpenBatch, LeaseBatch and ReleaseBatch frames).
//   - retain: a consumer keeps a buffer's import after releasing its last lease on it
//     (WithRetainedImports); revoke: the exporter asks for a retained import back
//     (the Revoke frame), and the consumer frees it (Revoked).
//   - peer: the exporter's side of a connection that takes leases, an Importer's.
//   - observer: a connection for State alone (QueryState's): it takes no leases, is
//     no peer, and is neither listed nor pushed to.
//   - handshake: Hello, answered by Welcome or Refused; the exporter admits a peer or
//     observer by its Policy (admission).
//   - pool handle: a pool's shareable handle, sent once per peer before its first
//     grant; record: a buffer's export data.
//   - ready event: recorded by Publish on the producer's stream, waited on by Open;
//     release event: recorded after each of an importer's frees, waited on by the
//     exporter's free.
//
// Options are typed by what they configure: a ListenOption for Listen, a DialOption
// for Dial and DialConn, a QueryOption for QueryState, an OpenOption for
// Importer.Open; a SharedOption (WithLogger, WithHandshakeTimeout) is a ListenOption,
// a DialOption and a QueryOption. An option given where it does not apply does not
// compile.
//
// # The connection
//
// The socket is created with mode 0600 whatever the umask (SocketFollowsPolicy opens
// it to a Policy's group or users, 0660 or 0666). Each connecting process is
// identified by the kernel (SO_PEERCRED) and admitted by the Exporter's Policy: by
// default only processes of the exporter's own user. A refused process gets the reason
// and nothing else. The handshake carries the protocol version (ProtocolVersion; a
// mismatch is refused with both versions named), the pids, the importer's device UUID
// and the handle types it can import.
//
// Each pool's handle goes to each peer once, its descriptor passed with SCM_RIGHTS;
// every descriptor that arrives where none is expected is closed. Every message is a
// fixed binary layout in a frame of at most 64 KiB; a malformed, oversized or
// unexpected frame closes the connection it came on, with the reason logged, and
// touches no other peer. Lease ids are unguessable, and a Release with a lease id that
// was released already, belongs to another connection or was never issued is refused
// with ErrStaleLease, ErrForeignLease or ErrForgedLease, and changes nothing.
//
// Listen announces the exporter in DefaultDir() (<pid>.json) for tools such as
// cmd/poolstat, which find exporters with Discover and ask for their State with
// QueryState, as observers admitted through the same handshake and policy as any
// consumer.
//
// # Faults
//
// A consumer that dies, even by SIGKILL, closes its socket while its process may still
// be exiting, with work on the GPU. The exporter holds a handle on each consumer's
// process (a pidfd, opened at the handshake) and ends the leases of a connection lost
// without Bye only once that process has exited (a zombie not yet reaped has); then the
// frees that waited for them proceed. Where the process cannot be watched (a peer on a
// byte stream, a kernel without pidfds, a process gone before its handshake ended) the
// leases end when the connection closes, and the log says why.
//
// A producer that dies leaves the mappings of its consumers on its own GPU readable
// (FACTS 7) until they release them, but not those on another GPU: there the driver
// contains the next read and the consumer's whole CUDA context is lost (FACTS 14,
// cudart.ErrContextLost). So the Importer watches the exporter's process (a pidfd
// where it can, else the connection) and tells at once: Done is closed, Err says why,
// and each Mapping on another GPU ends its Context with ErrMappingLost, which its Err
// returns too; stop the work that reads it and release it (Release frees the import
// without touching the memory). WithReplica makes a local copy at Open instead, which
// outlives its producer on any GPU. Opens fail with ErrExporterGone, including one in
// flight as the producer dies: no stream is made to wait on a dead process's event.
// Release and Close succeed, as there is no one left to tell.
//
// What the driver does to a consumer on GPU 1 of a producer on GPU 0 that is
// SIGKILLed (measured on the GPU host, 2026-11-30, TestGPUPeerConsumerOfKilledProducer,
// 2x H200, driver 580.159.04): copies of the mapping into GPU-1 memory on a stream of
// GPU 0, the owner, all succeeded, the last ones after the producer was reaped, and
// read the right bytes; the same copies on a stream of GPU 1 failed with
// cudaErrorContained as the producer died, and every later call of the process failed
// too. A stream waiting on the killed producer's IPC event was released at the kill
// (no hang), and freeing the import of a dead producer from GPU 1 kept the context.
// So a replica is copied through a stream of the exporter's device, never the
// consumer's, and a copy that a producer's death interrupts still completes.
//
// # Retained imports
//
// With WithRetainedImports, a local consumer's Release ends its lease (the producer
// may reuse the memory for new data once the consumer's release event has completed)
// but keeps the import mapped. The exporter holds a pool.Retention for it, so the
// memory never goes back to the driver under the mapping: it may only be recycled to a
// new buffer of the same pool (pool.WithCache), and a lease on that buffer finds the
// mapping in place, so Open costs a message and a stream wait, no import and no
// export. When the pool wants the memory back (a free past its cache, Trim, a full
// pool) or the exporter closes, the exporter revokes: the consumer frees the import
// and says so, and the memory is freed after that free. A consumer that leaves ends
// its retentions like its leases.
//
// No pointer is handed out without a live lease: a retained mapping is reached only
// through Open. A kernel that kept the pointer of a released Mapping and runs later
// reads and writes whatever the producer put in that memory since (another buffer's
// data, or the same buffer's next contents), with no fault and no ordering; after a
// revoke it faults. The pool, not the buffer, is the unit of trust (FACTS 2), and
// retaining changes nothing there.
//
// # FABRIC
//
// Pools with cudart.HandleTypeFabric travel as 64 inline bytes, so the protocol works
// over any byte stream: Exporter.Serve accepts on a TCP listener and DialConn connects
// over one, between the nodes of one NVLink domain where IMEX authorises each import.
// Such peers have no credentials, so the Policy must set AllowRemote; IPC events do not
// cross hosts, so the exporter waits for the producer's writes before it answers an
// Open, and the importer waits for its free before it reports a Release. On a host
// without an IMEX channel, Publish of a FABRIC buffer fails with ErrIMEXRequired.
//
// # Caveats
//
// The pool is the unit of trust. An importer of one buffer can read every buffer of its
// pool, published or not (FACTS 2). Never put data for different trust domains in one
// exported pool; make a pool per domain. A range narrows what a consumer is told, not
// what it can read: the consumer of one range can read the rest of its buffer and of
// its pool. Ranges of one buffer, like buffers of one pool, are for one trust domain.
//
// Release mappings before the process exits. A mapping a live process never releases
// holds its lease, and with it the buffer, until the Importer closes or the process
// exits. Importer.Close frees what is still mapped without ordering the frees after
// your streams: release first.
//
// A consumer whose connection ends without Bye while it lives on (it closed the socket
// without Importer.Close, or the exporter cut it for a protocol violation) keeps its
// leases until its process exits: its imports are still mapped, so that is the only
// safe choice. State shows such a peer as awaiting its exit, and Exporter.Close waits
// for its leases like any others, until its context ends.
//
// Exporter.Close waits for consumers to release until its context ends; leases still
// held then are abandoned, never ended under a living reader: their peers are served
// on (Release and Bye) and each buffer is freed once its consumer released it or
// exited. Close the pools after the Exporter; pool.Close(Force) abandons what is
// still leased.
//
// One process holds one Importer per exporter and runtime: a second Dial fails with
// ErrDuplicateImporter, because two would import the same pointers. Mappings are valid
// on the Importer's device and any device the runtime can reach it from, while the
// exporter lives; after, only on the exporter's device (see Faults).
//
// A consumer on another GPU than its producer's must never read a mapping from its
// own device once the producer is gone, not even to copy it: the read is contained and
// the whole process's CUDA context lost (cudart.ErrContextLost; restart the process).
// Stop at ErrMappingLost, or open with WithReplica, whose copy runs on the exporter's
// device and survives the producer's death (measured on the GPU host, 2026-11-30,
// TestGPUPeerConsumerOfKilledProducer). A replica's allocator must let the exporter's
// device write it (pool.WithPeerAccess).
//
// A Policy that admits other users needs SocketFollowsPolicy too, or they cannot
// open the socket. Names may not hold control characters, bidirectional controls or
// line separators. Exporters cap the
// handshakes in progress (WithHandshakeLimit) and the grants each connection holds
// (WithMaxGrants), and keep accepting through a shortage of descriptors.
//
// An exporter waits for a consumer's free through an event of the consumer's process.
// On the real driver an IPC event of a process that died mid-record may never
// complete; the exporter therefore ends a dead consumer's leases without waiting on
// its event, once the process has exited.
package export
