// Package producer owns the exporting side of cudapool's sharing protocol: an [Exporter]
// shares buffers of its IPC-capable pools with consumer processes (package consumer)
// over a Unix socket, with leases that keep a buffer alive while any consumer maps it
// and stream-ordered events that keep every side's GPU work in order, without the host
// waiting. The frames are in docs/PROTOCOL.md, the words in docs/GLOSSARY.md.
//
// # Overview
//
// [Listen] creates an Exporter on a socket; Publish makes a [pool.Buffer] available under a
// name, ready once the work queued on a stream before the call (the producer's writes)
// has completed:
//
//	ex, err := producer.Listen("/run/app/kv.sock", rt)
//	err = ex.Publish(ctx, "layer-0", buf, stream)
//	...
//	err = buf.Free(stream) // later Opens fail; the memory returns once consumers released it
//	err = ex.Close(ctx)
//
// A consumer's Open makes its stream wait on an IPC event that Publish recorded; its
// Release tells the exporter, which ends the lease at once, and the pool frees or
// reuses a buffer only after every importer's free of it has completed. Either side
// first asks whether the other's event has completed, and then leaves the wait out.
// [Range] publishes part of a buffer and [WithMeta] sends bytes (a dtype and shape) with
// each lease; PublishAll publishes many entries with one ready event; Push and PushAll
// lease a buffer to a process unasked.
//
// [Exporter.PublishChunks] publishes a VMM allocation instead (package vmm: chunks made
// with cuMemCreate, of any size), which a consumer maps as one range
// ([Exporter.PublishChunksAll]: ranges of it under several names); the leases,
// ordering and liveness are those of a pool buffer, and the consumer's Mapping the same.
// The chunks' descriptors travel once per peer (SCM_RIGHTS), or their FABRIC handles
// to a peer on a byte stream.
//
// Each connecting process is identified by the kernel (SO_PEERCRED) and admitted by
// the Exporter's Policy: by default only processes of the exporter's own user. The
// socket is created 0600 ([SocketFollowsPolicy] opens it to the policy's group or users).
// Each pool's handle goes to each peer once, its descriptor passed with SCM_RIGHTS. A
// malformed, oversized or unexpected frame closes the connection it came on, with the
// reason logged, and touches no other peer. Lease ids are unguessable: a Release of a
// lease that ended, belongs to another connection or was never issued is refused
// ([export.ErrStaleLease], its message saying which) and changes nothing. Listen announces
// the exporter for package discover (cmd/poolstat), whose observers are admitted by
// the same policy.
//
// A consumer that dies, even by SIGKILL, may still have work on the GPU: the exporter
// holds a pidfd on each consumer's process and ends the leases of a connection lost
// without Bye only once that process has exited. Where the process cannot be watched (a
// peer on a byte stream, a kernel without pidfds) the leases end when the connection
// closes, and the log says why.
//
// With [WithRetainedImports] a local consumer's Release ends its lease but keeps the
// import mapped, so that a buffer recycled through its pool's cache ([pool.WithCache]) is
// leased again for a message and a stream wait; the exporter revokes such imports (the
// consumer frees them) before their memory goes back to the driver.
//
// FABRIC pools travel as 64 inline bytes, so Serve accepts on any byte stream (TCP
// between the nodes of one NVLink domain, IMEX authorising each import); the Policy
// must set AllowRemote, and Publish on a host without an IMEX channel fails with
// [export.ErrIMEXRequired].
//
// # Caveats
//
// The pool is the unit of trust: an importer of one buffer can read every buffer of
// its pool, published or not (FACTS 2), and the consumer of a range the rest of its
// buffer. Make a pool per trust domain.
//
// A consumer whose connection ends without Bye while it lives on keeps its leases
// until its process exits: its imports may still be mapped. State shows such a peer as
// awaiting its exit.
//
// Close waits for consumers to release until its context ends; leases still held then
// are abandoned ([ErrAbandoned]), never ended under a living reader, and each buffer is
// freed once its consumer released it or exited. Close the pools after the Exporter.
//
// A pointer a consumer kept past its Release of a retained import reads whatever the
// producer put in that memory since, with no fault and no ordering.
//
// A Policy that admits other users needs SocketFollowsPolicy too, or they cannot open
// the socket. Names may not hold control characters, bidirectional controls or line
// separators. [WithHandshakeLimit], [WithConnLimit] and [WithMaxGrants] bound what one
// user, process or connection can hold. The exporter's socket, and each listener of
// [Exporter.Serve], are served by internal/session's server, as kv.sock is: one accept
// loop, one set of caps, one handshake timeout, one admission by credentials, and a
// panic while serving a connection contained to it.
package producer
