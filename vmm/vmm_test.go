package vmm_test

import (
	"bytes"
	"errors"
	"fmt"
	"net"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"
	"golang.org/x/sys/unix"

	"github.com/cudapool/cudapool/cudart"
	"github.com/cudapool/cudapool/cudart/cudarttest"
	"github.com/cudapool/cudapool/internal/gputest"
	"github.com/cudapool/cudapool/internal/proctest"
	"github.com/cudapool/cudapool/internal/unixfd"
	"github.com/cudapool/cudapool/vmm"
)

const dev = 0

func TestMain(m *testing.M) {
	proctest.Main(m, map[string]func([]string) int{"importer": importerMain})
}

// eachRuntime runs f on the software device, and on the GPU where there is one (the
// GPU subtest skips without one, or fails under CUDAPOOL_REQUIRE_GPU=1).
func eachRuntime(t *testing.T, f func(t *testing.T, rt cudart.Runtime, kind string)) {
	t.Run("softdevice", func(t *testing.T) { f(t, cudarttest.ForTest(t), "soft") })
	t.Run("gpu", func(t *testing.T) { f(t, gputest.Runtime(t), "gpu") })
}

func granularity(t testing.TB, rt cudart.Runtime) uint64 {
	t.Helper()
	g, err := vmm.Granularity(rt, dev, cudart.HandleTypePosixFD)
	require.NoError(t, err)
	return g
}

func newChunk(t testing.TB, rt cudart.Runtime, size uint64) *vmm.Chunk {
	t.Helper()
	c, err := vmm.NewChunk(rt, dev, size)
	require.NoError(t, err)
	t.Cleanup(func() { require.NoError(t, c.Close()) })
	return c
}

func reserve(t testing.TB, rt cudart.Runtime, size uint64) *vmm.Reservation {
	t.Helper()
	r, err := vmm.Reserve(rt, dev, size)
	require.NoError(t, err)
	t.Cleanup(func() {
		require.NoError(t, rt.StreamSynchronize(dev, 0))
		require.NoError(t, r.Close())
	})
	return r
}

func write(t testing.TB, rt cudart.Runtime, at cudart.DevicePtr, b []byte) {
	t.Helper()
	require.NoError(t, rt.MemcpyHtoDAsync(dev, at, b, 0))
	require.NoError(t, rt.StreamSynchronize(dev, 0))
}

func read(t testing.TB, rt cudart.Runtime, at cudart.DevicePtr, n int) []byte {
	t.Helper()
	b := make([]byte, n)
	require.NoError(t, rt.MemcpyDtoHAsync(dev, b, at, 0))
	return b
}

// pattern is n bytes that differ from one offset to the next, seeded.
func pattern(n int, seed byte) []byte {
	b := make([]byte, n)
	for i := range b {
		b[i] = byte(i*7) ^ seed
	}
	return b
}

// Growth maps behind what is mapped, in place: the address and the bytes already
// mapped stay; shrinking drops the end and keeps the rest.
func TestGrowAndShrinkInPlace(t *testing.T) {
	eachRuntime(t, func(t *testing.T, rt cudart.Runtime, _ string) {
		g := granularity(t, rt)
		r := reserve(t, rt, 4*g)
		require.Zero(t, r.Mapped())
		a := newChunk(t, rt, g)
		require.NoError(t, r.Grow(a))
		base := r.Ptr()
		first := pattern(2048, 1) // the end of the first chunk
		write(t, rt, base+cudart.DevicePtr(g)-2048, first)

		b, c := newChunk(t, rt, g), newChunk(t, rt, g)
		require.NoError(t, r.Grow(b, c))
		require.Equal(t, base, r.Ptr(), "growth moved the range")
		require.Equal(t, 3*g, r.Mapped())
		require.Equal(t, first, read(t, rt, base+cudart.DevicePtr(g)-2048, 2048), "growth changed the mapped bytes")
		across := pattern(8192, 2)
		write(t, rt, base+cudart.DevicePtr(2*g)-4096, across)
		require.Equal(t, across, read(t, rt, base+cudart.DevicePtr(2*g)-4096, 8192))

		require.NoError(t, r.Shrink(2))
		require.Equal(t, g, r.Mapped())
		require.Equal(t, 1, r.Chunks())
		require.Equal(t, first, read(t, rt, base+cudart.DevicePtr(g)-2048, 2048), "shrinking changed the bytes kept")
		// The chunks unmapped still hold their bytes: mapped again, in another order.
		require.NoError(t, r.Grow(c, b))
		require.Equal(t, across[:4096], read(t, rt, base+cudart.DevicePtr(3*g)-4096, 4096))
		require.Equal(t, across[4096:], read(t, rt, base+cudart.DevicePtr(g), 4096))
	})
}

