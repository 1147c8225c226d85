package cudart_test

// GPU benchmarks of the calls a pool makes per buffer. bench/cref/cref.cu makes the
// same calls from C in loops of the same shape; scripts/gpu-check.sh prints the two
// side by side. Each loop runs in batches that end with a synchronize, as the C one
// does, so that queued work stays bounded. Both report the same statistic over the
// same history of a fresh pool: after one warm-up batch, the median of the next 15
// batches' time per operation (here as ns/op). The batches b.Loop runs beyond those
// give late-ns/op, their median: where it exceeds ns/op, the driver's cost grows with
// the operations a pool has seen. Timed loops check errors with a plain if:
// require.NoError's two t.Helper calls take about 180 ns, more than some calls timed.

import (
	"encoding/binary"
	"fmt"
	"io"
	"os"
	"strconv"
	"testing"

	"github.com/stretchr/testify/require"
	"golang.org/x/sys/unix"

	"github.com/cudapool/cudapool/cudart"
	"github.com/cudapool/cudapool/internal/gputest"
)

const (
	syncEvery = 10000
	// exportsPerBatch is a batch of BenchmarkExportPointer, which needs no
	// synchronize.
	exportsPerBatch = 200
	// importBuffers is how many distinct buffers BenchmarkImportPointer cycles
	// through: each import is freed, and the frees complete (a synchronize) before
	// the same buffer is imported again.
	importBuffers = 1000
)

// BenchmarkMallocFreePair is one cudaMallocFromPoolAsync and one cudaFreeAsync of the
// same size on the same stream, from a pool that can be shared as a POSIX fd.
func BenchmarkMallocFreePair(b *testing.B) {
	for _, size := range []struct {
		name  string
		bytes uint64
	}{{"1KiB", KiB}, {"1MiB", MiB}, {"64MiB", 64 * MiB}} {
		b.Run(size.name, func(b *testing.B) {
			rt := gputest.Runtime(b)
			f := newGPUFixture(b, rt, 0, ipcPool)
			f.free(b, f.malloc(b, size.bytes)) // the pool reserves its memory once
			b.ReportAllocs()
			bt := gputest.NewBatches(syncEvery)
			for b.Loop() {
				p, err := rt.MallocFromPoolAsync(0, size.bytes, f.pool, f.stream)
				if err != nil {
					b.Fatal(err)
				}
				if err := rt.FreeAsync(0, p, f.stream); err != nil {
					b.Fatal(err)
				}
				if bt.Full() {
					require.NoError(b, rt.StreamSynchronize(0, f.stream), "StreamSynchronize")
					bt.Lap()
				}
			}
			bt.Report(b)
		})
	}
}

// BenchmarkExportPointer exports the same 1 MiB buffer of an exported pool again and
// again: the driver does not cache export data.
func BenchmarkExportPointer(b *testing.B) {
	rt := gputest.Runtime(b)
	f := newGPUFixture(b, rt, 0, ipcPool)
	h := must[cudart.ShareableHandle](b, "MemPoolExportToShareableHandle")(rt.MemPoolExportToShareableHandle(0, f.pool, cudart.HandleTypePosixFD))
	_ = unix.Close(h.FD) // test cleanup
	p := f.malloc(b, MiB)
	defer f.free(b, p)
	require.NoError(b, rt.StreamSynchronize(0, f.stream), "StreamSynchronize")
	b.ReportAllocs()
	bt := gputest.NewBatches(exportsPerBatch)
	for b.Loop() {
		if _, err := rt.MemPoolExportPointer(0, p); err != nil {
			b.Fatal(err)
		}
		if bt.Full() {
			bt.Lap()
		}
	}
	bt.Report(b)
}

