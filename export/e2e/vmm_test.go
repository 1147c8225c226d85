package e2e_test

import (
	"context"
	"errors"
	"fmt"
	"net"
	"os"
	"path/filepath"
	"sync"
	"testing"

	"github.com/stretchr/testify/require"
	"golang.org/x/sys/unix"

	"github.com/cudapool/cudapool/cudart"
	"github.com/cudapool/cudapool/cudart/cudarttest"
	"github.com/cudapool/cudapool/export"
	"github.com/cudapool/cudapool/export/consumer"
	"github.com/cudapool/cudapool/export/internal/exporttest"
	"github.com/cudapool/cudapool/export/producer"
	"github.com/cudapool/cudapool/internal/proctest"
	"github.com/cudapool/cudapool/internal/testwait"
	"github.com/cudapool/cudapool/vmm"
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
		c.CheckVMM(t, m, 0, a.Gran, 40)

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

// Publishing, opening and releasing VMM allocations, then unpublishing and closing,
// leaves no descriptor open: neither the exporter's of the chunks, nor the consumer's
// kept imports (dropped at DropChunks, which comes after Unpublish returns: waited
// for), nor its mappings.
func TestVMMChunkDescriptorsNotLeaked(t *testing.T) {
	pr := exporttest.NewProducer(t, nil, nil)
	c := exporttest.NewConsumer(t, pr.Path, 0)
	exporttest.WarmEventArena(t, pr.Side)
	exporttest.WarmEventArena(t, c.Side)
	ctx := exporttest.Ctx(t)
	before := exporttest.OpenFDs(t)

	a := pr.PublishVMM(t, "slab", 4, 60)
	for range 3 {
		m, err := c.Imp.Open(ctx, "slab", c.Stream)
		require.NoError(t, err)
		require.Greater(t, exporttest.OpenFDs(t), before, "nothing open while the allocation is mapped")
		require.NoError(t, m.Release(ctx, c.Stream))
	}
	ms, err := c.Imp.OpenAll(ctx, []string{"slab", "slab"}, c.Stream)
	require.NoError(t, err)
	require.NoError(t, c.Imp.ReleaseAll(ctx, ms, c.Stream))
	require.NoError(t, pr.Ex.Unpublish("slab"))
	a.Close()
	exporttest.WaitFor(t, fmt.Sprintf("the descriptors open to be the %d open before", before), func() bool { return exporttest.OpenFDs(t) == before })
}

// A consumer killed while it maps a VMM allocation has its lease ended once its
// process is gone; the exporter then closes without abandoning anything.
func TestVMMConsumerKilled(t *testing.T) {
	pr := exporttest.NewProducer(t, nil, nil)
	pr.PublishVMM(t, "slab", 3, 20)
	require.NoError(t, pr.Dev.StreamSynchronize(pr.Ord, pr.Stream))
	k := proctest.Start(t, "vmm-consumer", "test", pr.Path, "slab", "20")
	k.Expect("holding")
	peers := pr.Ex.Peers()
	require.Len(t, peers, 1)
	require.Equal(t, 1, peers[0].Leases)
	k.Kill()
	exporttest.KilledBySIGKILL(t, k)
	exporttest.WaitFor(t, "the dead consumer's lease to end", func() bool { return len(pr.Ex.Peers()) == 0 })
	require.NoError(t, pr.Ex.Close(exporttest.Ctx(t)))
	pr.CheckClean(t)
}

// A producer killed while a consumer maps its VMM allocation takes nothing with it:
// the consumer's import holds the memory, which reads as the producer wrote it; the
// Mapping is not lost, Release and Close complete, and new Opens fail with
// export.ErrExporterGone.
func TestVMMProducerKilled(t *testing.T) {
	path := filepath.Join(exporttest.ShortDir(t), "v.sock")
	k := proctest.Start(t, "vmm-producer", "test", path, "slab", "3", "70")
	var g uint64
	_, err := fmt.Sscanf(k.Next(), "ready %d", &g)
	require.NoError(t, err)
	c := exporttest.NewConsumer(t, path, 0)
	ctx := exporttest.Ctx(t)
	m, err := c.Imp.Open(ctx, "slab", c.Stream)
	require.NoError(t, err)
	exporttest.KillProducer(t, k)
	testwait.Recv(t, c.Imp.Done(), "the importer to see its exporter die")
	require.NoError(t, m.Err(), "a VMM mapping outlives its exporter")
	c.CheckVMM(t, m, 0, g, 70)
	_, err = c.Imp.Open(ctx, "slab", c.Stream)
	require.ErrorIs(t, err, export.ErrExporterGone)
	require.NoError(t, m.Release(ctx, c.Stream))
	require.NoError(t, c.Imp.Close(ctx))
	c.CheckClean(t)
}

// PublishChunks refuses what is not one allocation of one device, and publishes
// nothing: no chunks, chunks of two devices, an imported chunk, a range past the end.
func TestVMMPublishRefusals(t *testing.T) {
	pr := exporttest.NewProducer(t, nil, nil)
	ctx := exporttest.Ctx(t)
	a := pr.NewVMMAlloc(t, 2, 1)
	other := exporttest.NewVMMAllocOn(t, pr.Dev, 1, 0, 1, 1)
	fd, err := a.Chunks[0].Export()
	require.NoError(t, err)
	imported, err := vmm.Import(pr.Dev, 0, fd, a.Gran)
	require.NoError(t, err)
	require.NoError(t, unix.Close(fd))
	defer imported.Close()
	before := exporttest.OpenFDs(t)
	for _, tc := range []struct {
		name   string
		chunks []*vmm.Chunk
		opts   []producer.PublishOption
		want   error
	}{
		{"no chunks", nil, nil, export.ErrBadRequest},
		{"two devices", []*vmm.Chunk{a.Chunks[0], other.Chunks[0]}, nil, export.ErrBadRequest},
		{"imported chunk", []*vmm.Chunk{imported}, nil, vmm.ErrImported},
		{"range past the end", a.Chunks, []producer.PublishOption{producer.Range(a.Gran, 2*a.Gran)}, export.ErrBadRange},
	} {
		err := pr.Ex.PublishChunks(ctx, "x", tc.chunks, pr.Stream, tc.opts...)
		require.ErrorIs(t, err, tc.want, "%s: PublishChunks = %v", tc.name, err)
	}
	st, err := pr.Ex.State()
	require.NoError(t, err)
	require.Empty(t, st.Published)
	require.Equal(t, before, exporttest.OpenFDs(t), "descriptors kept by refused publishes")
	require.NoError(t, pr.Ex.PublishChunks(ctx, "x", a.Chunks, pr.Stream))
	require.ErrorIs(t, pr.Ex.PublishChunks(ctx, "x", a.Chunks, pr.Stream), producer.ErrNameInUse)
}

// FABRIC: chunks made WithFabric on a host without an IMEX channel are refused
// (vmm.ErrFabricNotPermitted), and a peer on a byte stream cannot be sent chunks
// that have no FABRIC handle (export.ErrHandleType). Where the device grants FABRIC
// (the software device WithFabric) the chunks travel over TCP as FABRIC handles.
func TestVMMFabric(t *testing.T) {
	noIMEX := exporttest.NewSide(t, 0)
	_, err := vmm.NewChunk(noIMEX.Dev, 0, 2<<20, vmm.WithFabric())
	require.ErrorIs(t, err, vmm.ErrFabricNotPermitted)

	pr := exporttest.NewProducer(t, nil, []producer.ListenOption{producer.WithPolicy(export.Policy{AllowRemote: true})}, cudarttest.WithFabric())
	ctx := exporttest.Ctx(t)
	pr.PublishVMM(t, "fd-only", 2, 30)
	fab := exporttest.NewVMMAllocOn(t, pr.Dev, 0, pr.Stream, 2, 50, vmm.WithFabric())
	require.NoError(t, pr.Ex.PublishChunks(ctx, "fabric", fab.Chunks, pr.Stream))
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Skipf("no TCP loopback: %v", err)
	}
	require.NoError(t, pr.Ex.Serve(l))
	s := exporttest.NewSide(t, 0, cudarttest.WithFabric())
	nc, err := net.Dial("tcp", l.Addr().String())
	require.NoError(t, err)
	imp, err := consumer.DialConn(ctx, nc, s.Dev, 0, consumer.WithLogger(exporttest.DiscardLogger))
	require.NoError(t, err)
	t.Cleanup(func() { imp.Close(context.Background()) })
	_, err = imp.Open(ctx, "fd-only", s.Stream)
	require.ErrorIs(t, err, export.ErrHandleType, "Open of chunks without FABRIC handles over TCP = %v", err)
	m, err := imp.Open(ctx, "fabric", s.Stream)
	require.NoError(t, err)
	c := &exporttest.Consumer{Side: s, Imp: imp}
	c.CheckVMM(t, m, 0, fab.Gran, 50)
	require.NoError(t, m.Release(ctx, s.Stream))
	require.NoError(t, imp.Close(ctx))
	s.CheckClean(t)
}

