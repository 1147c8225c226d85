package e2e_test

import (
	"context"
	"net"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/cudapool/cudapool/cudart"
	"github.com/cudapool/cudapool/cudart/cudarttest"
	"github.com/cudapool/cudapool/export"
	"github.com/cudapool/cudapool/export/consumer"
	"github.com/cudapool/cudapool/export/internal/exporttest"
	"github.com/cudapool/cudapool/export/producer"
	"github.com/cudapool/cudapool/pool"
)

// The consumer's stream must wait for the producer's writes: Open makes the caller's
// stream, not another, wait on the ready event when the producer's GPU is still busy.
func TestOpenOrdersTheCallersStreamAfterTheProducer(t *testing.T) {
	pr := exporttest.NewProducer(t, nil, nil)
	resume := exporttest.Stall(t, pr.Side) // the buffer's allocation and fill have not run
	pr.Publish(t, "p", 1<<20, 0x5a)
	c := exporttest.NewConsumer(t, pr.Path, 0)
	ctx := exporttest.Ctx(t)
	m, err := c.Imp.Open(ctx, "p", c.Stream)
	require.NoError(t, err)
	local := c.Scratch(t, m.Size())
	require.NoError(t, c.Dev.MemcpyDtoDAsync(c.Ord, local, m.Ptr(), m.Size(), c.Stream))
	resume()
	require.True(t, exporttest.AllAre(c.ReadScratch(t, local, m.Size()), 0x5a), "the consumer's stream copied before the producer's writes ran")
	require.NoError(t, m.Release(ctx, c.Stream))
	pr.CheckClean(t)
	c.CheckClean(t)
}

// The import is freed only after the work the caller queued before Release: Release
// orders the release stream after the caller's stream, however busy it is.
func TestReleaseFreesAfterTheCallersWork(t *testing.T) {
	pr := exporttest.NewProducer(t, nil, nil)
	pr.Publish(t, "p", 1<<20, 0x6b)
	c := exporttest.NewConsumer(t, pr.Path, 0)
	ctx := exporttest.Ctx(t)
	m, err := c.Imp.Open(ctx, "p", c.Stream)
	require.NoError(t, err)
	local := c.Scratch(t, m.Size())
	resume := exporttest.Stall(t, c.Side) // the copy below has not run when Release returns
	require.NoError(t, c.Dev.MemcpyDtoDAsync(c.Ord, local, m.Ptr(), m.Size(), c.Stream))
	require.NoError(t, m.Release(ctx, c.Stream))
	resume()
	require.True(t, exporttest.AllAre(c.ReadScratch(t, local, m.Size()), 0x6b), "the consumer's copy read other bytes")
	require.Zero(t, pr.ActiveLeases(t), "leases after Release")
	pr.CheckClean(t)
	c.CheckClean(t)
}

// A consumer cycling through a ring of buffers, as the sustained benchmark does, while
// the producer's GPU is still writing them and its own GPU is busy with each read as
// it releases it: every read sees the producer's bytes, and neither side breaks a
// rule. (The waits left out when the other side's work is done save driver work only;
// no outcome shows them.)
func TestCyclesOnBusyGPUs(t *testing.T) {
	const ring, rounds = 4, 3
	pr := exporttest.NewProducer(t, nil, nil)
	resume := exporttest.Stall(t, pr.Side)
	names := make([]string, ring)
	for i := range names {
		names[i] = string(rune('a' + i))
		pr.Publish(t, names[i], 1<<20, byte(i+1))
	}
	c, busy := exporttest.NewBusyConsumer(t, pr.Path)
	s, imp, ctx := c.Side, c.Imp, exporttest.Ctx(t)
	for i := range ring * rounds {
		m, err := imp.Open(ctx, names[i%ring], s.Stream)
		require.NoError(t, err)
		local := s.Scratch(t, m.Size())
		busy.Stall(t, s)
		require.NoError(t, s.Dev.MemcpyDtoDAsync(s.Ord, local, m.Ptr(), m.Size(), s.Stream))
		require.NoError(t, m.Release(ctx, s.Stream))
		if i == 0 {
			resume() // the producer's writes run only now
		}
		busy.End()
		require.True(t, exporttest.AllAre(s.ReadScratch(t, local, m.Size()), byte(i%ring+1)), "cycle %d reads wrong bytes", i)
	}
	require.Zero(t, pr.ActiveLeases(t), "leases after every Release")
	pr.CheckClean(t)
	c.CheckClean(t)
}

// serveTCP makes pr's exporter serve byte-stream peers on a loopback TCP listener
// and returns a connection to it.
func serveTCP(t testing.TB, pr *exporttest.Producer) net.Conn {
	t.Helper()
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Skipf("no TCP loopback: %v", err)
	}
	require.NoError(t, pr.Ex.Serve(l))
	nc, err := net.Dial("tcp", l.Addr().String())
	require.NoError(t, err)
	return nc
}

