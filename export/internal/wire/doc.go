// Package wire owns what both sides of cudapool's sharing protocol speak: the frames
// and their encoding (docs/PROTOCOL.md), a connection that sends and receives them with
// descriptors, the handshake, the client that matches requests with their replies
// (with its idle watch), and the error codes that carry the protocol's errors across,
// with the sentinels they stand for. Packages producer, consumer and discover build on
// it; nothing here is for users.
package wire
