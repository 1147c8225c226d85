// Package session owns what cudapool's two socket protocols (the exporter's on
// producer's socket, and over TCP, and the KV page pool's on dir/kv.sock) share below
// their messages: the [Server] (net/http's, for these protocols) with its accept loop
// that outlasts a moment's exhaustion (EMFILE, ENFILE), the caps on connections in
// their handshake and on admitted connections, the handshake timeout, admission by
// the peer's credentials (SO_PEERCRED; a peer on a byte stream has none), a handler's
// panic contained to its connection; and the client's side: the dial with backoff
// ([Dial], [Retry]), the frame reader ([FrameReader], descriptors included), writes
// each bounded by its caller's context ([Writer]), and the request client ([Client])
// with its watch.
//
// A protocol keeps its messages: a Framing for the FrameReader, a Frames over it and a
// Protocol (which frame answers which request, what to do with the rest) for the
// Client, and a Handler per call.
//
// A protocol is a handler over it: the Server hands each accepted connection, its
// peer named, to the handler on a goroutine of its own; the handler reads the Hello in
// its own framing, applies [Conn.Admits] and calls [Conn.Admit], which ends the
// handshake or says which cap is full.
package session
