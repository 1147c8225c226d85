package exporttest

import (
	"fmt"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/cudapool/cudapool/cudart"
	"github.com/cudapool/cudapool/export/internal/wire"
	"github.com/cudapool/cudapool/export/producer"
	"github.com/cudapool/cudapool/pool"
)

// Slab publishes n blocks of a buffer, block i filled with byte(i+1) and published
// as "block-i" with meta bytes of metadata.
func (rp RetainingPair) Slab(t *testing.T, n int, block uint64, meta int) (*pool.Buffer, []string) {
	t.Helper()
	ctx := Ctx(t)
	pr := rp.Pr
	b, err := pr.Pool.Alloc(ctx, uint64(n)*block, pr.Stream)
	require.NoError(t, err)
	names := make([]string, n)
	for i := range names {
		names[i] = fmt.Sprintf("block-%d", i)
		require.NoError(t, pr.Dev.MemsetAsync(pr.Ord, b.Ptr()+cudart.DevicePtr(uint64(i)*block), byte(i+1), block, pr.Stream))
	}
	for i, name := range names {
		var opts []producer.PublishOption
		if meta > 0 {
			opts = append(opts, producer.WithMeta(make([]byte, meta)))
		}
		require.NoError(t, pr.Ex.Publish(ctx, name, b, pr.Stream, append(opts, producer.Range(uint64(i)*block, block))...))
	}
	return b, names
}

// ServesOn checks that the connection still serves: "a" is leased (request reqID)
// and released (reqID+1).
func (r *RawPeer) ServesOn(reqID uint64) {
	r.T.Helper()
	l, ok := r.Open(reqID, "a").(*wire.LeaseMsg)
	require.True(r.T, ok, "the connection did not serve an Open")
	_, ok = r.Release(reqID+1, l.LeaseID, 1).(*wire.ReleasedMsg)
	require.True(r.T, ok, "the connection did not serve a Release")
}
