package producer

import (
	"context"
	"net"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/cudapool/cudapool/cudart"
	"github.com/cudapool/cudapool/cudart/cudarttest"
	"github.com/cudapool/cudapool/export/consumer"
	"github.com/cudapool/cudapool/export/internal/inspect"
	"github.com/cudapool/cudapool/pool"
)

// stall holds side's stream until the returned resume is called (or the test ends).
func stall(t testing.TB, s *side) (resume func()) {
	t.Helper()
	resume, err := s.dev.Stall(s.ord, s.stream)
	require.NoError(t, err)
	t.Cleanup(resume)
	return resume
}

// busyGPU is a runtime whose stream is held by a stall until the host waits for the
// GPU: the first synchronising call ends the stall, as the long kernel would end while
// the host waits. Work that needs the stall to end and makes no host wait stays
// blocked, so a test can tell the two apart.
type busyGPU struct {
	cudart.Runtime
	mu     sync.Mutex
	resume func()
}

func (b *busyGPU) stall(t testing.TB, s *side) {
	t.Helper()
	resume := stall(t, s)
	b.mu.Lock()
	b.resume = resume
	b.mu.Unlock()
}

// end ends the stall, if any.
func (b *busyGPU) end() {
	b.mu.Lock()
	resume := b.resume
	b.resume = nil
	b.mu.Unlock()
	if resume != nil {
		resume()
	}
}

func (b *busyGPU) StreamSynchronize(dev int, s cudart.Stream) error {
	b.end()
	return b.Runtime.StreamSynchronize(dev, s)
}

func (b *busyGPU) EventSynchronize(dev int, e cudart.Event) error {
	b.end()
	return b.Runtime.EventSynchronize(dev, e)
}

// newBusyConsumer is newConsumer whose importer calls the device through a busyGPU.
func newBusyConsumer(t testing.TB, path string) (*testConsumer, *busyGPU) {
	t.Helper()
	s := newSide(t, 0)
	busy := &busyGPU{Runtime: s.dev}
	imp, err := consumer.Dial(testCtx(t), path, busy, 0, consumer.WithLogger(discardLogger))
	require.NoError(t, err)
	t.Cleanup(func() { imp.Close(context.Background()) })
	return &testConsumer{side: s, imp: imp}, busy
}

// scratch allocates n bytes of s's own memory, on its stream.
func (s *side) scratch(t testing.TB, n uint64) cudart.DevicePtr {
	t.Helper()
	p, err := s.dev.DeviceGetDefaultMemPool(s.ord)
	require.NoError(t, err)
	ptr, err := s.dev.MallocFromPoolAsync(s.ord, n, p, s.stream)
	require.NoError(t, err)
	return ptr
}

// readScratch copies n bytes of s's own memory to the host, after the work queued on
// its stream, whose violations fail the test.
func (s *side) readScratch(t testing.TB, ptr cudart.DevicePtr, n uint64) []byte {
	t.Helper()
	out := make([]byte, n)
	require.NoError(t, s.dev.MemcpyDtoHAsync(s.ord, out, ptr, s.stream))
	require.NoError(t, s.dev.FreeAsync(s.ord, ptr, s.stream))
	return out
}

// The consumer's stream must wait for the producer's writes: Open makes the caller's
// stream, not another, wait on the ready event when the producer's GPU is still busy.
func TestOpenOrdersTheCallersStreamAfterTheProducer(t *testing.T) {
	pr := newProducer(t, nil, nil)
	resume := stall(t, pr.side) // the buffer's allocation and fill have not run
	pr.publish(t, "p", 1<<20, 0x5a)
	c := newConsumer(t, pr.path, 0)
	ctx := testCtx(t)
	m, err := c.imp.Open(ctx, "p", c.stream)
	require.NoError(t, err)
	local := c.scratch(t, m.Size())
	require.NoError(t, c.dev.MemcpyDtoDAsync(c.ord, local, m.Ptr(), m.Size(), c.stream))
	resume()
	require.True(t, allAre(c.readScratch(t, local, m.Size()), 0x5a), "the consumer's stream copied before the producer's writes ran")
	require.NoError(t, m.Release(ctx, c.stream))
	pr.checkClean(t)
	c.checkClean(t)
}

