// Package peercred owns the identification of the process at the other end of a Unix
// socket: its pid, uid and gid as the kernel recorded them when it connected, which no
// peer can forge (SO_PEERCRED on Linux).
package peercred

import "errors"

// Cred is what the kernel knows of a connected peer.
type Cred struct {
	PID int
	UID uint32
	GID uint32
}

// ErrUnsupported means this operating system offers no peer credentials that cudapool
// reads; no peer can be identified, so none should be admitted.
var ErrUnsupported = errors.New("peercred: peer credentials are not supported on this system")
