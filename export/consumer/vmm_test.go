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
	"github.com/cudapool/cudapool/internal/testwait"
	"github.com/cudapool/cudapool/vmm"
)

// An exporter that grants a VMM allocation whose chunks do not add up is refused:
// a chunk not a multiple of the granularity, a set of another size than the lease's,
// a lease whose set never came. Open fails with export.ErrProtocol saying why, holds
// nothing, gives the lease back, and no descriptor is left open.
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
		also      error
	}{
		{"chunk not a multiple of the granularity", g + 4096, g + 4096, "granularity", vmm.ErrGranularity},
		{"set of another size than the lease", g, 2 * g, "names a set of", nil},
		{"set that never came", 0, g, "never came", nil},
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
					c.Send(context.Background(), &wire.ChunkHandleMsg{SetID: 5, AllocID: 1, Size: tc.chunkSize, Count: 1, HandleType: cudart.HandleTypePosixFD}, fd)
					wire.CloseFDs([]int{fd})
				}
				c.Send(context.Background(), &wire.LeaseMsg{ReqID: open.ReqID, LeaseID: 9, PoolID: 1, BufferID: 5, Size: tc.leaseSize, Length: tc.leaseSize, Flags: wire.LeaseVMM}, -1)
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
			require.ErrorIs(t, err, export.ErrProtocol, "Open = %v", err)
			require.ErrorContains(t, err, tc.want)
			if tc.also != nil {
				require.ErrorIs(t, err, tc.also)
			}
			r := testwait.Recv(t, released, "the refused lease to be given back")
			require.EqualValues(t, 9, r.LeaseID)
			require.NoError(t, imp.Close(exporttest.Ctx(t)))
			testwait.Recv(t, hungUp, "the fake exporter to see the hang-up")
			require.LessOrEqual(t, exporttest.OpenFDs(t), before, "descriptors left open")
			s.CheckClean(t)
		})
	}
}
