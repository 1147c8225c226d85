package kv

// HostSocket is the socket, in an owner's directory, that hands each replica the memfd
// of its device's host tier: one exchange a connection, in frames of the KV page
// protocol's layout with a version (docs/PROTOCOL.md, "The host tier socket"). An owner
// without host tiers has no such socket.
const HostSocket = "host.sock"
