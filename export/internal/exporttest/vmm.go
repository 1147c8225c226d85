package exporttest

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"strconv"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/cudapool/cudapool/cudart"
	"github.com/cudapool/cudapool/export/consumer"
	"github.com/cudapool/cudapool/export/producer"
	"github.com/cudapool/cudapool/internal/proctest"
	"github.com/cudapool/cudapool/vmm"
)

// VMMAlloc is a VMM allocation a producer made: its chunks, mapped one behind the
// other into Res, chunk i filled with Fill+i.
type VMMAlloc struct {
	Chunks []*vmm.Chunk
	Res    *vmm.Reservation
	Gran   uint64 // the chunk size: one granule
	Fill   byte
}

// NewVMMAlloc makes n chunks of one granule each on the producer's device, maps them
// into one range and fills chunk i with fill+i on the producer's stream.
func (pr *Producer) NewVMMAlloc(t testing.TB, n int, fill byte) *VMMAlloc {
	t.Helper()
	return NewVMMAllocOn(t, pr.Dev, pr.Ord, pr.Stream, n, fill)
}

// NewVMMAllocOn is NewVMMAlloc on any runtime and stream.
func NewVMMAllocOn(t testing.TB, rt cudart.Runtime, dev int, s cudart.Stream, n int, fill byte, opts ...vmm.ChunkOption) *VMMAlloc {
	t.Helper()
	g, err := vmm.Granularity(rt, dev, cudart.HandleTypePosixFD)
	require.NoError(t, err)
	res, err := vmm.Reserve(rt, dev, uint64(n)*g)
	require.NoError(t, err)
	a := &VMMAlloc{Res: res, Gran: g, Fill: fill}
	t.Cleanup(func() { a.Close() })
	for i := range n {
		c, err := vmm.NewChunk(rt, dev, g, opts...)
		require.NoError(t, err)
		a.Chunks = append(a.Chunks, c)
		require.NoError(t, res.Grow(c))
		require.NoError(t, rt.MemsetAsync(dev, res.Ptr()+cudart.DevicePtr(uint64(i)*g), fill+byte(i), g, s))
	}
	return a
}

// Close closes the producer's chunks and range; a publication and the consumers'
// imports keep the memory.
func (a *VMMAlloc) Close() {
	for _, c := range a.Chunks {
		_ = c.Close() // cleanup: what is tested is above
	}
	_ = a.Res.Close() // cleanup: what is tested is above
}

// PublishVMM makes a VMM allocation of n chunks (NewVMMAlloc) and publishes it under
// name.
func (pr *Producer) PublishVMM(t testing.TB, name string, n int, fill byte, opts ...producer.PublishOption) *VMMAlloc {
	t.Helper()
	a := pr.NewVMMAlloc(t, n, fill)
	require.NoError(t, pr.Ex.PublishChunks(Ctx(t), name, a.Chunks, pr.Stream, opts...))
	return a
}

// CheckVMMBytes fails the test unless got, read from offset off of an allocation
// made by NewVMMAlloc with fill and granule g, holds what was written there.
func CheckVMMBytes(t testing.TB, got []byte, off, g uint64, fill byte) {
	t.Helper()
	for i, b := range got {
		want := fill + byte((off+uint64(i))/g)
		if b != want {
			require.Failf(t, "wrong byte", "byte %d (offset %d of the allocation) is %#x, want %#x", i, off+uint64(i), b, want)
		}
	}
}

// makeVMM makes n chunks of one granule on device 0 of rt, maps them into one range
// and fills chunk i with fill+i on s; the caller closes what it returns.
func makeVMM(rt cudart.Runtime, s cudart.Stream, n int, fill byte) ([]*vmm.Chunk, *vmm.Reservation, uint64, error) {
	g, err := vmm.Granularity(rt, 0, cudart.HandleTypePosixFD)
	if err != nil {
		return nil, nil, 0, err
	}
	res, err := vmm.Reserve(rt, 0, uint64(n)*g)
	if err != nil {
		return nil, nil, 0, err
	}
	var chunks []*vmm.Chunk
	for i := range n {
		c, err := vmm.NewChunk(rt, 0, g)
		if err == nil {
			chunks = append(chunks, c)
			err = res.Grow(c)
		}
		if err == nil {
			err = rt.MemsetAsync(0, res.Ptr()+cudart.DevicePtr(uint64(i)*g), fill+byte(i), g, s)
		}
		if err != nil {
			return chunks, res, g, err
		}
	}
	return chunks, res, g, nil
}

