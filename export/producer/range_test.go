package producer

import (
	"bytes"
	"os"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/cudapool/cudapool/export/consumer"
	"github.com/cudapool/cudapool/export/discover"
	"github.com/cudapool/cudapool/export/internal/inspect"
	"github.com/cudapool/cudapool/export/internal/wire"
)

func TestRangesOfOneBufferShareOneImport(t *testing.T) {
	pr := newProducer(t, nil, nil)
	ctx := testCtx(t)
	const size = 3 << 20
	b, err := pr.pool.Alloc(ctx, size, pr.stream)
	require.NoError(t, err)
	want := make([]byte, size)
	for i := range want {
		want[i] = byte(i % 251)
	}
	require.NoError(t, pr.dev.MemcpyHtoDAsync(pr.ord, b.Ptr(), want, pr.stream))
	// Blocks not aligned to anything: a tensor inside a segment, a KV block in a slab.
	require.NoError(t, pr.ex.Publish(ctx, "head", b, pr.stream, Range(0, 1000), WithMeta([]byte("first"))))
	require.NoError(t, pr.ex.Publish(ctx, "mid", b, pr.stream, Range(1000, 3001), WithMeta([]byte("second"))))
	require.NoError(t, pr.ex.Publish(ctx, "tail", b, pr.stream, Range(size-7, 0)))

	st, err := pr.ex.State()
	require.NoError(t, err)
	byName := map[string]discover.NameState{}
	for _, ns := range st.Published {
		byName[ns.Name] = ns
	}
	require.Equal(t, discover.NameState{Name: "mid", Pool: 1, BufferID: b.ID(), Size: size, Offset: 1000, Length: 3001, MetaBytes: 6}, byName["mid"])
	require.Equal(t, uint64(size-7), byName["tail"].Offset)

	c := newConsumer(t, pr.path, 0)
	head, err := c.imp.Open(ctx, "head", c.stream)
	require.NoError(t, err)
	mid, err := c.imp.Open(ctx, "mid", c.stream)
	require.NoError(t, err)
	tail, err := c.imp.Open(ctx, "tail", c.stream)
	require.NoError(t, err)
	require.NotSame(t, head, mid, "two ranges are two Mappings")

	require.EqualValues(t, 1000, head.Size())
	require.EqualValues(t, 3001, mid.Size())
	require.EqualValues(t, 7, tail.Size(), "Range with length 0 runs to the end")
	require.Equal(t, head.Ptr()+1000, mid.Ptr(), "one import: ranges keep their distance")
	require.Equal(t, []byte("first"), head.Meta())
	require.Equal(t, []byte("second"), mid.Meta())
	require.Nil(t, tail.Meta())
	require.Equal(t, want[:1000], c.read(t, head))
	require.Equal(t, want[1000:4001], c.read(t, mid))
	require.Equal(t, want[size-7:], c.read(t, tail))
	require.Equal(t, 1, inspect.Imports(c.imp), "ranges of one buffer import it once")

	// The same range again is the same Mapping; releasing some ranges keeps the
	// import for the others.
	again, err := c.imp.Open(ctx, "mid", c.stream)
	require.NoError(t, err)
	require.Same(t, mid, again)
	require.NoError(t, head.Release(ctx, c.stream))
	require.NoError(t, mid.Release(ctx, c.stream))
	require.Equal(t, want[1000:4001], c.read(t, mid), "one reference of mid is still held")
	require.NoError(t, again.Release(ctx, c.stream))
	require.Equal(t, want[size-7:], c.read(t, tail), "the import outlives the other ranges' releases")
	require.Equal(t, 1, inspect.Imports(c.imp))
	require.EqualValues(t, 1, pr.activeLeases(t), "only tail's lease is left")

	require.NoError(t, b.Free(pr.stream))
	require.NoError(t, tail.Release(ctx, c.stream))
	require.Zero(t, inspect.Imports(c.imp), "the last range's release frees the import")
	require.EqualValues(t, 0, pr.activeLeases(t))
	waitFor(t, "the deferred free", func() bool {
		s, _ := pr.pool.Stats()
		return s.LiveBuffers == 0
	})
	pr.checkClean(t)
	c.checkClean(t)
}

func TestPublishRefusesBadRangesAndMetadata(t *testing.T) {
	pr := newProducer(t, nil, nil)
	ctx := testCtx(t)
	b, err := pr.pool.Alloc(ctx, 1<<20, pr.stream)
	require.NoError(t, err)
	for _, r := range [][2]uint64{{1 << 20, 0}, {1 << 20, 1}, {0, 1<<20 + 1}, {5, 1 << 20}, {1<<64 - 1, 2}} {
		err := pr.ex.Publish(ctx, "x", b, pr.stream, Range(r[0], r[1]))
		require.ErrorIs(t, err, ErrBadRange, "Range(%d, %d)", r[0], r[1])
	}
	err = pr.ex.Publish(ctx, "x", b, pr.stream, WithMeta(bytes.Repeat([]byte{1}, wire.MaxMetaLen+1)))
	require.ErrorIs(t, err, ErrMetaTooLong)
	require.Empty(t, pr.ex.pubs, "nothing was published")
	require.NoError(t, pr.ex.Publish(ctx, "x", b, pr.stream, WithMeta(bytes.Repeat([]byte{1}, wire.MaxMetaLen))))
}

func TestPushedRangeCarriesItsMetadata(t *testing.T) {
	pr := newProducer(t, nil, nil)
	ctx := testCtx(t)
	b := pr.publish(t, "whole", 2<<20, 9)
	require.NoError(t, pr.ex.Publish(ctx, "block", b, pr.stream, Range(4096, 512), WithMeta([]byte(`{"block":1}`))))
	got := make(chan *consumer.Mapping, 1)
	d := newSide(t, 0)
	imp, err := consumer.Dial(ctx, pr.path, d.dev, 0, consumer.WithLogger(discardLogger), consumer.WithPushes(d.stream, func(name string, m *consumer.Mapping) { got <- m }))
	require.NoError(t, err)
	t.Cleanup(func() { imp.Close(ctx) })
	require.NoError(t, pr.ex.Push(ctx, "block", os.Getpid()))
	var m *consumer.Mapping
	select {
	case m = <-got:
	case <-ctx.Done():
		t.Fatal("the push never arrived")
	}
	require.EqualValues(t, 512, m.Size())
	require.Equal(t, []byte(`{"block":1}`), m.Meta())
	out := make([]byte, m.Size())
	require.NoError(t, d.dev.MemcpyDtoHAsync(0, out, m.Ptr(), d.stream))
	require.True(t, allAre(out, 9))
	require.NoError(t, m.Release(ctx, d.stream))
}
