package owner

import (
	"fmt"
	"os"
	"slices"

	"github.com/cudapool/cudapool/export/producer"
	"github.com/cudapool/cudapool/internal/peercred"
)

// admits says why p does not admit cred, or "" if it does, by producer.Policy's rule:
// the zero Policy admits this user's processes, any other exactly the uids and gids it
// lists. The page socket is a Unix socket, so every peer has credentials.
func admits(p producer.Policy, cred peercred.Cred) string {
	if len(p.AllowUIDs) == 0 && len(p.AllowGIDs) == 0 {
		if own := uint32(os.Getuid()); cred.UID != own {
			return fmt.Sprintf("uid %d is not allowed: the owner admits only its own uid %d", cred.UID, own)
		}
		return ""
	}
	if slices.Contains(p.AllowUIDs, cred.UID) || slices.Contains(p.AllowGIDs, cred.GID) {
		return ""
	}
	return fmt.Sprintf("uid %d gid %d is not allowed: the owner admits uids %v and gids %v", cred.UID, cred.GID, p.AllowUIDs, p.AllowGIDs)
}
