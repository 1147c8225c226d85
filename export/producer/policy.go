package producer

import (
	"fmt"
	"os"
	"slices"

	"github.com/cudapool/cudapool/internal/peercred"
)

// Policy says which local processes an Exporter admits, by the uid and gid the kernel
// recorded for the connecting process (SO_PEERCRED; the gid is the primary group only,
// supplementary groups are not seen).
//
// The zero Policy admits processes of the exporter's own uid. A Policy with any list
// set admits exactly the processes whose uid is in AllowUIDs or whose gid is in
// AllowGIDs; list your own uid if you also want it.
type Policy struct {
	AllowUIDs []uint32
	AllowGIDs []uint32
	// AllowRemote admits peers on byte-stream connections (TCP between the nodes of
	// one NVLink domain) that carry no credentials at all. Only FABRIC pools are shared
	// with them, and the fabric's IMEX channel authorises each import; without
	// AllowRemote such peers are refused.
	AllowRemote bool
}

// admit says why cred may not connect, or "" if it may. cred is nil for a peer on a
// byte stream.
func (p Policy) admit(cred *peercred.Cred) string {
	if cred == nil {
		if p.AllowRemote {
			return ""
		}
		return "peers without credentials (not on a Unix socket) are not allowed: the exporter's policy does not set AllowRemote"
	}
	if len(p.AllowUIDs) == 0 && len(p.AllowGIDs) == 0 {
		own := uint32(os.Getuid())
		if cred.UID == own {
			return ""
		}
		return fmt.Sprintf("uid %d is not allowed: the exporter admits only its own uid %d", cred.UID, own)
	}
	if slices.Contains(p.AllowUIDs, cred.UID) || slices.Contains(p.AllowGIDs, cred.GID) {
		return ""
	}
	return fmt.Sprintf("uid %d gid %d is not allowed: the exporter admits uids %v and gids %v", cred.UID, cred.GID, p.AllowUIDs, p.AllowGIDs)
}
