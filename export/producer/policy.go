package producer

import (
	"github.com/cudapool/cudapool/export"
	"github.com/cudapool/cudapool/internal/peercred"
	"github.com/cudapool/cudapool/internal/session"
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
	return session.Admits(p.AllowUIDs, p.AllowGIDs, *cred, "the exporter")
}
