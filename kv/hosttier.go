package kv

// HostSocket is the socket, in an owner's directory, that hands each replica the memfd
// of its device's host tier: a replica connects, sends its device ordinal as 4 bytes
// (little-endian), and reads one [HostTierInfo] as JSON, carrying the memfd (SCM_RIGHTS)
// unless Error is set; the owner then closes the connection. An owner without host
// tiers has no such socket.
const HostSocket = "host.sock"

// HostTierInfo describes a device's host tier: a memfd of Bytes (sealed against
// shrinking and growing) holding Pages host pages of PageBytes, page p at p*PageBytes,
// each every layer's K then V piece of [Geometry.PageBytes], layer by layer.
type HostTierInfo struct {
	Device    int    `json:"device"`
	Bytes     uint64 `json:"bytes"`
	Pages     int    `json:"pages"`
	PageBytes uint64 `json:"page_bytes"`
	// Error says why the owner hands no memfd: the device has no tier, or the process
	// is not admitted.
	Error string `json:"error,omitempty"`
}
