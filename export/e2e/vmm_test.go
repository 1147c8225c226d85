package e2e_test

import (
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/cudapool/cudapool/export"
	"github.com/cudapool/cudapool/export/consumer"
	"github.com/cudapool/cudapool/export/internal/exporttest"
	"github.com/cudapool/cudapool/export/producer"
)

// A VMM allocation of three chunks is opened as one range: its bytes, across the
// chunk boundaries, are the producer's; a second Open shares the Mapping; Release and
// a reopen work; State shows the route and size; after the producer closed its own
// chunks, the publication keeps the memory.
func TestVMMOpenReleaseReopen(t *testing.T) {
	pr := exporttest.NewProducer(t, nil, nil)
	ctx := exporttest.Ctx(t)
	a := pr.PublishVMM(t, "slab", 3, 40, producer.WithMeta([]byte("kv")))
	require.NoError(t, pr.Dev.StreamSynchronize(pr.Ord, pr.Stream))
	a.Close() // the exporter's descriptors keep the memory

	st, err := pr.Ex.State()
	require.NoError(t, err)
	require.Len(t, st.Published, 1)
	require.Equal(t, export.RouteVMM, st.Published[0].Route)
	require.EqualValues(t, 3*a.Gran, st.Published[0].Size)
	require.Equal(t, 3, st.Published[0].Chunks)

	c := exporttest.NewConsumer(t, pr.Path, 0)
	for round := range 2 {
		m, err := c.Imp.Open(ctx, "slab", c.Stream)
		require.NoError(t, err, "round %d", round)
		require.EqualValues(t, 3*a.Gran, m.Size())
		require.Equal(t, []byte("kv"), m.Meta())
		again, err := c.Imp.Open(ctx, "slab", c.Stream)
		require.NoError(t, err)
		require.Same(t, m, again, "a second Open of a held allocation is the same Mapping")
		got := c.Read(t, m)
		require.NoError(t, c.Dev.StreamSynchronize(c.Ord, c.Stream))
		exporttest.CheckVMMBytes(t, got, 0, a.Gran, 40)

		peers := pr.Ex.Peers()
		require.Len(t, peers, 1)
		require.Equal(t, 1, peers[0].Leases)
		require.Equal(t, 2, peers[0].Grants)
		require.EqualValues(t, 3*a.Gran, peers[0].BytesLeased)

		require.NoError(t, m.Release(ctx, c.Stream))
		require.NoError(t, again.Release(ctx, c.Stream))
		require.ErrorIs(t, m.Release(ctx, c.Stream), consumer.ErrReleased)
		exporttest.WaitFor(t, "the lease to end", func() bool { return pr.Ex.Peers()[0].Leases == 0 })
	}
	require.NoError(t, c.Imp.Close(ctx))
	require.NoError(t, pr.Ex.Close(ctx))
	pr.CheckClean(t)
	c.CheckClean(t)
}

// Ranges of VMM allocations open in one batch; a range across a chunk boundary reads
// both chunks; ReleaseAll gives all back.
func TestVMMRangesInOneBatch(t *testing.T) {
	pr := exporttest.NewProducer(t, nil, nil)
	ctx := exporttest.Ctx(t)
	a := pr.NewVMMAlloc(t, 2, 7)
	g := a.Gran
	require.NoError(t, pr.Ex.PublishChunks(ctx, "across", a.Chunks, pr.Stream, producer.Range(g-100, 200)))
	require.NoError(t, pr.Ex.PublishChunks(ctx, "whole", a.Chunks, pr.Stream))
	c := exporttest.NewConsumer(t, pr.Path, 0)
	ms, err := c.Imp.OpenAll(ctx, []string{"across", "whole"}, c.Stream)
	require.NoError(t, err)
	require.EqualValues(t, 200, ms[0].Size())
	got := c.Read(t, ms[0])
	require.NoError(t, c.Dev.StreamSynchronize(c.Ord, c.Stream))
	exporttest.CheckVMMBytes(t, got, g-100, g, 7)
	require.Equal(t, []byte{7, 8}, []byte{got[99], got[100]}, "the bytes either side of the boundary")
	require.NoError(t, c.Imp.ReleaseAll(ctx, ms, c.Stream))
	exporttest.WaitFor(t, "the leases to end", func() bool { return pr.Ex.Peers()[0].Leases == 0 })
	require.NoError(t, c.Imp.Close(ctx))
	c.CheckClean(t)
}