// BenchmarkImportPointer is one cudaMemPoolImportPointer and one cudaFreeAsync of the
// import, of buffers that a child process exported (a process cannot import its own).
func BenchmarkImportPointer(b *testing.B) {
	rt := gputest.Runtime(b)
	cmd, conn := startChild(b, "bench-exporter", strconv.Itoa(importBuffers))
	_, fd, err := recvWithFD(conn, 8)
	require.NoError(b, err, "from the exporter")
	pool, err := rt.MemPoolImportFromShareableHandle(0, cudart.ShareableHandle{Type: cudart.HandleTypePosixFD, FD: fd})
	_ = unix.Close(fd) // test cleanup
	require.NoError(b, err)
	data := make([]cudart.PtrExportData, importBuffers)
	require.NoError(b, binary.Read(conn, binary.LittleEndian, data), "export data from the exporter")
	s := must[cudart.Stream](b, "StreamCreate")(rt.StreamCreate(0, cudart.StreamNonBlocking))
	defer func() { _ = rt.StreamDestroy(0, s) }() // test cleanup

	b.ReportAllocs()
	bt := gputest.NewBatches(importBuffers)
	for b.Loop() {
		p, err := rt.MemPoolImportPointer(0, pool, data[bt.Done()%importBuffers])
		if err != nil {
			b.Fatal(err)
		}
		if err := rt.FreeAsync(0, p, s); err != nil {
			b.Fatal(err)
		}
		if bt.Full() {
			require.NoError(b, rt.StreamSynchronize(0, s), "StreamSynchronize")
			bt.Lap()
		}
	}
	b.StopTimer()
	bt.Report(b)
	require.NoError(b, rt.StreamSynchronize(0, s), "StreamSynchronize")
	// Every import is freed: the exporter may free its buffers now, by exiting.
	_, err = conn.Write([]byte{'k'})
	require.NoError(b, err)
	require.NoError(b, cmd.Wait(), "exporter")
}

// benchExporterMain exports args[0] buffers of 1 MiB: it sends the pool's fd with the
// count, then every buffer's export data, and exits once the parent says it has
// freed its imports.
func benchExporterMain(args []string) int {
	fail := func(err error) int {
		fmt.Fprintln(os.Stderr, "child:", err)
		return 1
	}
	if len(args) != 1 {
		return fail(fmt.Errorf("want the number of buffers, got %q", args))
	}
	n, err := strconv.Atoi(args[0])
	if err != nil {
		return fail(err)
	}
	rt, conn, err := childStart()
	if err != nil {
		return fail(err)
	}
	defer func() { _ = conn.Close() }() // test cleanup
	h, data, err := exportBuffers(rt, n, nil)
	if err != nil {
		return fail(err)
	}
	if err := sendWithFD(conn, binary.LittleEndian.AppendUint64(nil, uint64(n)), h.FD); err != nil {
		return fail(err)
	}
	if err := binary.Write(conn, binary.LittleEndian, data); err != nil {
		return fail(err)
	}
	if _, err := io.ReadFull(conn, make([]byte, 1)); err != nil {
		return fail(err)
	}
	return 0
}

// BenchmarkEventRecordWait records an IPC event on one stream and makes another wait
// for it, as a pool does to order a release after a consumer's use.
func BenchmarkEventRecordWait(b *testing.B) {
	rt := gputest.Runtime(b)
	f := newGPUFixture(b, rt, 0, ipcPool)
	waiter := must[cudart.Stream](b, "StreamCreate")(rt.StreamCreate(0, cudart.StreamNonBlocking))
	defer func() { _ = rt.StreamDestroy(0, waiter) }() // test cleanup
	e := must[cudart.Event](b, "EventCreate")(rt.EventCreate(0, cudart.EventIPC))
	defer func() { _ = rt.EventDestroy(0, e) }() // test cleanup
	b.ReportAllocs()
	bt := gputest.NewBatches(syncEvery)
	for b.Loop() {
		if err := rt.EventRecord(0, e, f.stream); err != nil {
			b.Fatal(err)
		}
		if err := rt.StreamWaitEvent(0, waiter, e); err != nil {
			b.Fatal(err)
		}
		if bt.Full() {
			require.NoError(b, rt.StreamSynchronize(0, waiter), "StreamSynchronize")
			bt.Lap()
		}
	}
	b.StopTimer()
	bt.Report(b)
	require.NoError(b, rt.StreamSynchronize(0, waiter), "StreamSynchronize")
}
