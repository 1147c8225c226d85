// Package peercred owns the identification of the process at the other end of a Unix
// socket: its pid, uid and gid as the kernel recorded them when it connected, which no
// peer can forge (SO_PEERCRED on Linux), and a handle on that process that tells when
// it has exited, bound to the process rather than to its pid (a pidfd on Linux).
package peercred

// Cred is what the kernel knows of a connected peer.
type Cred struct {
	PID int
	UID uint32
	GID uint32
}