func fabricProducerOn(t testing.TB, wrap func(cudart.Runtime) cudart.Runtime) *exporttest.Producer {
	return exporttest.NewProducerOn(t, wrap, []pool.Option{pool.WithHandleType(cudart.HandleTypeFabric)},
		[]producer.ListenOption{producer.WithPolicy(export.Policy{AllowRemote: true})}, cudarttest.WithFabric())
}

// No event crosses a byte stream: the exporter itself waits for the producer's writes
// before it answers, so the consumer may read as soon as Open returns.
func TestByteStreamExporterWaitsForTheProducer(t *testing.T) {
	var busy *exporttest.BusyGPU
	pr := fabricProducerOn(t, func(rt cudart.Runtime) cudart.Runtime {
		busy = exporttest.NewBusyGPU(rt)
		return busy
	})
	busy.Stall(t, pr.Side) // ended only by a host wait of the exporter
	pr.Publish(t, "f", 2<<20, 0xfa)
	s := exporttest.NewSide(t, 1, cudarttest.WithFabric())
	ctx := exporttest.Ctx(t)
	imp, err := consumer.DialConn(ctx, serveTCP(t, pr), s.Dev, 1, consumer.WithLogger(exporttest.DiscardLogger))
	require.NoError(t, err)
	t.Cleanup(func() { imp.Close(context.Background()) })
	c := &exporttest.Consumer{Side: s, Imp: imp}
	m, err := imp.Open(ctx, "f", s.Stream)
	require.NoError(t, err)
	require.True(t, exporttest.AllAre(c.Read(t, m), 0xfa), "the consumer read before the producer's writes ran")
	require.NoError(t, m.Release(ctx, s.Stream))
	pr.CheckClean(t)
	c.CheckClean(t)
}

// No event crosses a byte stream: Release waits for the import's free before it tells
// the exporter, whose free of the buffer may run at once.
func TestByteStreamReleaseSyncsTheFree(t *testing.T) {
	pr := fabricProducerOn(t, nil)
	b := pr.Publish(t, "f", 2<<20, 0xfb)
	s := exporttest.NewSide(t, 1, cudarttest.WithFabric())
	busy := exporttest.NewBusyGPU(s.Dev)
	ctx := exporttest.Ctx(t)
	imp, err := consumer.DialConn(ctx, serveTCP(t, pr), busy, 1, consumer.WithLogger(exporttest.DiscardLogger))
	require.NoError(t, err)
	t.Cleanup(func() { imp.Close(context.Background()) })
	c := &exporttest.Consumer{Side: s, Imp: imp}
	m, err := imp.Open(ctx, "f", s.Stream)
	require.NoError(t, err)
	require.True(t, exporttest.AllAre(c.Read(t, m), 0xfb), "FABRIC mapping reads wrong bytes")
	require.NoError(t, b.Free(pr.Stream)) // the real free waits for the lease
	busy.Stall(t, s)                      // the import's free waits for it
	require.NoError(t, m.Release(ctx, s.Stream))
	require.Zero(t, pr.ActiveLeases(t), "leases after Release")
	pr.CheckClean(t) // the exporter's free ran: the import's must have run before
	busy.End()
	c.CheckClean(t)
}

// slowWaits makes each StreamWaitEvent take a while, as on a loaded host.
type slowWaits struct{ cudart.Runtime }

func (r slowWaits) StreamWaitEvent(dev int, s cudart.Stream, e cudart.Event) error {
	time.Sleep(20 * time.Millisecond)
	return r.Runtime.StreamWaitEvent(dev, s, e)
}

// A consumer that closes destroys its release event once the exporter hangs up, so the
// exporter hangs up only after the pool's streams were made to wait on that event for
// what the consumer retained, however long that takes.
func TestExporterHangsUpAfterUsingTheReleaseEvent(t *testing.T) {
	pr := exporttest.NewProducerOn(t, func(rt cudart.Runtime) cudart.Runtime { return slowWaits{rt} },
		[]pool.Option{pool.WithCache(64 << 20)}, []producer.ListenOption{producer.WithRetainedImports()})
	c := exporttest.NewConsumer(t, pr.Path, 0)
	ctx := exporttest.Ctx(t)
	b := pr.Publish(t, "kv", 2<<20, 0x11)
	m, err := c.Imp.Open(ctx, "kv", c.Stream)
	require.NoError(t, err)
	require.NoError(t, m.Release(ctx, c.Stream))
	require.NoError(t, pr.Ex.Unpublish("kv"))
	require.NoError(t, b.Free(pr.Stream))
	require.Equal(t, 1, exporttest.PoolStats(t, pr.Pool).Retentions, "the consumer retains its import")
	require.NoError(t, c.Imp.Close(ctx))
	require.Zero(t, exporttest.PoolStats(t, pr.Pool).Retentions, "the retention outlived the hang-up")
	pr.CheckClean(t)
	c.CheckClean(t)
}
