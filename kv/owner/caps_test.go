package owner_test

import (
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/cudapool/cudapool/cudart"
	"github.com/cudapool/cudapool/cudart/cudarttest"
	"github.com/cudapool/cudapool/kv"
	"github.com/cudapool/cudapool/kv/internal/kvwire"
	"github.com/cudapool/cudapool/kv/owner"
)

// ipcEvents makes n distinct IPC event handles on a software device of their own, as
// another process's.
func ipcEvents(t *testing.T, n int) [][kvwire.EventLen]byte {
	dev := cudarttest.ForTest(t)
	hs := make([][kvwire.EventLen]byte, n)
	for i := range hs {
		ev, err := dev.EventCreate(0, cudart.EventInterprocess|cudart.EventDisableTiming)
		require.NoError(t, err)
		t.Cleanup(func() { dev.EventDestroy(0, ev) })
		h, err := dev.IpcGetEventHandle(0, ev)
		require.NoError(t, err)
		hs[i] = h
	}
	return hs
}

// The event handles one connection sends are capped (WithMaxEvents), and a
// release or seal refused for its lease opens none: refused releases under 10
// handles leave room for the 4 of the cap.
func TestEventHandlesAreCappedAndOpenedAfterTheLeaseCheck(t *testing.T) {
	_, dir := listenWith(t, owner.WithMaxEvents(4))
	r := dialRaw(t, dir)
	r.hello()
	evs := ipcEvents(t, 15)
	for i := range 10 {
		r.send(kvwire.AppendRelease(nil, 3, &evs[i], []uint64{999}))
		r.refused(3, kv.ErrStaleLease, "a release of a lease never issued")
		r.send(kvwire.AppendSeal(nil, 3, false, 999, &evs[i], nil))
		r.refused(3, kv.ErrStaleLease, "a seal of a lease never issued")
	}
	for i := 10; i < 14; i++ {
		l := r.alloc(4, 1)
		r.send(kvwire.AppendRelease(nil, 5, &evs[i], []uint64{l}))
		h, p, err := r.next()
		require.NoError(t, err)
		require.Equal(t, kvwire.TypeReleased, h.Type, "handle %d of the cap: %v", i-9, kvwire.ParseError(h.Type, p))
	}
	l := r.alloc(4, 1)
	r.send(kvwire.AppendRelease(nil, 6, &evs[14], []uint64{l}))
	err := r.refused(6, kv.ErrLimit, "a fifth handle")
	assert.ErrorContains(t, err, "MaxEvents")
	r.send(kvwire.AppendRelease(nil, 7, &evs[10], []uint64{l}))
	h, _, err := r.next()
	require.NoError(t, err)
	assert.Equal(t, kvwire.TypeReleased, h.Type, "a handle sent before is used again")
}

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
	var none [kvwire.EventLen]byte
	r.send(kvwire.AppendRelease(nil, 6, &none, []uint64{a}))
	h, _, err := r.next()
	require.NoError(t, err)
	require.Equal(t, kvwire.TypeReleased, h.Type)
	r.alloc(7, 1)
}

// A page's reader count cannot wrap: Listen refuses caps whose product (leases a
// connection may hold × connections) reaches 2^32.
func TestListenRefusesCapsThatCouldWrapAReaderCount(t *testing.T) {
	dev := cudarttest.ForTest(t)
	_, err := owner.Listen(t.TempDir(), dev, small, owner.WithoutAnnounce(), owner.WithMaxLeases(1<<20), owner.WithConnLimit(1<<12, 0))
	require.Error(t, err)
	assert.ErrorContains(t, err, "could wrap")
}
