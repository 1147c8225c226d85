//go:build cgo

package main

import (
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"sync"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/cudapool/cudapool/cudart"
	rtchoice "github.com/cudapool/cudapool/cudart/choose"
	"github.com/cudapool/cudapool/export"
	"github.com/cudapool/cudapool/export/consumer"
	"github.com/cudapool/cudapool/export/discover"
	"github.com/cudapool/cudapool/export/producer"
	"github.com/cudapool/cudapool/internal/proctest"
	"github.com/cudapool/cudapool/kv"
	"github.com/cudapool/cudapool/pool"
)

// The C entry points are exercised through the built library by python/tests; these
// tests cover the Go half they stand on, on the software device.

func TestMain(m *testing.M) {
	if _, err := choose("test"); err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(1)
	}
	code := proctest.TrapAnnounceDir(m) // the tests announce in directories of their own
	if built.lib != "" {
		os.RemoveAll(filepath.Dir(built.lib)) // the library the tests built (cabi_test.go)
	}
	os.Exit(code)
}

func testPool(t *testing.T, opts ...pool.Option) *pool.Pool {
	t.Helper()
	rt, err := runtimeNow()
	require.NoError(t, err)
	p, err := pool.New(rt, 0, opts...)
	require.NoError(t, err)
	t.Cleanup(func() {
		buffers.forgetPool(p)
		_, _ = p.Close(context.Background(), pool.Force())
	})
	return p
}

func TestHandlesTellWhyAHandleIsBad(t *testing.T) {
	pt := newTable[string](kindPool)
	mt := newTable[string](kindMapping)
	h := pt.add("a")
	m := mt.add("m")
	require.NotZero(t, h)

	v, err := pt.get(h)
	require.NoError(t, err)
	assert.Equal(t, "a", v)

	for _, c := range []struct {
		h    uint64
		want string
	}{
		{0, "pool handle 0"},
		{m, "is the handle of a mapping, not of a pool"},
		{0xDEADBEEF, "not a cudapool handle"},
		{h + 1, "never issued"},
		{h + 5<<genShift, "never issued"},
	} {
		_, err := pt.get(c.h)
		require.ErrorIs(t, err, errHandle, "%#x", c.h)
		assert.Contains(t, err.Error(), c.want, "%#x", c.h)
	}

	v, err = pt.remove(h)
	require.NoError(t, err)
	assert.Equal(t, "a", v)
	_, err = pt.get(h)
	require.ErrorIs(t, err, errHandle)
	assert.Contains(t, err.Error(), "closed or released")
	_, err = pt.remove(h)
	require.ErrorIs(t, err, errHandle, "a second remove")

	h2 := pt.add("b")
	assert.NotEqual(t, h, h2, "a reused slot gets a new handle")
	_, err = pt.get(h)
	require.ErrorIs(t, err, errHandle, "the old handle does not name the slot's new object")
	v, err = pt.get(h2)
	require.NoError(t, err)
	assert.Equal(t, "b", v)
}

func TestHandlesAreSafeForConcurrentUse(t *testing.T) {
	tb := newTable[int](kindExporter)
	var wg sync.WaitGroup
	for g := range 8 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for i := range 500 {
				h := tb.add(g*1000 + i)
				v, err := tb.get(h)
				assert.NoError(t, err)
				assert.Equal(t, g*1000+i, v)
				_, err = tb.remove(h)
				assert.NoError(t, err)
			}
		}()
	}
	wg.Wait()
}