// A VMM allocation pushed to a process reaches each of its Importers: one with a push
// handler maps it as one range, one without gives it back, and the chunks sent to it
// are closed unused. No descriptor is left open once all is released and closed.
func TestVMMPush(t *testing.T) {
	pr := exporttest.NewProducer(t, nil, nil)
	exporttest.WarmEventArena(t, pr.Side)
	ctx := exporttest.Ctx(t)
	a := pr.PublishVMM(t, "slab", 2, 90)
	got := make(chan *consumer.Mapping, 1)
	taker := exporttest.NewSide(t, 0)
	refuser := exporttest.NewSide(t, 0)
	exporttest.WarmEventArena(t, taker)
	exporttest.WarmEventArena(t, refuser)
	before := exporttest.OpenFDs(t)
	takes, err := consumer.Dial(ctx, pr.Path, taker.Dev, 0, consumer.WithLogger(exporttest.DiscardLogger),
		consumer.WithPushes(func(name string, m *consumer.Mapping) { got <- m }, taker.Stream))
	require.NoError(t, err)
	refuses, err := consumer.Dial(ctx, pr.Path, refuser.Dev, 0, consumer.WithLogger(exporttest.DiscardLogger))
	require.NoError(t, err)
	require.NoError(t, pr.Ex.Push(ctx, "slab", os.Getpid()))
	m := testwait.Recv(t, got, "the pushed allocation")
	out := make([]byte, m.Size())
	require.NoError(t, taker.Dev.MemcpyDtoHAsync(0, out, m.Ptr(), taker.Stream))
	require.NoError(t, taker.Dev.StreamSynchronize(0, taker.Stream))
	exporttest.CheckVMMBytes(t, out, 0, a.Gran, 90)
	exporttest.WaitFor(t, "the refused push to be given back", func() bool {
		leases := 0
		for _, p := range pr.Ex.Peers() {
			leases += p.Leases
		}
		return leases == 1
	})
	require.NoError(t, m.Release(ctx, taker.Stream))
	require.NoError(t, takes.Close(ctx))
	require.NoError(t, refuses.Close(ctx))
	require.Equal(t, before, exporttest.OpenFDs(t), "descriptors left open by the pushes")
	taker.CheckClean(t)
	refuser.CheckClean(t)
}