// The import is freed only after the work the caller queued before Release: Release
// orders the release stream after the caller's stream, however busy it is.
func TestReleaseFreesAfterTheCallersWork(t *testing.T) {
	pr := newProducer(t, nil, nil)
	pr.publish(t, "p", 1<<20, 0x6b)
	c := newConsumer(t, pr.path, 0)
	ctx := testCtx(t)
	m, err := c.imp.Open(ctx, "p", c.stream)
	require.NoError(t, err)
	local := c.scratch(t, m.Size())
	resume := stall(t, c.side) // the copy below has not run when Release returns
	require.NoError(t, c.dev.MemcpyDtoDAsync(c.ord, local, m.Ptr(), m.Size(), c.stream))
	require.NoError(t, m.Release(ctx, c.stream))
	resume()
	require.True(t, allAre(c.readScratch(t, local, m.Size()), 0x6b), "the consumer's copy read other bytes")
	require.Zero(t, pr.activeLeases(t), "leases after Release")
	pr.checkClean(t)
	c.checkClean(t)
}

// A record released a moment ago is imported again only once its free has run: the
// pending free would otherwise unmap the new import, which has the same address
// (FACTS 4).
func TestReopenAfterReleaseAwaitsTheFree(t *testing.T) {
	pr := newProducer(t, nil, nil)
	pr.publish(t, "a", 1<<20, 5)
	c, busy := newBusyConsumer(t, pr.path)
	s, imp, ctx := c.side, c.imp, testCtx(t)
	m, err := imp.Open(ctx, "a", s.stream)
	require.NoError(t, err)
	busy.stall(t, s) // the free of the import waits for it
	require.NoError(t, m.Release(ctx, s.stream))
	require.Equal(t, 1, inspect.FreesPending(imp), "frees tracked after a release")
	m2, err := imp.Open(ctx, "a", s.stream)
	require.NoError(t, err)
	busy.end() // had Open not waited for the free, it would run now, under the new import
	require.NotSame(t, m, m2, "reopen returned the released mapping")
	require.Zero(t, inspect.FreesPending(imp), "frees still tracked after a reopen that waited for them")
	require.True(t, allAre(c.read(t, m2), 5), "reopened mapping reads wrong bytes")
	require.NoError(t, m2.Release(ctx, s.stream))
	c.checkClean(t)
	pr.checkClean(t)
}

// A consumer cycling through a ring of buffers, as the sustained benchmark does, while
// the producer's GPU is still writing them and its own GPU is busy with each read as
// it releases it: every read sees the producer's bytes, and neither side breaks a
// rule. (The waits left out when the other side's work is done save driver work only;
// no outcome shows them.)
func TestCyclesOnBusyGPUs(t *testing.T) {
	const ring, rounds = 4, 3
	pr := newProducer(t, nil, nil)
	resume := stall(t, pr.side)
	names := make([]string, ring)
	for i := range names {
		names[i] = string(rune('a' + i))
		pr.publish(t, names[i], 1<<20, byte(i+1))
	}
	c, busy := newBusyConsumer(t, pr.path)
	s, imp, ctx := c.side, c.imp, testCtx(t)
	for i := range ring * rounds {
		m, err := imp.Open(ctx, names[i%ring], s.stream)
		require.NoError(t, err)
		local := s.scratch(t, m.Size())
		busy.stall(t, s)
		require.NoError(t, s.dev.MemcpyDtoDAsync(s.ord, local, m.Ptr(), m.Size(), s.stream))
		require.NoError(t, m.Release(ctx, s.stream))
		if i == 0 {
			resume() // the producer's writes run only now
		}
		busy.end()
		require.True(t, allAre(s.readScratch(t, local, m.Size()), byte(i%ring+1)), "cycle %d reads wrong bytes", i)
	}
	require.Zero(t, pr.activeLeases(t), "leases after every Release")
	pr.checkClean(t)
	c.checkClean(t)
}

