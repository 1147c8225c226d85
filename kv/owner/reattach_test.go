package owner_test

import (
	"encoding/binary"
	"os"
	"path/filepath"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/cudapool/cudapool/cudart/cudarttest"
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
// saying why, and takes nothing; a malformed one closes the connection.
func TestReattachRefusesWhatIsNotAsItWas(t *testing.T) {
	dir, err := os.MkdirTemp("", "kvo")
	require.NoError(t, err)
	t.Cleanup(func() { os.RemoveAll(dir) })
	odev := cudarttest.ForTest(t)
	// An index makes lease ids start past those an earlier owner issued (epoch << 40).
	o, err := owner.Listen(dir, odev, small, owner.WithoutAnnounce(), owner.WithIndex(filepath.Join(dir, owner.IndexFile)))
	require.NoError(t, err)
	t.Cleanup(func() { assert.NoError(t, o.Close(bound(t))) })
	dev := cudarttest.ForTest(t)
	other, err := replica.Dial(bound(t), dir, dev, 0)
	require.NoError(t, err)
	t.Cleanup(func() { other.Close(bound(t)) })
	held, err := other.Alloc(bound(t), 2)
	require.NoError(t, err)
	w, err := other.Alloc(bound(t), 1)
	require.NoError(t, err)
	_, err = other.Seal(bound(t), w, []kv.Hash{{7}}, 0, replica.WaitVisible())
	require.NoError(t, err)
	visible := w.Pages()[0]

	r := dialRaw(t, dir)
	r.hello()
	for i, c := range []struct {
		m   kvwire.Reattach
		why string
	}{
		{kvwire.Reattach{Lease: held.ID(), Write: true, Pages: held.Pages()}, "is held already"},
		{kvwire.Reattach{Lease: 1 << 50, Write: true, Pages: []uint32{9}}, "was not issued before this owner"},
		{kvwire.Reattach{Lease: 1 << 30, Write: true}, "0 pages"},
		{kvwire.Reattach{Lease: 1 << 30, Pages: []uint32{9}}, "1 pages and 0 hashes"},
		{kvwire.Reattach{Lease: 1 << 30, Write: true, Pages: []uint32{64}}, "page 64 of 64"},
		{kvwire.Reattach{Lease: 1 << 30, Write: true, Pages: []uint32{9, 9}}, "page 9 is listed twice"},
		{kvwire.Reattach{Lease: 1 << 30, Write: true, Pages: []uint32{held.Pages()[0]}}, "no longer free to write"},
		{kvwire.Reattach{Lease: 1 << 30, Pages: []uint32{visible}, Hashes: []kv.Hash{{8}}}, "no longer visible under its hash"},
		{kvwire.Reattach{Lease: 1 << 30, Pages: []uint32{9}, Hashes: []kv.Hash{{7}}}, "no longer visible under its hash"},
	} {
		status, why := r.reattach(uint32(i+1), c.m)
		assert.Equal(t, kvwire.ReattachLost, status, "%+v", c.m)
		assert.Contains(t, why, c.why, "%+v", c.m)
	}
	status, _ := r.reattach(99, kvwire.Reattach{})
	assert.Equal(t, kvwire.ReattachKept, status, "the end of the list")
	st, err := other.Stats(bound(t))
	require.NoError(t, err)
	assert.Equal(t, 1, st.Devices[0].Sealed)
	assert.Equal(t, 2, st.Devices[0].Writing, "nothing was taken")

	b, _ := kvwire.AppendReattach(nil, 5, kvwire.Reattach{Lease: 1 << 30, Write: true, Pages: []uint32{9}})
	binary.LittleEndian.PutUint32(b[kvwire.HeaderLen+8:], 2) // write flag 2
	r.send(b, nil)
	r.closed("a Reattach with write flag 2")
}