// A VMM allocation opened WithLocalCopy is copied into the consumer's own memory, and
// its lease given back at once.
func TestVMMLocalCopy(t *testing.T) {
	pr := exporttest.NewProducer(t, nil, nil)
	ctx := exporttest.Ctx(t)
	a := pr.PublishVMM(t, "slab", 3, 120)
	c := exporttest.NewConsumer(t, pr.Path, 0)
	m, err := c.Imp.Open(ctx, "slab", c.Stream, consumer.WithLocalCopy(nil))
	require.NoError(t, err)
	exporttest.WaitFor(t, "the lease to be given back", func() bool { return pr.Ex.Peers()[0].Leases == 0 })
	c.CheckVMM(t, m, 0, a.Gran, 120)
	require.NoError(t, m.Release(ctx, c.Stream))
	require.NoError(t, c.Imp.Close(ctx))
	c.CheckClean(t)
}

// Goroutines of one Importer open and release one VMM allocation at once, and the
// exporter pushes it meanwhile: every Mapping reads the producer's bytes, the chunks
// go to the connection once, and all leases end.
func TestVMMConcurrentOpens(t *testing.T) {
	pr := exporttest.NewProducer(t, nil, nil)
	ctx := exporttest.Ctx(t)
	a := pr.PublishVMM(t, "slab", 3, 11)
	pushed := make(chan *consumer.Mapping, 64)
	s := exporttest.NewSide(t, 0)
	imp, err := consumer.Dial(ctx, pr.Path, s.Dev, 0, consumer.WithLogger(exporttest.DiscardLogger),
		consumer.WithPushes(func(_ string, m *consumer.Mapping) { pushed <- m }, s.Stream))
	require.NoError(t, err)
	t.Cleanup(func() { imp.Close(context.Background()) })
	var wg sync.WaitGroup
	errs := make(chan error, 8)
	for range 8 {
		wg.Go(func() {
			st, err := s.Dev.StreamCreate(0, cudart.StreamNonBlocking)
			if err != nil {
				errs <- err
				return
			}
			for range 20 {
				m, err := imp.Open(ctx, "slab", st)
				if err != nil {
					errs <- err
					return
				}
				got := make([]byte, m.Size())
				err = errors.Join(s.Dev.MemcpyDtoHAsync(0, got, m.Ptr(), st), s.Dev.StreamSynchronize(0, st))
				for i := uint64(0); err == nil && i < m.Size(); i += 4096 {
					if want := 11 + byte(i/a.Gran); got[i] != want {
						err = fmt.Errorf("byte %d is %#x, want %#x", i, got[i], want)
					}
				}
				if err = errors.Join(err, m.Release(ctx, st)); err != nil {
					errs <- err
					return
				}
			}
		})
	}
	for range 4 {
		require.NoError(t, pr.Ex.Push(ctx, "slab", os.Getpid()))
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		require.NoError(t, err)
	}
	for range 4 {
		m := testwait.Recv(t, pushed, "a pushed mapping")
		require.NoError(t, m.Release(ctx, s.Stream))
	}
	exporttest.WaitFor(t, "every lease to end", func() bool { return pr.Ex.Peers()[0].Leases == 0 })
	require.NoError(t, imp.Close(ctx))
	s.CheckClean(t)
}
