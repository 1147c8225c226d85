package consumer_test

import (
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/cudapool/cudapool/export"
	"github.com/cudapool/cudapool/export/consumer"
	"github.com/cudapool/cudapool/export/internal/exporttest"
	"github.com/cudapool/cudapool/export/producer"
)

func TestRangesOfOneBufferShareOneImport(t *testing.T) {
	pr := exporttest.NewProducer(t, nil, nil)
	ctx := exporttest.Ctx(t)
	const size = 3 << 20
	b, err := pr.Pool.Alloc(ctx, size, pr.Stream)
	require.NoError(t, err)
	want := make([]byte, size)
	for i := range want {
		want[i] = byte(i % 251)
	}
	require.NoError(t, pr.Dev.MemcpyHtoDAsync(pr.Ord, b.Ptr(), want, pr.Stream))
	// Blocks not aligned to anything: a tensor inside a segment, a KV block in a slab.
	require.NoError(t, pr.Ex.Publish(ctx, "head", b, pr.Stream, producer.Range(0, 1000), producer.WithMeta([]byte("first"))))
	require.NoError(t, pr.Ex.Publish(ctx, "mid", b, pr.Stream, producer.Range(1000, 3001), producer.WithMeta([]byte("second"))))
	require.NoError(t, pr.Ex.Publish(ctx, "tail", b, pr.Stream, producer.Range(size-7, 0)))

	st, err := pr.Ex.State()
	require.NoError(t, err)
	byName := map[string]export.NameState{}
	for _, ns := range st.Published {
		byName[ns.Name] = ns
	}
	require.Equal(t, export.NameState{Name: "mid", Route: export.RoutePool, Pool: 1, BufferID: b.ID(), Size: size, Offset: 1000, Length: 3001, MetaBytes: 6}, byName["mid"])
	require.Equal(t, uint64(size-7), byName["tail"].Offset)

	c := exporttest.NewConsumer(t, pr.Path, 0)
	head, err := c.Imp.Open(ctx, "head", c.Stream)
	require.NoError(t, err)
	mid, err := c.Imp.Open(ctx, "mid", c.Stream)
	require.NoError(t, err)
	tail, err := c.Imp.Open(ctx, "tail", c.Stream)
	require.NoError(t, err)
	require.NotSame(t, head, mid, "two ranges are two Mappings")

	require.EqualValues(t, 1000, head.Size())
	require.EqualValues(t, 3001, mid.Size())
	require.EqualValues(t, 7, tail.Size(), "Range with length 0 runs to the end")
	require.Equal(t, head.Ptr()+1000, mid.Ptr(), "one import: ranges keep their distance")
	require.Equal(t, []byte("first"), head.Meta())
	require.Equal(t, []byte("second"), mid.Meta())
	require.Nil(t, tail.Meta())
	require.Equal(t, want[:1000], c.Read(t, head))
	require.Equal(t, want[1000:4001], c.Read(t, mid))
	require.Equal(t, want[size-7:], c.Read(t, tail))
	require.Equal(t, 1, consumer.Imports(c.Imp), "ranges of one buffer import it once")

	// The same range again is the same Mapping; releasing some ranges keeps the
	// import for the others.
	again, err := c.Imp.Open(ctx, "mid", c.Stream)
	require.NoError(t, err)
	require.Same(t, mid, again)
	require.NoError(t, head.Release(ctx, c.Stream))
	require.NoError(t, mid.Release(ctx, c.Stream))
	require.Equal(t, want[1000:4001], c.Read(t, mid), "one reference of mid is still held")
	require.NoError(t, again.Release(ctx, c.Stream))
	require.Equal(t, want[size-7:], c.Read(t, tail), "the import outlives the other ranges' releases")
	require.Equal(t, 1, consumer.Imports(c.Imp))
	require.EqualValues(t, 1, pr.ActiveLeases(t), "only tail's lease is left")

	require.NoError(t, b.Free(pr.Stream))
	require.NoError(t, tail.Release(ctx, c.Stream))
	require.Zero(t, consumer.Imports(c.Imp), "the last range's release frees the import")
	require.EqualValues(t, 0, pr.ActiveLeases(t))
	exporttest.WaitFor(t, "the deferred free", func() bool {
		s, _ := pr.Pool.Stats()
		return s.LiveBuffers == 0
	})
	pr.CheckClean(t)
	c.CheckClean(t)
}
