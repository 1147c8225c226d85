package owner_test

import (
	"encoding/binary"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/cudapool/cudapool/cudart/cudarttest"
	"github.com/cudapool/cudapool/internal/testwait"
	"github.com/cudapool/cudapool/kv"
	"github.com/cudapool/cudapool/kv/internal/kvwire"
	"github.com/cudapool/cudapool/kv/owner"
	"github.com/cudapool/cudapool/kv/replica"
)

// reattach sends m and returns the owner's status and reason.
func (r *raw) reattach(id uint32, m kvwire.Reattach) (uint32, string) {
	r.send(kvwire.AppendReattach(nil, id, m))
	h, p, err := r.next()
	require.NoError(r.t, err)
	require.Equal(r.t, kvwire.TypeReattached, h.Type)
	require.Equal(r.t, id, h.ID)
	pr := kvwire.NewParser(h.Type, p)
	status, why := pr.U32(), pr.Text()
	require.NoError(r.t, pr.Done())
	return status, why
}

// A Reattach names a lease the owner does not hold as it was: each is refused (lost),
// saying why, and takes nothing; a malformed one closes the connection. A write lease
// is taken back only if the owner before granted it to this process (the index says
// so); a read lease only from a process the owner before served.
func TestReattachRefusesWhatIsNotAsItWas(t *testing.T) {
	k := keep(t)
	stranger := dialRaw(t, k.dir) // a first start: no process was served before
	stranger.hello()
	status, why := stranger.reattach(1, kvwire.Reattach{Lease: 1 << 30, Pages: []uint32{9}, Hashes: []kv.Hash{{7}}})
	assert.Equal(t, kvwire.ReattachLost, status)
	assert.Contains(t, why, "is not a process the owner before this one served")
	k.restart() // now this process was served before
	back := dialRaw(t, k.dir)
	back.hello()
	status, _ = back.reattach(1, kvwire.Reattach{}) // the list of the connection of before: the window ends
	require.Equal(t, kvwire.ReattachKept, status)
	dev := cudarttest.ForTest(t)
	other, err := replica.Dial(bound(t), k.dir, dev, 0)
	require.NoError(t, err)
	t.Cleanup(func() { other.Close(bound(t)) })
	held, err := other.Alloc(bound(t), 2)
	require.NoError(t, err)
	w, err := other.Alloc(bound(t), 1)
	require.NoError(t, err)
	_, err = other.Seal(bound(t), w, []kv.Hash{{7}}, 0, replica.WaitVisible())
	require.NoError(t, err)
	visible := w.Pages()[0]

	r := dialRaw(t, k.dir)
	r.hello()
	for i, c := range []struct {
		m   kvwire.Reattach
		why string
	}{
		{kvwire.Reattach{Lease: held.ID(), Write: true, Pages: held.Pages()}, "is held already"},
		{kvwire.Reattach{Lease: 1 << 50, Write: true, Pages: []uint32{9}}, "was not issued before this owner"},
		{kvwire.Reattach{Lease: 1 << 30, Write: true}, "0 pages"},
		{kvwire.Reattach{Lease: 1 << 30, Pages: []uint32{9}}, "1 pages and 0 hashes"},
		{kvwire.Reattach{Lease: 1 << 30, Write: true, Pages: []uint32{9}}, "no write lease granted before the restart"},
		{kvwire.Reattach{Lease: 1 << 30, Write: true, Pages: []uint32{held.Pages()[0]}}, "no write lease granted before the restart"},
		{kvwire.Reattach{Lease: 1 << 30, Pages: []uint32{64}, Hashes: []kv.Hash{{7}}}, "page 64 of 64"},
		{kvwire.Reattach{Lease: 1 << 30, Pages: []uint32{visible, visible}, Hashes: []kv.Hash{{7}, {7}}}, "is listed twice"},
		{kvwire.Reattach{Lease: 1 << 30, Pages: []uint32{visible}, Hashes: []kv.Hash{{8}}}, "no longer visible under its hash"},
		{kvwire.Reattach{Lease: 1 << 30, Pages: []uint32{9}, Hashes: []kv.Hash{{7}}}, "no longer visible under its hash"},
	} {
		status, why := r.reattach(uint32(i+1), c.m)
		assert.Equal(t, kvwire.ReattachLost, status, "%+v", c.m)
		assert.Contains(t, why, c.why, "%+v", c.m)
	}
	status, _ = r.reattach(99, kvwire.Reattach{})
	assert.Equal(t, kvwire.ReattachKept, status, "the end of the list")
	st, err := other.Stats(bound(t))
	require.NoError(t, err)
	assert.Equal(t, 1, st.Devices[0].Sealed)
	assert.Equal(t, 2, st.Devices[0].Writing, "nothing was taken")
	assert.Zero(t, st.Devices[0].Leased, "nothing was taken")

	b, _ := kvwire.AppendReattach(nil, 5, kvwire.Reattach{Lease: 1 << 30, Write: true, Pages: []uint32{9}})
	binary.LittleEndian.PutUint32(b[kvwire.HeaderLen+8:], 2) // write flag 2
	r.send(b, nil)
	r.closed("a Reattach with write flag 2")
}

// A lease re-declared joins its connection's leases: within the connection's caps
// (WithMaxLeases), and ended with it. (Before, it was never the connection's: no cap
// held it, and a replica that reconnected and then died left its pages leased for
// the owner's life.)
func TestReattachedLeasesAreTheConnections(t *testing.T) {
	k := keep(t, owner.WithMaxLeases(1))
	var ids []uint64
	var pages [][]uint32
	for range 2 {
		w := dialRaw(t, k.dir)
		w.hello()
		id, ps := w.allocPages(2, 4)
		ids, pages = append(ids, id), append(pages, ps)
	}
	k.restart()
	r := dialRaw(t, k.dir)
	r.hello()
	status, why := r.reattach(2, kvwire.Reattach{Lease: ids[0], Write: true, Pages: pages[0]})
	require.Equal(t, kvwire.ReattachKept, status, why)
	status, why = r.reattach(3, kvwire.Reattach{Lease: ids[1], Write: true, Pages: pages[1]})
	assert.Equal(t, kvwire.ReattachLost, status, "a lease past the connection's cap")
	assert.Contains(t, why, "WithMaxLeases")
	status, _ = r.reattach(4, kvwire.Reattach{})
	require.Equal(t, kvwire.ReattachKept, status)
	other := dialRaw(t, k.dir) // this process's other connection of before ends its list too
	other.hello()
	status, _ = other.reattach(2, kvwire.Reattach{})
	require.Equal(t, kvwire.ReattachKept, status)
	st := k.o.Stats()
	require.Len(t, st.Replicas, 2)
	assert.Equal(t, 1, st.Replicas[0].Leases+st.Replicas[1].Leases, "the lease re-declared is the connection's")
	assert.Equal(t, 4, st.Replicas[0].Pages+st.Replicas[1].Pages)
	assert.Equal(t, small.Pages-4, st.Devices[0].Free, "the lease not re-declared is free once every connection of its process ended its list")
	r.send(kvwire.AppendEmpty(nil, kvwire.TypeBye, 5))
	r.closed("after Bye")
	require.Eventually(t, func() bool { return k.o.Stats().Devices[0].Free == small.Pages }, testwait.Bound, time.Millisecond,
		"the lease re-declared ends with its connection: %+v", k.o.Stats().Devices[0])
}