func TestStatusOf(t *testing.T) {
	for _, c := range []struct {
		err  error
		want int
	}{
		{nil, statusOK},
		{invalid("x"), statusInval},
		{fmt.Errorf("wrapped: %w", pool.ErrZeroSize), statusInval},
		{export.ErrBadName, statusInval},
		{fmt.Errorf("%w: x", errHandle), statusHandle},
		{pool.ErrForeignBuffer, statusPointer},
		{pool.ErrBusy, statusBusy},
		{fmt.Errorf("pool: %w", pool.ErrClosed), statusClosed},
		{cudart.NewError("cudaMallocFromPoolAsync", cudart.ErrOutOfMemory), statusNoMem},
		{export.ErrUnknownName, statusNotFound},
		{producer.ErrNameInUse, statusExist},
		{export.ErrExporterGone, statusGone},
		{export.ErrVersionMismatch, statusVersion},
		{context.DeadlineExceeded, statusTimeout},
		{errRuntimeSet, statusNoRuntime},
		{cudart.NewError("cudaStreamCreate", cudart.ErrInvalidValue), statusCUDA},
		{errors.New("socket: permission denied"), statusIO},
		{fmt.Errorf("alloc: %w", kv.ErrNoSpace), statusNoSpace},
		{&kv.RemoteError{Err: kv.ErrStaleLease, Text: "no lease 7"}, statusStale},
		{fmt.Errorf("%w: its process exited", kv.ErrOwnerGone), statusGone},
		{kv.ErrClosed, statusClosed},
		{kv.ErrGeometry, statusInval},
		{kv.ErrTooLarge, statusInval},
		{&kv.RemoteError{Err: kv.ErrRefused, Text: "refused: uid 7"}, statusRefused},
		{&kv.RemoteError{Err: kv.ErrLimit, Text: "MaxLeases"}, statusTooMany},
		{fmt.Errorf("%w: waiting for an owner: %w", kv.ErrOwnerGone, context.DeadlineExceeded), statusTimeout},
	} {
		assert.Equal(t, c.want, statusOf(c.err), "%v", c.err)
	}
}

// TestEverySentinelHasItsStatus checks that no sentinel of the packages the library
// calls comes out as statusIO, the system's own failures, and that the ones that stand
// for a condition of their own have its status, also wrapped as export's errors are.
func TestEverySentinelHasItsStatus(t *testing.T) {
	for _, c := range []struct {
		err  error
		want int
	}{
		{consumer.ErrStreamDevice, statusStreamDevice},
		{consumer.ErrDuplicateImporter, statusDuplicate},
		{export.ErrTooManyGrants, statusTooMany},
		{consumer.ErrMappingLost, statusLost},
		{export.ErrExporterGone, statusGone},
		{&export.RemoteError{Err: export.ErrExporter, Text: "cudaMemPoolExportPointer failed"}, statusExporter},
		{&export.RemoteError{Err: export.ErrTooManyGrants, Text: "65536 held"}, statusTooMany},
		{fmt.Errorf("%w: %w", producer.ErrAbandoned, context.DeadlineExceeded), statusAbandoned},
		{export.ErrStaleLease, statusStale},
		{discover.ErrBadDir, statusBadDir},
		{export.ErrBadRequest, statusProtocol},
		{producer.ErrSocketPath, statusInval},
		{export.ErrNotSocket, statusExist},
		{export.ErrNoLeases, statusNotSup},
		{pool.ErrNotShareable, statusNotSup},
		{pool.ErrNoPeerAccess, statusNotSup},
		{pool.ErrLeaseEnded, statusStale},
		{pool.ErrNotLeased, statusStale},
		{pool.ErrMisaligned, statusCUDA},
		{pool.ErrFreeFailed, statusCUDA},
		{cudart.ErrContextLost, statusCUDA},
		{fmt.Errorf("%w: x", consumer.ErrOwnExporter), statusNotSup},
	} {
		assert.Equal(t, c.want, statusOf(c.err), "%v", c.err)
	}
	for _, s := range statuses {
		assert.NotEqual(t, statusIO, s.status, "%v", s.err)
		assert.Equal(t, s.status, statusOf(fmt.Errorf("wrapped: %w", s.err)), "%v", s.err)
	}
}

func TestRuntimeIsChosenOnce(t *testing.T) {
	c, err := choose("test")
	require.NoError(t, err)
	assert.False(t, c.onGPU)
	_, err = choose("gpu")
	require.ErrorIs(t, err, errRuntimeSet)
	assert.Contains(t, err.Error(), `"test"`)
}

// TestNoRuntimeAdvisesCAndPythonCallers checks what a C or Python caller reads when no
// runtime can be chosen: how to fix it from there (cudapool_init, cudapool.init,
// $CUDAPOOL_RUNTIME, rebuilding libcudapool with the software device), never Go's
// advice to import a package, and the status stays ENORUNTIME.
func TestNoRuntimeAdvisesCAndPythonCallers(t *testing.T) {
	noGPU := fmt.Errorf("choose: a GPU was asked for: %w", cudart.ErrNoRuntime)
	noSoft := fmt.Errorf("choose: no CUDA runtime loaded, and %w: %w", rtchoice.ErrNoSoftwareDevice, cudart.ErrNoRuntime)
	askedSoft := fmt.Errorf("choose: the software device was asked for, but %w", rtchoice.ErrNoSoftwareDevice)
	for _, c := range []struct {
		prefer string
		err    error
		want   []string
	}{
		{"gpu", noGPU, []string{`cudapool_init("auto")`, `cudapool.init("auto")`, "CUDAPOOL_RUNTIME=auto"}},
		{"auto", noSoft, []string{"-tags cudapool_softdevice", "go build -buildmode=c-shared"}},
		{"test", askedSoft, []string{"-tags cudapool_softdevice", "rebuild libcudapool"}},
	} {
		err := chooseFailed(c.prefer, c.err)
		msg := err.Error()
		assert.NotContains(t, msg, "import github.com", "%s: Go advice for a C or Python caller: %s", c.prefer, msg)
		for _, w := range c.want {
			assert.Contains(t, msg, w, "%s", c.prefer)
		}
		assert.ErrorIs(t, err, c.err)
		assert.Equal(t, statusNoRuntime, statusOf(err), "%s", c.prefer)
	}
}