// RoleVMMProducer: vmm-producer KIND SOCKET NAME N FILL
// It makes a VMM allocation of N chunks of one granule on device 0, chunk i filled
// with FILL+i, publishes it under NAME, closes its own chunks and range (the
// publication keeps the memory), says "ready GRANULE" and then obeys stdin:
//
//	quit  close the exporter (waiting for releases) and exit
func RoleVMMProducer(args []string) int {
	fail := func(err error) int { fmt.Fprintln(os.Stderr, "vmm-producer:", err); return 1 }
	if len(args) != 5 {
		return fail(errors.New("want KIND SOCKET NAME N FILL"))
	}
	rt, done, err := ChildRuntime(args[0])
	if err != nil {
		return fail(err)
	}
	defer done()
	n, _ := strconv.Atoi(args[3])
	fill, _ := strconv.Atoi(args[4])
	ctx := context.Background()
	stream, err := rt.StreamCreate(0, cudart.StreamNonBlocking)
	if err != nil {
		return fail(err)
	}
	quiet := slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: slog.LevelError}))
	ex, err := producer.Listen(args[1], rt, producer.WithoutAnnounce(), producer.WithLogger(quiet))
	if err != nil {
		return fail(err)
	}
	chunks, res, g, err := makeVMM(rt, stream, n, byte(fill))
	if err == nil {
		err = ex.PublishChunks(ctx, args[2], chunks, stream)
	}
	if err == nil {
		err = rt.StreamSynchronize(0, stream) // written before "ready", as RoleProducer
	}
	for _, c := range chunks {
		err = errors.Join(err, c.Close())
	}
	if res != nil {
		err = errors.Join(err, res.Close())
	}
	if err != nil {
		return fail(err)
	}
	fmt.Println("ready", g)
	for line := range proctest.Commands() {
		if line != "quit" {
			return fail(fmt.Errorf("unknown command %q", line))
		}
		if err := ex.Close(ctx); err != nil {
			return fail(err)
		}
		if err := RuntimeErr(rt); err != nil {
			return fail(err)
		}
		return 0
	}
	return 0
}

// RoleVMMConsumer: vmm-consumer KIND SOCKET NAME FILL
// It opens NAME on device 0, checks that byte o is FILL + o/GRANULE (the granularity of
// its device), says "holding" and waits to be killed.
func RoleVMMConsumer(args []string) int {
	fail := func(err error) int { fmt.Fprintln(os.Stderr, "vmm-consumer:", err); return 1 }
	if len(args) != 4 {
		return fail(errors.New("want KIND SOCKET NAME FILL"))
	}
	rt, done, err := ChildRuntime(args[0])
	if err != nil {
		return fail(err)
	}
	defer done()
	fill, _ := strconv.Atoi(args[3])
	ctx := context.Background()
	stream, err := rt.StreamCreate(0, cudart.StreamNonBlocking)
	if err != nil {
		return fail(err)
	}
	g, err := vmm.Granularity(rt, 0, cudart.HandleTypePosixFD)
	if err != nil {
		return fail(err)
	}
	imp, err := consumer.Dial(ctx, args[1], rt, 0)
	if err != nil {
		return fail(err)
	}
	m, err := imp.Open(ctx, args[2], stream)
	if err != nil {
		return fail(err)
	}
	got := make([]byte, m.Size())
	err = rt.MemcpyDtoHAsync(0, got, m.Ptr(), stream)
	if err == nil {
		err = rt.StreamSynchronize(0, stream)
	}
	if err != nil {
		return fail(err)
	}
	for o, b := range got {
		if b != byte(fill)+byte(uint64(o)/g) {
			return fail(fmt.Errorf("byte %d is %#x, want %#x", o, b, byte(fill)+byte(uint64(o)/g)))
		}
	}
	fmt.Println("holding")
	for range proctest.Commands() {
	}
	return 0
}

// CheckVMM reads m, a range at offset off of an allocation made by NewVMMAlloc with
// fill and granule g, on the consumer's stream, and fails the test unless it holds
// what was written there.
func (c *Consumer) CheckVMM(t testing.TB, m *consumer.Mapping, off, g uint64, fill byte) {
	t.Helper()
	got := c.Read(t, m)
	require.NoError(t, c.Dev.StreamSynchronize(c.Ord, c.Stream))
	CheckVMMBytes(t, got, off, g, fill)
}
