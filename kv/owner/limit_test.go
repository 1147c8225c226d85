package owner_test

import (
	"os"
	"path/filepath"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/cudapool/cudapool/cudart/cudarttest"
	"github.com/cudapool/cudapool/kv"
	"github.com/cudapool/cudapool/kv/owner"
)

// A slab over MaxSlabBytes is refused at Listen, naming the limit and the most pages
// that fit, with nothing left behind; a slab of exactly MaxSlabBytes is served.
func TestListenRefusesSlabOverTheLimit(t *testing.T) {
	g, err := kv.Layout("llama-0.85b") // 512 KiB a page
	require.NoError(t, err)
	const most = 8192 // 4 GiB

	dir := filepath.Join(t.TempDir(), "kv")
	dev := cudarttest.ForTest(t)
	for _, pages := range []int{most + 1, 2 * most} { // 512 KiB over; the 8 GiB that crashed replicas
		g.Pages = pages
		_, err := owner.Listen(dir, dev, owner.Options{Geometry: g, NoAnnounce: true})
		require.Error(t, err, "%d pages (%d bytes)", pages, g.SlabBytes())
		assert.ErrorIs(t, err, kv.ErrGeometry)
		assert.ErrorContains(t, err, "over the 4 GiB")
		assert.ErrorContains(t, err, "at most 8192 pages")
		for _, name := range []string{owner.SlabSocket, owner.PageSocket} {
			_, err := os.Lstat(filepath.Join(dir, name))
			assert.ErrorIs(t, err, os.ErrNotExist, "%s left behind", name)
		}
	}
	free, total, err := dev.MemGetInfo(0)
	require.NoError(t, err)
	assert.Equal(t, total, free, "memory left reserved by the refused Listens")

	g.Pages = most
	o, err := owner.Listen(dir, dev, owner.Options{Geometry: g, NoAnnounce: true})
	require.NoError(t, err, "a slab of exactly MaxSlabBytes")
	assert.Equal(t, owner.MaxSlabBytes, g.SlabBytes())
	assert.NoError(t, o.Close(bound(t)))
	assert.NoError(t, dev.Err(), "the owner's device saw broken rules")
}