func TestBufferTableFindsAddressesInsideBuffers(t *testing.T) {
	p := testPool(t)
	ctx := context.Background()
	var bufs []*pool.Buffer
	for range 20 {
		b, err := p.Alloc(ctx, 3<<20, 0)
		require.NoError(t, err)
		buffers.put(b)
		bufs = append(bufs, b)
	}
	for _, b := range bufs {
		got, off, ok := buffers.containing(uintptr(b.Ptr()))
		require.True(t, ok)
		assert.Same(t, b, got)
		assert.Zero(t, off)
		got, off, ok = buffers.containing(uintptr(b.Ptr()) + 12345)
		require.True(t, ok)
		assert.Same(t, b, got)
		assert.Equal(t, uint64(12345), off)
	}
	if got, _, ok := buffers.containing(uintptr(bufs[0].Ptr()) + uintptr(bufs[0].Size())); ok {
		assert.NotSame(t, bufs[0], got, "the end of a buffer is not in it")
	}

	for _, b := range bufs {
		require.NoError(t, free(uintptr(b.Ptr()), 0))
	}
	err := free(uintptr(bufs[0].Ptr()), 0)
	require.ErrorIs(t, err, errPointer, "a second free")
	_, _, ok := buffers.containing(uintptr(bufs[0].Ptr()))
	assert.False(t, ok)
}

func TestFreeOfAClosedPoolsBufferFails(t *testing.T) {
	p := testPool(t)
	b, err := p.Alloc(context.Background(), 1<<20, 0)
	require.NoError(t, err)
	buffers.put(b)
	_, err = p.Close(context.Background(), pool.Force())
	require.NoError(t, err)
	err = free(uintptr(b.Ptr()), 0)
	require.Error(t, err)
	assert.NotEqual(t, statusOK, statusOf(err))
}

func TestTorchPoolIsMadeOncePerDevice(t *testing.T) {
	p, err := torchPool(0)
	require.NoError(t, err)
	again, err := torchPool(0)
	require.NoError(t, err)
	assert.Same(t, p, again)
	assert.Equal(t, "torch-0", p.Name())
	assert.True(t, isTorchPool(p))

	_, err = torchPool(-1)
	require.ErrorIs(t, err, errInvalid)
	_, err = torchPool(maxTorchDevices)
	require.ErrorIs(t, err, errInvalid)
}

func TestTorchEnvOptions(t *testing.T) {
	t.Setenv(TorchMaxSizeEnv, "lots")
	_, err := torchEnvOptions()
	require.ErrorIs(t, err, errInvalid)
	t.Setenv(TorchMaxSizeEnv, "1048576")
	t.Setenv(TorchHandleTypeEnv, "sysv")
	_, err = torchEnvOptions()
	require.ErrorIs(t, err, errInvalid)
	t.Setenv(TorchHandleTypeEnv, "none")
	opts, err := torchEnvOptions()
	require.NoError(t, err)
	assert.Len(t, opts, 2)
}

// BenchmarkTorchAllocFree is the Go half of the PyTorch allocator's path: a 1 MiB
// allocation and its free through the device's pool and the buffer table.
func BenchmarkTorchAllocFree(b *testing.B) {
	p, err := torchPool(0)
	require.NoError(b, err)
	ctx := context.Background()
	for b.Loop() {
		buf, err := p.Alloc(ctx, 1<<20, 0)
		if err != nil {
			b.Fatal(err)
		}
		buffers.put(buf)
		if err := free(uintptr(buf.Ptr()), 0); err != nil {
			b.Fatal(err)
		}
	}
}
