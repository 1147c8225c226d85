package pool

import (
	"fmt"

	"github.com/cudapool/cudapool/cudart"
	"github.com/cudapool/cudapool/internal/poolshare"
)

// The sharing protocol reaches leases, completions and retentions through package
// poolshare, so that they are not part of this package's API.
func init() {
	poolshare.Take = func(buf any) (poolshare.Lease, error) {
		b, ok := buf.(*Buffer)
		if !ok {
			return nil, fmt.Errorf("pool: lease a %T, not a *Buffer: %w", buf, ErrInvalidOption)
		}
		return b.takeLease()
	}
	poolshare.Retain = func(buf any, revoke func()) (poolshare.Retention, error) {
		b, ok := buf.(*Buffer)
		if !ok {
			return nil, fmt.Errorf("pool: retain a %T, not a *Buffer: %w", buf, ErrInvalidOption)
		}
		return b.retain(revoke)
	}
	poolshare.NewCompletion = func(pl any, ev cudart.Event, gone func() bool) poolshare.Completion {
		p, ok := pl.(*Pool)
		if !ok {
			return nil
		}
		return p.newCompletion(ev, gone)
	}
}
