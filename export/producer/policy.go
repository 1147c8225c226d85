package producer

import (
	"fmt"
	"os"
	"slices"

	"github.com/cudapool/cudapool/export"
	"github.com/cudapool/cudapool/internal/peercred"
)

// admit says why p does not let cred connect, or "" if it does. cred is nil for a peer on a
// byte stream.
func admit(p export.Policy, cred *peercred.Cred) string {
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
