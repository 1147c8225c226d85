package session

import (
	"fmt"
	"os"
	"slices"

	"github.com/cudapool/cudapool/internal/peercred"
)

// Admits says why the uids and gids listed do not admit cred, or "" if they do: with
// both lists empty, only this process's own uid is admitted; otherwise exactly the
// processes whose uid is in uids or whose gid (primary group) is in gids. who names
// the server in the reason ("the owner", "the exporter").
func Admits(uids, gids []uint32, cred peercred.Cred, who string) string {
	if len(uids) == 0 && len(gids) == 0 {
		if own := uint32(os.Getuid()); cred.UID != own {
			return fmt.Sprintf("uid %d is not allowed: %s admits only its own uid %d", cred.UID, who, own)
		}
		return ""
	}
	if slices.Contains(uids, cred.UID) || slices.Contains(gids, cred.GID) {
		return ""
	}
	return fmt.Sprintf("uid %d gid %d is not allowed: %s admits uids %v and gids %v", cred.UID, cred.GID, who, uids, gids)
}

// OpensToOthers says whether uids and gids admit anyone but this user.
func OpensToOthers(uids, gids []uint32) bool {
	own := uint32(os.Getuid())
	return len(gids) > 0 || slices.ContainsFunc(uids, func(u uint32) bool { return u != own })
}
