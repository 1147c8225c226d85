package consumer_test

import (
	"context"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/cudapool/cudapool/cudart"
	"github.com/cudapool/cudapool/export"
	"github.com/cudapool/cudapool/export/consumer"
	"github.com/cudapool/cudapool/export/internal/exporttest"
	"github.com/cudapool/cudapool/export/internal/wire"
	"github.com/cudapool/cudapool/export/producer"
	"github.com/cudapool/cudapool/internal/testwait"
	"github.com/cudapool/cudapool/vmm"
)

// An exporter that grants a VMM allocation whose chunks do not add up is refused: a
// chunk not a multiple of the granularity, chunks of another size than the lease's
// (export.ErrProtocol), a lease whose chunks never came (export.ErrUnknownName: as
// after a DropChunks). Open fails saying why, holds nothing, gives the lease back, and
// no descriptor is left open.
func TestVMMBadChunkSetsRefused(t *testing.T) {
	maker := exporttest.NewSide(t, 0) // the fake exporter's device
	g, err := vmm.Granularity(maker.Dev, 0, cudart.HandleTypePosixFD)
	require.NoError(t, err)
	chunk, err := vmm.NewChunk(maker.Dev, 0, g)
	require.NoError(t, err)
	defer chunk.Close()
	cases := []struct {
		name      string
		chunkSize uint64 // 0: no ChunkHandle at all
		leaseSize uint64
		want      string
		is        error
	}{
		{"chunk not a multiple of the granularity", g + 4096, g + 4096, "granularity", vmm.ErrGranularity},
		{"chunks of another size than the lease", g, 2 * g, "whose chunks add up to", export.ErrProtocol},
		{"chunks that never came", 0, g, "its chunks are not here", export.ErrUnknownName},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			released := make(chan *wire.ReleaseMsg, 1)
			path, hungUp := exporttest.FakeExporterDone(t, welcomeThen(func(c *wire.Conn) {
				m, _, err := c.Recv()
				if err != nil {
					return
				}
				open := m.(*wire.OpenMsg)
				if tc.chunkSize > 0 {
					fd, err := chunk.Export()
					if err != nil {
						return
					}
					c.Send(context.Background(), &wire.ChunkHandleMsg{AllocID: 1, Size: tc.chunkSize, Count: 1, HandleType: cudart.HandleTypePosixFD}, fd)
					wire.CloseFDs([]int{fd})
				}
				c.Send(context.Background(), &wire.LeaseMsg{ReqID: open.ReqID, LeaseID: 9, PoolID: 1, Size: tc.leaseSize, Length: tc.leaseSize, Flags: wire.LeaseVMM}, -1)
				for {
					m, _, err := c.Recv()
					if err != nil {
						return
					}
					switch m := m.(type) {
					case *wire.ReleaseMsg:
						released <- m
					case *wire.ByeMsg:
						return // hung up on, as an exporter does
					}
				}
			}))
			s := exporttest.NewSide(t, 0)
			exporttest.WarmEventArena(t, s)
			before := exporttest.OpenFDs(t)
			imp, err := consumer.Dial(exporttest.Ctx(t), path, s.Dev, 0, consumer.WithLogger(exporttest.DiscardLogger))
			require.NoError(t, err)
			_, err = imp.Open(exporttest.Ctx(t), "slab", s.Stream)
			require.ErrorIs(t, err, tc.is, "Open = %v", err)
			require.ErrorContains(t, err, tc.want)
			r := testwait.Recv(t, released, "the refused lease to be given back")
			require.EqualValues(t, 9, r.LeaseID)
			require.NoError(t, imp.Close(exporttest.Ctx(t)))
			testwait.Recv(t, hungUp, "the fake exporter to see the hang-up")
			require.LessOrEqual(t, exporttest.OpenFDs(t), before, "descriptors left open")
			s.CheckClean(t)
		})
	}
}

// An allocation's chunks, descriptors and all, come once per connection: a reopen
// after the last Release maps the kept chunks again, with only its Lease on the wire.
func TestVMMChunksPassedOncePerConnection(t *testing.T) {
	pr := exporttest.NewProducer(t, nil, nil)
	ctx := exporttest.Ctx(t)
	const chunks = 3
	a := pr.PublishVMM(t, "slab", chunks, 10)
	c := exporttest.NewConsumer(t, pr.Path, 0)
	received := &consumer.Client(c.Imp).C.Received
	var perOpen []int64
	for range 3 {
		from := received.Load()
		m, err := c.Imp.Open(ctx, "slab", c.Stream)
		require.NoError(t, err)
		perOpen = append(perOpen, received.Load()-from)
		c.CheckVMM(t, m, 0, a.Gran, 10)
		require.NoError(t, m.Release(ctx, c.Stream))
	}
	require.Equal(t, []int64{chunks + 1, 1, 1}, perOpen, "frames an Open received: the chunks and the Lease, then the Lease alone")
}

