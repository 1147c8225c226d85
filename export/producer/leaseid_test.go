package producer

import (
	"testing"

	"github.com/stretchr/testify/require"
)

func TestLeaseIDsRoundTripAndScatter(t *testing.T) {
	k := newLeaseIDs()
	seen := map[uint64]bool{}
	for conn := uint32(1); conn <= 3; conn++ {
		for ctr := uint64(1); ctr <= 1000; ctr++ {
			id := k.seal(conn, ctr)
			c, n := k.unseal(id)
			require.EqualValues(t, conn, c, "open(seal(%d, %d)) = %d, %d", conn, ctr, c, n)
			require.EqualValues(t, ctr, n, "open(seal(%d, %d)) = %d, %d", conn, ctr, c, n)
			require.False(t, seen[id], "id %#x issued twice", id)
			seen[id] = true
		}
	}
	// Consecutive counters must not give ids a peer could step through.
	a, b := k.seal(1, 1), k.seal(1, 2)
	d := a ^ b
	require.False(t, d>>32 == 0 || uint32(d) == 0, "ids of consecutive leases differ in one half only: %#x %#x", a, b)
	other := newLeaseIDs()
	require.NotEqual(t, a, other.seal(1, 1), "two exporters issued the same first id %#x", a)
	c, n := k.unseal(k.seal(maxConnID, maxCounter))
	require.EqualValues(t, maxConnID, c, "largest pair came back as %d, %d", c, n)
	require.EqualValues(t, maxCounter, n, "largest pair came back as %d, %d", c, n)
}