// A copy on the device across the boundary of two chunks mapped contiguously.
func TestCopyAcrossAChunkBoundary(t *testing.T) {
	eachRuntime(t, func(t *testing.T, rt cudart.Runtime, _ string) {
		g := granularity(t, rt)
		r := reserve(t, rt, 4*g)
		require.NoError(t, r.Grow(newChunk(t, rt, 2*g), newChunk(t, rt, g)))
		src := pattern(int(g), 3)
		from := r.Ptr() + cudart.DevicePtr(g)/2 // [g/2, 3g/2) in the first chunk
		write(t, rt, from, src)
		to := r.Ptr() + cudart.DevicePtr(2*g) - cudart.DevicePtr(g)/2 // across the boundary at 2g
		require.NoError(t, rt.MemcpyDtoDAsync(dev, to, from, g, 0))
		require.NoError(t, rt.StreamSynchronize(dev, 0))
		require.True(t, bytes.Equal(src, read(t, rt, to, int(g))), "the copy across the boundary differs")
	})
}

// What is refused is refused clearly, and changes nothing.
func TestRefusals(t *testing.T) {
	eachRuntime(t, func(t *testing.T, rt cudart.Runtime, _ string) {
		g := granularity(t, rt)
		_, err := vmm.NewChunk(rt, dev, g+4096)
		require.ErrorIs(t, err, vmm.ErrGranularity)
		_, err = vmm.Reserve(rt, dev, 0)
		require.ErrorIs(t, err, vmm.ErrGranularity)
		_, err = vmm.Import(rt, dev, 0, g/2)
		require.ErrorIs(t, err, vmm.ErrGranularity)

		r := reserve(t, rt, 3*g)
		a := newChunk(t, rt, g)
		require.NoError(t, r.Grow(a))
		write(t, rt, r.Ptr(), []byte("kept"))
		err = r.Grow(newChunk(t, rt, g), newChunk(t, rt, g), newChunk(t, rt, g))
		require.ErrorIs(t, err, vmm.ErrFull)
		require.Equal(t, g, r.Mapped(), "a refused Grow changed the mapping")
		require.ErrorIs(t, r.Shrink(2), vmm.ErrNotMapped)
		require.Equal(t, g, r.Mapped())

		// A closed chunk is not mapped, and nothing mapped before it in the same Grow
		// stays mapped.
		closed, err := vmm.NewChunk(rt, dev, g)
		require.NoError(t, err)
		require.NoError(t, closed.Close())
		require.NoError(t, closed.Close(), "closing twice")
		err = r.Grow(newChunk(t, rt, g), closed)
		require.ErrorIs(t, err, vmm.ErrClosed)
		require.Equal(t, g, r.Mapped(), "a failed Grow left a mapping behind")
		_, err = closed.Export()
		require.ErrorIs(t, err, vmm.ErrClosed)
		require.Equal(t, []byte("kept"), read(t, rt, r.Ptr(), 4))

		// An imported chunk is not exported again.
		fd, err := a.Export()
		require.NoError(t, err)
		defer func() { _ = unix.Close(fd) }() // test cleanup
		imp, err := vmm.Import(rt, dev, fd, g)
		require.NoError(t, err)
		defer func() { require.NoError(t, imp.Close()) }()
		require.True(t, imp.Imported())
		_, err = imp.Export()
		require.ErrorIs(t, err, vmm.ErrImported)
	})
}

// FABRIC chunks need an IMEX channel: where there is none, the refusal says so.
func TestFabricNeedsIMEX(t *testing.T) {
	eachRuntime(t, func(t *testing.T, rt cudart.Runtime, _ string) {
		g := granularity(t, rt)
		c, err := vmm.NewChunk(rt, dev, g, vmm.WithFabric())
		if err == nil {
			// A host with an IMEX channel: the handle names the chunk.
			defer func() { require.NoError(t, c.Close()) }()
			h, err := c.ExportFabric()
			require.NoError(t, err)
			require.NotEqual(t, cudart.FabricHandle{}, h)
			t.Log("this host grants FABRIC handles: IMEX is set up")
			return
		}
		require.ErrorIs(t, err, vmm.ErrFabricNotPermitted)
		require.ErrorIs(t, err, cudart.ErrNotPermitted)
		require.ErrorContains(t, err, "IMEX")
	})
}