// The chunks an Importer keeps go when their allocation is unpublished (DropChunks),
// by Unpublish or by an Exporter.Close that leaves the lease held; then only the
// mapping, until its Release, holds the producer's memory. At the connection's end
// nothing is kept either.
func TestVMMKeptChunksDropped(t *testing.T) {
	pr := exporttest.NewProducer(t, nil, nil)
	ctx := exporttest.Ctx(t)
	c := exporttest.NewConsumer(t, pr.Path, 0)
	openRelease := func(name string) {
		m, err := c.Imp.Open(ctx, name, c.Stream)
		require.NoError(t, err)
		require.NoError(t, m.Release(ctx, c.Stream))
	}
	pr.PublishVMM(t, "a", 2, 1)
	openRelease("a")
	require.Equal(t, 1, consumer.KeptAllocs(c.Imp), "chunks kept after the last Release")
	require.NoError(t, pr.Ex.Unpublish("a"))
	exporttest.WaitFor(t, "the unpublished allocation's chunks to be dropped", func() bool { return consumer.KeptAllocs(c.Imp) == 0 })

	pr.PublishVMM(t, "b", 2, 1)
	openRelease("b")
	held, err := c.Imp.Open(ctx, "b", c.Stream)
	require.NoError(t, err)
	require.Equal(t, 1, consumer.KeptAllocs(c.Imp))
	// Close gives up waiting at once: the peer is served on until it releases.
	require.ErrorIs(t, pr.Ex.Close(exporttest.Ended()), producer.ErrAbandoned)
	exporttest.WaitFor(t, "the closed exporter's chunks to be dropped", func() bool { return consumer.KeptAllocs(c.Imp) == 0 })
	require.NoError(t, held.Err(), "a mapping outlives its exporter's close")
	c.CheckVMM(t, held, 0, held.Size()/2, 1)
	require.NoError(t, held.Release(ctx, c.Stream))
	require.NoError(t, c.Imp.Close(ctx))
	c.CheckClean(t)
}

// Ranges of one VMM allocation (PublishChunksAll) are mapped once: their Mappings lie
// in one range at their offsets, each readable while the other is released; the
// allocation's chunks stay kept until its last name is unpublished.
func TestVMMRangesOfOneAllocationShareOneRange(t *testing.T) {
	pr := exporttest.NewProducer(t, nil, nil)
	ctx := exporttest.Ctx(t)
	a := pr.NewVMMAlloc(t, 3, 50)
	g := a.Gran
	require.NoError(t, pr.Ex.PublishChunksAll(ctx, a.Chunks, []producer.ChunkEntry{
		{Name: "head", Options: []producer.PublishOption{producer.Range(0, g)}},
		{Name: "across", Options: []producer.PublishOption{producer.Range(g-512, g), producer.WithMeta([]byte("x"))}},
	}, pr.Stream))
	st, err := pr.Ex.State()
	require.NoError(t, err)
	require.Len(t, st.Published, 2)
	require.Equal(t, st.Published[0].BufferID, st.Published[1].BufferID, "one allocation under both names")

	c := exporttest.NewConsumer(t, pr.Path, 0)
	ms, err := c.Imp.OpenAll(ctx, []string{"head", "across"}, c.Stream)
	require.NoError(t, err)
	head, across := ms[0], ms[1]
	require.EqualValues(t, g-512, uint64(across.Ptr()-head.Ptr()), "the ranges lie in one mapping at their offsets")
	require.Equal(t, []byte("x"), across.Meta())
	require.NoError(t, head.Release(ctx, c.Stream))
	c.CheckVMM(t, across, g-512, g, 50)
	require.NoError(t, across.Release(ctx, c.Stream))

	require.NoError(t, pr.Ex.Unpublish("head"))
	m, err := c.Imp.Open(ctx, "across", c.Stream)
	require.NoError(t, err, "the allocation lives on under its other name")
	require.NoError(t, m.Release(ctx, c.Stream))
	require.Equal(t, 1, consumer.KeptAllocs(c.Imp))
	require.NoError(t, pr.Ex.Unpublish("across"))
	exporttest.WaitFor(t, "the chunks to be dropped with the last name", func() bool { return consumer.KeptAllocs(c.Imp) == 0 })

	err = pr.Ex.PublishChunksAll(ctx, a.Chunks, []producer.ChunkEntry{{Name: "x"}, {Name: "x"}}, pr.Stream)
	require.ErrorIs(t, err, producer.ErrNameInUse)
	require.ErrorIs(t, pr.Ex.PublishChunksAll(ctx, a.Chunks, nil, pr.Stream), export.ErrBadRequest)
	require.NoError(t, c.Imp.Close(ctx))
	c.CheckClean(t)
}
