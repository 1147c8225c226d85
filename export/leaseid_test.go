package export

import "testing"

func TestLeaseIDsRoundTripAndScatter(t *testing.T) {
	k := newLeaseIDs()
	seen := map[uint64]bool{}
	for conn := uint32(1); conn <= 3; conn++ {
		for ctr := uint64(1); ctr <= 1000; ctr++ {
			id := k.seal(conn, ctr)
			if c, n := k.unseal(id); c != conn || n != ctr {
				t.Fatalf("open(seal(%d, %d)) = %d, %d", conn, ctr, c, n)
			}
			if seen[id] {
				t.Fatalf("id %#x issued twice", id)
			}
			seen[id] = true
		}
	}
	// Consecutive counters must not give ids a peer could step through.
	a, b := k.seal(1, 1), k.seal(1, 2)
	if d := a ^ b; d>>32 == 0 || uint32(d) == 0 {
		t.Fatalf("ids of consecutive leases differ in one half only: %#x %#x", a, b)
	}
	if other := newLeaseIDs(); other.seal(1, 1) == a {
		t.Fatalf("two exporters issued the same first id %#x", a)
	}
	if c, n := k.unseal(k.seal(maxConnID, maxCounter)); c != maxConnID || n != maxCounter {
		t.Fatalf("largest pair came back as %d, %d", c, n)
	}
}
