package owner_test

import (
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/cudapool/cudapool/cudart/cudarttest"
	"github.com/cudapool/cudapool/kv"
	"github.com/cudapool/cudapool/kv/internal/kvwire"
	"github.com/cudapool/cudapool/kv/owner"
)

// The leases of one connection are capped (WithMaxLeases), and their pages
// (WithMaxLeasedPages): past a cap an Alloc or Match is refused with kv.ErrLimit
// naming it, and a release makes room again.
func TestLeasesPerConnectionAreCapped(t *testing.T) {
	_, dir := listenWith(t, owner.WithMaxLeases(3), owner.WithMaxLeasedPages(5))
	r := dialRaw(t, dir)
	r.hello()
	a := r.alloc(2, 2)
	r.alloc(2, 2)
	r.send(kvwire.AppendU32(nil, kvwire.TypeAlloc, 3, 2))
	assert.ErrorContains(t, r.refused(3, kv.ErrLimit, "6 pages of a cap of 5"), "MaxLeasedPages")
	r.alloc(4, 1)
	r.send(kvwire.AppendU32(nil, kvwire.TypeAlloc, 5, 1))
	assert.ErrorContains(t, r.refused(5, kv.ErrLimit, "a fourth lease"), "MaxLeases")
	r.send(kvwire.AppendRelease(nil, 6, kvwire.Now, []uint64{a}))
	h, _, err := r.next()
	require.NoError(t, err)
	require.Equal(t, kvwire.TypeReleased, h.Type)
	r.alloc(7, 1)
}

// A page's reader count cannot wrap: Listen refuses caps whose product (leases a
// connection may hold × connections) reaches 2^32.
func TestListenRefusesCapsThatCouldWrapAReaderCount(t *testing.T) {
	dev := cudarttest.ForTest(t)
	_, err := owner.Listen(t.TempDir(), dev, small, owner.WithMaxLeases(1<<20), owner.WithConnLimit(1<<12, 0))
	require.Error(t, err)
	assert.ErrorContains(t, err, "could wrap")
}