// A second process imports the chunks from descriptors passed over a Unix socket,
// maps them as one range and reads the maker's bytes after the maker released its
// handles and mappings and closed its descriptors.
func TestSecondProcessReadsAfterTheMakerReleased(t *testing.T) {
	eachRuntime(t, func(t *testing.T, rt cudart.Runtime, kind string) {
		g := granularity(t, rt)
		sock := filepath.Join(t.TempDir(), "s")
		l, err := net.ListenUnix("unix", &net.UnixAddr{Name: sock, Net: "unix"})
		require.NoError(t, err)
		defer func() { _ = l.Close() }() // test cleanup
		child := proctest.Start(t, "importer", kind, sock)

		r, err := vmm.Reserve(rt, dev, 3*g)
		require.NoError(t, err)
		a, err := vmm.NewChunk(rt, dev, g)
		require.NoError(t, err)
		b, err := vmm.NewChunk(rt, dev, 2*g)
		require.NoError(t, err)
		require.NoError(t, r.Grow(a, b))
		data := pattern(1<<14, 4)         // its hex is one line the child's answer can hold
		at := cudart.DevicePtr(g) - 1<<13 // across the boundary
		write(t, rt, r.Ptr()+at, data)

		conn, err := l.AcceptUnix()
		require.NoError(t, err)
		defer func() { _ = conn.Close() }() // test cleanup
		fa, err := a.Export()
		require.NoError(t, err)
		fb, err := b.Export()
		require.NoError(t, err)
		require.NoError(t, unixfd.Send(conn, fmt.Appendf(nil, "%d %d", a.Size(), b.Size()), fa, fb))
		child.Expect("mapped")

		// The maker lets go of everything it had.
		require.NoError(t, unix.Close(fa))
		require.NoError(t, unix.Close(fb))
		require.NoError(t, a.Close())
		require.NoError(t, b.Close())
		require.NoError(t, r.Close())

		child.Send(fmt.Sprintf("read %d %d", uint64(at), len(data)))
		got := child.Next()
		require.Equal(t, fmt.Sprintf("%x", data), got, "the second process read other bytes")
		child.Finish()
	})
}

// importerMain is the second process: args are the runtime's kind and the socket.
func importerMain(args []string) int {
	if err := importer(args[0], args[1]); err != nil {
		fmt.Fprintln(os.Stderr, "importer:", err)
		return 1
	}
	return 0
}

func importer(kind, sock string) error {
	var rt cudart.Runtime
	if kind == "gpu" {
		var err error
		if rt, err = cudart.Load(); err != nil {
			return err
		}
	} else {
		d := cudarttest.New()
		defer func() { _ = d.Close() }() // the process ends
		rt = d
	}
	conn, err := net.DialUnix("unix", nil, &net.UnixAddr{Name: sock, Net: "unix"})
	if err != nil {
		return err
	}
	defer func() { _ = conn.Close() }() // the process ends
	buf := make([]byte, 64)
	n, fds, err := unixfd.Recv(conn, buf, 2)
	if err != nil {
		return err
	}
	if len(fds) != 2 {
		return fmt.Errorf("%d descriptors came, want 2", len(fds))
	}
	var sizes [2]uint64
	if _, err := fmt.Sscan(string(buf[:n]), &sizes[0], &sizes[1]); err != nil {
		return err
	}
	r, err := vmm.Reserve(rt, dev, sizes[0]+sizes[1])
	if err != nil {
		return err
	}
	defer func() { _ = r.Close() }() // the process ends
	for i, fd := range fds {
		c, err := vmm.Import(rt, dev, fd, sizes[i])
		if err != nil {
			return err
		}
		// The mapping alone keeps the memory here: the handle and descriptor go.
		err = errors.Join(r.Grow(c), c.Close(), unix.Close(fd))
		if err != nil {
			return err
		}
	}
	fmt.Println("mapped")
	for line := range proctest.Commands() {
		f := strings.Fields(line)
		if len(f) != 3 || f[0] != "read" {
			return fmt.Errorf("unknown command %q", line)
		}
		at, err1 := strconv.ParseUint(f[1], 10, 64)
		size, err2 := strconv.Atoi(f[2])
		if err := errors.Join(err1, err2); err != nil {
			return err
		}
		b := make([]byte, size)
		if err := rt.MemcpyDtoHAsync(dev, b, r.Ptr()+cudart.DevicePtr(at), 0); err != nil {
			return err
		}
		fmt.Printf("%x\n", b)
	}
	return nil
}

// Stream memory operations work on a reservation's memory (FACTS 27): a word written
// in stream order reads back, and a wait for a value already there passes.
func TestStreamMemoryOperations(t *testing.T) {
	eachRuntime(t, func(t *testing.T, rt cudart.Runtime, _ string) {
		g := granularity(t, rt)
		r := reserve(t, rt, 2*g)
		require.NoError(t, r.Grow(newChunk(t, rt, g), newChunk(t, rt, g)))
		v, err := cudart.VMMOf(rt)
		require.NoError(t, err)
		word := r.Ptr() + cudart.DevicePtr(g) + 4 // in the second chunk
		require.NoError(t, v.StreamWriteValue32(dev, word, 0x01020304, 0))
		require.NoError(t, v.StreamWaitValue32(dev, word, 0x01020304, cudart.WaitEQ, 0))
		require.NoError(t, v.StreamWriteValue32(dev, word-4, 0x0a0b0c0d, 0))
		require.Equal(t, []byte{0x0d, 0x0c, 0x0b, 0x0a, 0x04, 0x03, 0x02, 0x01}, read(t, rt, word-4, 8))
	})
}