// serveTCP makes pr's exporter serve byte-stream peers on a loopback TCP listener
// and returns a connection to it.
func serveTCP(t testing.TB, pr *producer) net.Conn {
	t.Helper()
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Skipf("no TCP loopback: %v", err)
	}
	require.NoError(t, pr.ex.Serve(l))
	nc, err := net.Dial("tcp", l.Addr().String())
	require.NoError(t, err)
	return nc
}

func fabricProducerOn(t testing.TB, wrap func(cudart.Runtime) cudart.Runtime) *producer {
	return newProducerOn(t, wrap, []pool.Option{pool.WithHandleType(cudart.HandleTypeFabric)},
		[]ListenOption{WithPolicy(Policy{AllowRemote: true})}, cudarttest.WithFabric())
}

// No event crosses a byte stream: the exporter itself waits for the producer's writes
// before it answers, so the consumer may read as soon as Open returns.
func TestByteStreamExporterWaitsForTheProducer(t *testing.T) {
	var busy *busyGPU
	pr := fabricProducerOn(t, func(rt cudart.Runtime) cudart.Runtime {
		busy = &busyGPU{Runtime: rt}
		return busy
	})
	busy.stall(t, pr.side) // ended only by a host wait of the exporter
	pr.publish(t, "f", 2<<20, 0xfa)
	s := newSide(t, 1, cudarttest.WithFabric())
	ctx := testCtx(t)
	imp, err := consumer.DialConn(ctx, serveTCP(t, pr), s.dev, 1, consumer.WithLogger(discardLogger))
	require.NoError(t, err)
	t.Cleanup(func() { imp.Close(context.Background()) })
	c := &testConsumer{side: s, imp: imp}
	m, err := imp.Open(ctx, "f", s.stream)
	require.NoError(t, err)
	require.True(t, allAre(c.read(t, m), 0xfa), "the consumer read before the producer's writes ran")
	require.NoError(t, m.Release(ctx, s.stream))
	pr.checkClean(t)
	c.checkClean(t)
}

// No event crosses a byte stream: Release waits for the import's free before it tells
// the exporter, whose free of the buffer may run at once.
func TestByteStreamReleaseSyncsTheFree(t *testing.T) {
	pr := fabricProducerOn(t, nil)
	b := pr.publish(t, "f", 2<<20, 0xfb)
	s := newSide(t, 1, cudarttest.WithFabric())
	busy := &busyGPU{Runtime: s.dev}
	ctx := testCtx(t)
	imp, err := consumer.DialConn(ctx, serveTCP(t, pr), busy, 1, consumer.WithLogger(discardLogger))
	require.NoError(t, err)
	t.Cleanup(func() { imp.Close(context.Background()) })
	c := &testConsumer{side: s, imp: imp}
	m, err := imp.Open(ctx, "f", s.stream)
	require.NoError(t, err)
	require.True(t, allAre(c.read(t, m), 0xfb), "FABRIC mapping reads wrong bytes")
	require.NoError(t, b.Free(pr.stream)) // the real free waits for the lease
	busy.stall(t, s)                      // the import's free waits for it
	require.NoError(t, m.Release(ctx, s.stream))
	require.Zero(t, pr.activeLeases(t), "leases after Release")
	pr.checkClean(t) // the exporter's free ran: the import's must have run before
	busy.end()
	c.checkClean(t)
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
	pr := newProducerOn(t, func(rt cudart.Runtime) cudart.Runtime { return slowWaits{rt} },
		[]pool.Option{pool.WithCache(64 << 20)}, []ListenOption{WithRetainedImports()})
	c := newConsumer(t, pr.path, 0)
	ctx := testCtx(t)
	b := pr.publish(t, "kv", 2<<20, 0x11)
	m, err := c.imp.Open(ctx, "kv", c.stream)
	require.NoError(t, err)
	require.NoError(t, m.Release(ctx, c.stream))
	require.NoError(t, pr.ex.Unpublish("kv"))
	require.NoError(t, b.Free(pr.stream))
	require.Equal(t, 1, poolStats(t, pr.pool).Retentions, "the consumer retains its import")
	require.NoError(t, c.imp.Close(ctx))
	require.Zero(t, poolStats(t, pr.pool).Retentions, "the retention outlived the hang-up")
	pr.checkClean(t)
	c.checkClean(t)
}
