//go:build cgo && linux

package cudart_test

import (
	"bytes"
	"errors"
	"fmt"
	"runtime"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"golang.org/x/sys/unix"

	"github.com/cudapool/cudapool/cudart"
	"github.com/cudapool/cudapool/internal/eventfdtest"
)

func TestFakeVersionsAndDevices(t *testing.T) {
	fake := buildFake(t, nil, nil)
	rt := fake.load(t)
	assert.Equal(t, fake.runtime+" (runtime 13000, driver 13010)", rt.Name())
	assert.Equal(t, 4, must[int](t, "DeviceCount")(rt.DeviceCount()), "DeviceCount")
	assert.Equal(t, 2115, must[int](t, "DeviceAttribute")(rt.DeviceAttribute(2, cudart.DevAttrMemoryPoolsSupported)), "DeviceAttribute(2, 115)")
	u := must[cudart.UUID](t, "DeviceUUID")(rt.DeviceUUID(1))
	assert.Equal(t, "GPU-90919293-9495-9697-9899-9a9b9c9d9e9f", u.String(), "DeviceUUID(1)")
	assert.Equal(t, "0000:12:00.0", must[string](t, "DevicePCIBusID")(rt.DevicePCIBusID(2)), "DevicePCIBusID(2)")
	assert.True(t, must[bool](t, "DeviceCanAccessPeer")(rt.DeviceCanAccessPeer(0, 1)), "DeviceCanAccessPeer(0, 1)")
	assert.False(t, must[bool](t, "DeviceCanAccessPeer")(rt.DeviceCanAccessPeer(1, 0)), "DeviceCanAccessPeer(1, 0)")
	free, total, err := rt.MemGetInfo(2)
	if assert.NoError(t, err, "MemGetInfo(2)") {
		assert.Equal(t, uint64(3<<33), free, "MemGetInfo(2) free")
		assert.Equal(t, uint64(3<<34), total, "MemGetInfo(2) total")
	}
	for _, tc := range []struct {
		dev         int
		ht          cudart.HandleType
		recommended bool
		want        uint64
	}{
		{1, cudart.HandleTypePosixFD, false, 2<<20 + 1*4096 + 1*16},
		{2, cudart.HandleTypeFabric, true, 4<<20 + 8*4096 + 2*16},
	} {
		g, err := rt.AllocationGranularity(tc.dev, tc.ht, tc.recommended)
		if assert.NoError(t, err, "AllocationGranularity(%d, %v, %v)", tc.dev, tc.ht, tc.recommended) {
			assert.Equal(t, tc.want, g, "AllocationGranularity(%d, %v, %v)", tc.dev, tc.ht, tc.recommended)
		}
	}
}

func TestFakePoolPropertiesAttributesAndAccess(t *testing.T) {
	rt := loadFake(t)
	const dev = 2
	p := must[cudart.MemPool](t, "MemPoolCreate")(rt.MemPoolCreate(cudart.PoolProps{
		HandleTypes: cudart.HandleTypePosixFD | cudart.HandleTypeFabric,
		Location:    cudart.DeviceLocation(dev),
		MaxSize:     3 << 20,
	}))
	s := must[cudart.Stream](t, "StreamCreate")(rt.StreamCreate(dev, cudart.StreamNonBlocking))
	attr := func(a cudart.PoolAttr) uint64 {
		t.Helper()
		return must[uint64](t, fmt.Sprint("MemPoolGetAttribute ", a))(rt.MemPoolGetAttribute(dev, p, a))
	}
	assert.Equal(t, uint64(0x123456789abc), attr(cudart.PoolReleaseThreshold), "release threshold")
	assert.Equal(t, uint64(1), attr(cudart.PoolReuseAllowOpportunistic), "an int attribute")
	require.NoError(t, rt.MemPoolSetAttribute(dev, p, cudart.PoolReuseAllowOpportunistic, 0), "set an int attribute")
	require.NoError(t, rt.MemPoolSetAttribute(dev, p, cudart.PoolReleaseThreshold, 1<<40+5), "set a uint64 attribute")
	assert.Equal(t, uint64(0), attr(cudart.PoolReuseAllowOpportunistic), "the int attribute read back")
	assert.Equal(t, uint64(1<<40+5), attr(cudart.PoolReleaseThreshold), "the uint64 attribute read back")
	wantError(t, rt.MemPoolSetAttribute(dev, p, cudart.PoolReservedMemCurrent, 1), "cudaMemPoolSetAttribute", cudart.ErrInvalidValue)

	// maxSize arrives: 2 MiB fits in 3 MiB, 2 MiB more does not.
	ptr := must[cudart.DevicePtr](t, "MallocFromPoolAsync")(rt.MallocFromPoolAsync(dev, 2<<20, p, s))
	_, err := rt.MallocFromPoolAsync(dev, 2<<20, p, s)
	wantError(t, err, "cudaMallocFromPoolAsync", cudart.ErrOutOfMemory)
	assert.Equal(t, uint64(2<<20), attr(cudart.PoolUsedMemCurrent), "used")
	assert.Equal(t, uint64(2<<20), attr(cudart.PoolUsedMemHigh), "used high")
	require.NoError(t, rt.FreeAsync(dev, ptr, s), "FreeAsync")
	require.NoError(t, rt.MemPoolTrimTo(dev, p, 1<<20), "MemPoolTrimTo")
	assert.Equal(t, uint64(1<<20), attr(cudart.PoolReservedMemCurrent), "reserved after trimming to 1 MiB")
	require.NoError(t, rt.MemPoolSetAttribute(dev, p, cudart.PoolUsedMemHigh, 0), "reset the used high-water mark")
	assert.Equal(t, uint64(0), attr(cudart.PoolUsedMemHigh), "used high after reset")

	access := func(d int) cudart.AccessFlags {
		t.Helper()
		return must[cudart.AccessFlags](t, "MemPoolGetAccess")(rt.MemPoolGetAccess(dev, p, cudart.DeviceLocation(d)))
	}
	assert.Equal(t, cudart.AccessReadWrite, access(dev), "own access before SetAccess")
	assert.Equal(t, cudart.AccessNone, access(0), "device 0's access before SetAccess")
	require.NoError(t, rt.MemPoolSetAccess(dev, p, []cudart.AccessDesc{
		{Location: cudart.DeviceLocation(0), Flags: cudart.AccessRead},
		{Location: cudart.DeviceLocation(1), Flags: cudart.AccessReadWrite},
	}), "MemPoolSetAccess")
	assert.Equal(t, cudart.AccessRead, access(0), "device 0's access after SetAccess")
	assert.Equal(t, cudart.AccessReadWrite, access(1), "device 1's access after SetAccess")
	require.NoError(t, rt.MemPoolSetAccess(dev, p, nil), "MemPoolSetAccess of nothing")
	err = rt.MemPoolSetAccess(dev, p, []cudart.AccessDesc{{Location: cudart.DeviceLocation(0), Flags: cudart.AccessNone}})
	wantError(t, err, "cudaMemPoolSetAccess", cudart.ErrInvalidDevice)

	// The fake refuses a pool used without its device current: dev is honoured.
	_, err = rt.MemPoolGetAttribute(0, p, cudart.PoolUsedMemCurrent)
	wantError(t, err, "cudaMemPoolGetAttribute", cudart.ErrInvalidResourceHandle)

	def := must[cudart.MemPool](t, "DeviceGetDefaultMemPool")(rt.DeviceGetDefaultMemPool(1))
	wantError(t, rt.MemPoolDestroy(1, def), "cudaMemPoolDestroy", cudart.ErrInvalidResourceHandle)
	require.NoError(t, rt.MemPoolDestroy(dev, p), "MemPoolDestroy")
	wantError(t, rt.MemPoolDestroy(dev, p), "cudaMemPoolDestroy", cudart.ErrInvalidResourceHandle)
	require.NoError(t, rt.StreamDestroy(dev, s), "StreamDestroy")
}

// newPool is a pool on dev that can be shared as a POSIX fd or a fabric handle.
func newPool(t *testing.T, rt cudart.Runtime, dev int) cudart.MemPool {
	t.Helper()
	return must[cudart.MemPool](t, "MemPoolCreate")(rt.MemPoolCreate(cudart.PoolProps{
		HandleTypes: cudart.HandleTypePosixFD | cudart.HandleTypeFabric,
		Location:    cudart.DeviceLocation(dev),
	}))
}

func TestFakeCopiesAndSetsMoveBytes(t *testing.T) {
	rt := loadFake(t)
	p0, p1 := newPool(t, rt, 0), newPool(t, rt, 1)
	s0 := must[cudart.Stream](t, "StreamCreate")(rt.StreamCreate(0, cudart.StreamDefault))
	a := must[cudart.DevicePtr](t, "MallocFromPoolAsync")(rt.MallocFromPoolAsync(0, 64, p0, s0))
	b := must[cudart.DevicePtr](t, "MallocFromPoolAsync")(rt.MallocFromPoolAsync(1, 64, p1, 0))

	src := pattern(64, 1)
	require.NoError(t, rt.MemcpyHtoDAsync(0, a, src, s0), "MemcpyHtoDAsync")
	require.NoError(t, rt.MemsetAsync(1, b, 0x5a, 64, 0), "MemsetAsync")
	require.NoError(t, rt.MemcpyDtoDAsync(1, b+8, a+16, 32, 0), "MemcpyDtoDAsync")
	got := make([]byte, 64)
	require.NoError(t, rt.MemcpyDtoHAsync(1, got, b, 0), "MemcpyDtoHAsync")
	want := bytes.Repeat([]byte{0x5a}, 64)
	copy(want[8:40], src[16:48])
	require.Equal(t, want, got, "device bytes")
	err := rt.MemcpyHtoDAsync(0, a+60, src[:8], s0) // past the end of a
	wantError(t, err, "cudaMemcpyAsync", cudart.ErrInvalidValue)
	require.NoError(t, rt.FreeAsync(0, a, s0), "FreeAsync")
	require.NoError(t, rt.FreeAsync(1, b, 0), "FreeAsync")
}

func TestFakeStreamsAndEvents(t *testing.T) {
	rt := loadFake(t)
	const dev = 1
	s := must[cudart.Stream](t, "StreamCreate")(rt.StreamCreate(dev, cudart.StreamNonBlocking))
	e := must[cudart.Event](t, "EventCreate")(rt.EventCreate(dev, cudart.EventDisableTiming))
	query := func(want bool) {
		t.Helper()
		require.Equal(t, want, must[bool](t, "EventQuery")(rt.EventQuery(dev, e)), "EventQuery")
	}
	query(true)
	require.NoError(t, rt.EventRecord(dev, e, s), "EventRecord")
	query(false)
	require.NoError(t, rt.StreamSynchronize(dev, s), "StreamSynchronize")
	query(true)
	require.NoError(t, rt.EventRecord(dev, e, s), "EventRecord")
	query(false)
	require.NoError(t, rt.EventSynchronize(dev, e), "EventSynchronize")
	query(true)
	require.NoError(t, rt.StreamWaitEvent(dev, s, e), "StreamWaitEvent")

	_, err := rt.IpcGetEventHandle(dev, e)
	wantError(t, err, "cudaIpcGetEventHandle", cudart.ErrInvalidValue) // not an IPC event
	ipc := must[cudart.Event](t, "EventCreate")(rt.EventCreate(dev, cudart.EventIPC))
	h := must[cudart.IpcEventHandle](t, "IpcGetEventHandle")(rt.IpcGetEventHandle(dev, ipc))
	opened := must[cudart.Event](t, "IpcOpenEventHandle")(rt.IpcOpenEventHandle(2, h))
	require.NoError(t, rt.EventRecord(2, opened, 0), "EventRecord of the opened event on its device")
	wantError(t, rt.EventRecord(dev, opened, 0), "cudaEventRecord", cudart.ErrInvalidResourceHandle)
	h[63] ^= 1
	_, err = rt.IpcOpenEventHandle(2, h)
	wantError(t, err, "cudaIpcOpenEventHandle", cudart.ErrInvalidValue)

	for _, ev := range []struct {
		dev int
		e   cudart.Event
	}{{dev, e}, {dev, ipc}, {2, opened}} {
		require.NoError(t, rt.EventDestroy(ev.dev, ev.e), "EventDestroy")
	}
	wantError(t, rt.EventDestroy(dev, e), "cudaEventDestroy", cudart.ErrInvalidResourceHandle)
	require.NoError(t, rt.StreamDestroy(dev, s), "StreamDestroy")
	wantError(t, rt.StreamDestroy(dev, s), "cudaStreamDestroy", cudart.ErrInvalidResourceHandle)
}

// StreamNotify passes the stream and the eventfd through cudaLaunchHostFunc to a host
// function that adds 1 to the eventfd: the fake runs it at once, so each call adds 1,
// on the fd given and no other.
func TestFakeStreamNotifyWritesTheEventfd(t *testing.T) {
	rt := loadFake(t)
	const dev = 1
	s := must[cudart.Stream](t, "StreamCreate")(rt.StreamCreate(dev, cudart.StreamNonBlocking))
	fds := []int{eventfdtest.New(t), eventfdtest.New(t)}
	total := func(fd int) uint64 { return eventfdtest.Take(t, fd, false) }
	for range 3 {
		require.NoError(t, rt.StreamNotify(dev, s, fds[1]), "StreamNotify")
	}
	require.NoError(t, rt.StreamNotify(dev, 0, fds[0]), "StreamNotify on the legacy stream")
	require.Equal(t, uint64(1), total(fds[0]), "the first eventfd's total")
	require.Equal(t, uint64(3), total(fds[1]), "the second eventfd's total")
	gone := must[cudart.Stream](t, "StreamCreate")(rt.StreamCreate(dev, cudart.StreamNonBlocking))
	require.NoError(t, rt.StreamDestroy(dev, gone), "StreamDestroy")
	wantError(t, rt.StreamNotify(dev, gone, fds[0]), "cudaLaunchHostFunc", cudart.ErrInvalidResourceHandle)
	require.ErrorIs(t, rt.StreamNotify(dev, s, -1), cudart.ErrInvalidValue, "a negative fd")
	require.Equal(t, uint64(0), total(fds[0]), "a refused call writes nothing")
}

func TestFakeSharingRoundTrips(t *testing.T) {
	rt := loadFake(t)
	pool := newPool(t, rt, 0)
	s := must[cudart.Stream](t, "StreamCreate")(rt.StreamCreate(0, cudart.StreamDefault))
	ptr := must[cudart.DevicePtr](t, "MallocFromPoolAsync")(rt.MallocFromPoolAsync(0, 4096, pool, s))
	src := pattern(4096, 9)
	require.NoError(t, rt.MemcpyHtoDAsync(0, ptr, src, s), "MemcpyHtoDAsync")

	_, err := rt.MemPoolExportPointer(0, ptr)
	wantError(t, err, "cudaMemPoolExportPointer", cudart.ErrInvalidValue) // the pool is not exported yet

	h := must[cudart.ShareableHandle](t, "export as POSIX fd")(rt.MemPoolExportToShareableHandle(0, pool, cudart.HandleTypePosixFD))
	require.Equal(t, cudart.HandleTypePosixFD, h.Type, "exported handle %+v", h)
	require.GreaterOrEqual(t, h.FD, 0, "exported handle %+v", h)
	require.Zero(t, h.Fabric, "exported handle %+v", h)
	imported := must[cudart.MemPool](t, "import from POSIX fd")(rt.MemPoolImportFromShareableHandle(1, h))
	_, err = unix.FcntlInt(uintptr(h.FD), unix.F_GETFD, 0)
	require.NoError(t, err, "import closed the caller's fd")
	require.NoError(t, unix.Close(h.FD), "close the exported fd")

	data := must[cudart.PtrExportData](t, "MemPoolExportPointer")(rt.MemPoolExportPointer(0, ptr))
	again := must[cudart.PtrExportData](t, "MemPoolExportPointer")(rt.MemPoolExportPointer(0, ptr))
	require.Equal(t, data, again, "exporting the same pointer twice gave different data")
	got := must[cudart.DevicePtr](t, "MemPoolImportPointer")(rt.MemPoolImportPointer(1, imported, data))
	require.Equal(t, ptr, got, "imported %#x, want the exporter's address %#x", got, ptr)
	read := make([]byte, len(src))
	require.NoError(t, rt.MemcpyDtoHAsync(1, read, got, 0), "read the import")
	require.True(t, bytes.Equal(read, src), "the import reads other bytes than were written")
	var junk cudart.PtrExportData
	for i := range junk {
		junk[i] = 0x3c
	}
	_, err = rt.MemPoolImportPointer(1, imported, junk)
	wantError(t, err, "cudaMemPoolImportPointer", cudart.ErrInvalidValue)
	_, err = rt.MallocFromPoolAsync(1, 64, imported, 0)
	wantError(t, err, "cudaMallocFromPoolAsync", cudart.ErrInvalidValue)
	require.NoError(t, rt.FreeAsync(1, got, 0), "free the import")
	require.NoError(t, rt.FreeAsync(0, ptr, s), "free the original")
	wantError(t, rt.FreeAsync(0, ptr, s), "cudaFreeAsync", cudart.ErrInvalidValue)

	fh := must[cudart.ShareableHandle](t, "export as fabric")(rt.MemPoolExportToShareableHandle(0, pool, cudart.HandleTypeFabric))
	require.Equal(t, cudart.HandleTypeFabric, fh.Type, "fabric handle %+v", fh)
	require.Equal(t, -1, fh.FD, "fabric handle %+v", fh)
	require.NotZero(t, fh.Fabric, "fabric handle %+v", fh)
	fabricImport := must[cudart.MemPool](t, "import from fabric")(rt.MemPoolImportFromShareableHandle(2, fh))
	require.NoError(t, rt.MemPoolDestroy(2, fabricImport), "destroy the fabric import")
	fh.Fabric[40] ^= 1
	_, err = rt.MemPoolImportFromShareableHandle(2, fh)
	wantError(t, err, "cudaMemPoolImportFromShareableHandle", cudart.ErrInvalidValue)
}

// refused checks an error that cudapool makes before calling CUDA, named from its own
// table with a reason of its own.
func refused(t *testing.T, err error, op, reason string) {
	t.Helper()
	var e *cudart.Error
	require.ErrorAs(t, err, &e, "want %s refused with %q", op, reason)
	require.Equal(t, op, e.Op, "want %s refused with %q, got %v", op, reason, err)
	require.Equal(t, cudart.ErrInvalidValue, e.Code, "want %s refused with %q, got %v", op, reason, err)
	require.Equal(t, "cudaErrorInvalidValue", e.Name, "want %s refused with %q, got %v", op, reason, err)
	require.Contains(t, e.Text, reason, "want %s refused with %q, got %v", op, reason, err)
}

func TestFakeBadArgumentsGetClearErrors(t *testing.T) {
	rt := loadFake(t)
	pool := newPool(t, rt, 0)

	_, err := rt.StreamCreate(7, 0)
	wantError(t, err, "cudaSetDevice (for cudaStreamCreateWithFlags)", cudart.ErrInvalidDevice)
	for _, dev := range []int{-1, 1 << 40} {
		_, err = rt.StreamCreate(dev, 0)
		wantError(t, err, "cudaStreamCreateWithFlags", cudart.ErrInvalidDevice)
		_, err = rt.DeviceAttribute(dev, cudart.DevAttrPciBusID)
		wantError(t, err, "cudaDeviceGetAttribute", cudart.ErrInvalidDevice)
	}
	_, err = rt.DeviceUUID(9)
	wantError(t, err, "cuDeviceGet (for cuDeviceGetUuid)", cudart.ErrInvalidDevice)

	_, err = rt.MemPoolGetAttribute(0, pool, 9)
	refused(t, err, "cudaMemPoolGetAttribute", "unknown pool attribute 9")
	err = rt.MemPoolSetAttribute(0, pool, 0, 1)
	refused(t, err, "cudaMemPoolSetAttribute", "unknown pool attribute 0")
	err = rt.MemPoolSetAttribute(0, pool, cudart.PoolReuseFollowEventDependencies, 1<<33)
	refused(t, err, "cudaMemPoolSetAttribute", "does not fit")
	_, err = rt.MemPoolExportToShareableHandle(0, pool, cudart.HandleTypeNone)
	refused(t, err, "cudaMemPoolExportToShareableHandle", "handle type none")
	_, err = rt.MemPoolImportFromShareableHandle(0, cudart.ShareableHandle{Type: 0x2, FD: 5})
	refused(t, err, "cudaMemPoolImportFromShareableHandle", "handle type HandleType(0x2)")
	_, err = rt.MemPoolImportFromShareableHandle(0, cudart.ShareableHandle{Type: cudart.HandleTypePosixFD, FD: -1})
	refused(t, err, "cudaMemPoolImportFromShareableHandle", "-1 is not a file descriptor")
}

// Every call that runs on or names the poisoned device fails with the code the fake
// derives from the C function's name: each method reaches its own entry point, and
// the error names it with the library's own words.
func TestFakeErrorsNameTheFailingCall(t *testing.T) {
	rt := loadFake(t)
	const d = poisonedDevice
	h := must[cudart.ShareableHandle](t, "export")(rt.MemPoolExportToShareableHandle(0, newPool(t, rt, 0), cudart.HandleTypePosixFD))
	t.Cleanup(func() { _ = unix.Close(h.FD) }) // test cleanup
	buf := make([]byte, 8)
	discard := func(_ any, err error) error { return err }
	for _, tc := range []struct {
		op, fn string // fn, the C function, where it is not op
		call   func() error
	}{
		{"cudaDeviceGetAttribute", "", func() error { return discard(rt.DeviceAttribute(d, 1)) }},
		{"cuDeviceGetUuid", "cuDeviceGetUuid_v2", func() error { return discard(rt.DeviceUUID(d)) }},
		{"cudaDeviceGetPCIBusId", "", func() error { return discard(rt.DevicePCIBusID(d)) }},
		{"cudaDeviceCanAccessPeer", "", func() error { return discard(rt.DeviceCanAccessPeer(0, d)) }},
		{"cudaMemGetInfo", "", func() error { _, _, err := rt.MemGetInfo(d); return err }},
		{"cuMemGetAllocationGranularity", "", func() error { return discard(rt.AllocationGranularity(d, cudart.HandleTypePosixFD, false)) }},
		{"cudaStreamCreateWithFlags", "", func() error { return discard(rt.StreamCreate(d, 0)) }},
		{"cudaStreamDestroy", "", func() error { return rt.StreamDestroy(d, 1) }},
		{"cudaStreamSynchronize", "", func() error { return rt.StreamSynchronize(d, 0) }},
		{"cudaStreamWaitEvent", "", func() error { return rt.StreamWaitEvent(d, 0, 1) }},
		{"cudaStreamGetDevice", "", func() error { return discard(rt.StreamDevice(d, 0)) }},
		{"cudaLaunchHostFunc", "", func() error { return rt.StreamNotify(d, 0, 0) }},
		{"cudaEventCreateWithFlags", "", func() error { return discard(rt.EventCreate(d, 0)) }},
		{"cudaEventDestroy", "", func() error { return rt.EventDestroy(d, 1) }},
		{"cudaEventRecord", "", func() error { return rt.EventRecord(d, 1, 0) }},
		{"cudaEventSynchronize", "", func() error { return rt.EventSynchronize(d, 1) }},
		{"cudaEventQuery", "", func() error { return discard(rt.EventQuery(d, 1)) }},
		{"cudaIpcGetEventHandle", "", func() error { return discard(rt.IpcGetEventHandle(d, 1)) }},
		{"cudaIpcOpenEventHandle", "", func() error { return discard(rt.IpcOpenEventHandle(d, cudart.IpcEventHandle{})) }},
		{"cudaMemPoolCreate", "", func() error {
			return discard(rt.MemPoolCreate(cudart.PoolProps{HandleTypes: cudart.HandleTypePosixFD, Location: cudart.DeviceLocation(d)}))
		}},
		{"cudaMemPoolDestroy", "", func() error { return rt.MemPoolDestroy(d, 1) }},
		{"cudaDeviceGetDefaultMemPool", "", func() error { return discard(rt.DeviceGetDefaultMemPool(d)) }},
		{"cudaMemPoolGetAttribute", "", func() error { return discard(rt.MemPoolGetAttribute(d, 1, cudart.PoolUsedMemHigh)) }},
		{"cudaMemPoolSetAttribute", "", func() error { return rt.MemPoolSetAttribute(d, 1, cudart.PoolReleaseThreshold, 1) }},
		{"cudaMemPoolSetAccess", "", func() error { return rt.MemPoolSetAccess(d, 1, nil) }},
		{"cudaMemPoolGetAccess", "", func() error { return discard(rt.MemPoolGetAccess(d, 1, cudart.DeviceLocation(0))) }},
		{"cudaMemPoolTrimTo", "", func() error { return rt.MemPoolTrimTo(d, 1, 0) }},
		{"cudaMallocFromPoolAsync", "", func() error { return discard(rt.MallocFromPoolAsync(d, 1, 1, 0)) }},
		{"cudaFreeAsync", "", func() error { return rt.FreeAsync(d, 1, 0) }},
		{"cudaMemPoolExportToShareableHandle", "", func() error { return discard(rt.MemPoolExportToShareableHandle(d, 1, cudart.HandleTypePosixFD)) }},
		{"cudaMemPoolImportFromShareableHandle", "", func() error { return discard(rt.MemPoolImportFromShareableHandle(d, h)) }},
		{"cudaMemPoolExportPointer", "", func() error { return discard(rt.MemPoolExportPointer(d, 1)) }},
		{"cudaMemPoolImportPointer", "", func() error { return discard(rt.MemPoolImportPointer(d, 1, cudart.PtrExportData{})) }},
		{"cudaMemcpyAsync", "", func() error { return rt.MemcpyHtoDAsync(d, 1, buf, 0) }},
		{"cudaMemcpyAsync", "", func() error { return rt.MemcpyDtoHAsync(d, buf, 1, 0) }},
		{"cudaMemcpyAsync", "", func() error { return rt.MemcpyDtoDAsync(d, 1, 2, 8, 0) }},
		{"cudaMemsetAsync", "", func() error { return rt.MemsetAsync(d, 1, 0, 8, 0) }},
	} {
		fn := tc.fn
		if fn == "" {
			fn = tc.op
		}
		wantError(t, tc.call(), tc.op, poisonCode(fn))
	}
}

// Each call makes its own device current, or works on its own device without it:
// on a thread where another device is current, every device-dependent method still
// works on objects of its own device (the fake refuses them otherwise), whatever the
// call before it left current.
func TestFakeEveryCallMakesItsDeviceCurrent(t *testing.T) {
	rt := loadFake(t)
	runtime.LockOSThread()
	defer runtime.UnlockOSThread()
	const dev, other = 1, 2
	var (
		s, s2      cudart.Stream
		e, ipc, op cudart.Event
		pool, imp  cudart.MemPool
		ptr, got   cudart.DevicePtr
		h          cudart.ShareableHandle
		data       cudart.PtrExportData
		eh         cudart.IpcEventHandle
		err        error
	)
	buf := make([]byte, 64)
	for _, step := range []struct {
		name string
		call func() error
	}{
		{"MemGetInfo", func() error {
			free, _, err := rt.MemGetInfo(dev)
			if err == nil && free != 2<<33 {
				err = fmt.Errorf("free %d is another device's", free)
			}
			return err
		}},
		{"StreamCreate", func() error { s, err = rt.StreamCreate(dev, 0); return err }},
		{"StreamCreate", func() error { s2, err = rt.StreamCreate(dev, 0); return err }},
		{"EventCreate", func() error { e, err = rt.EventCreate(dev, 0); return err }},
		{"EventCreate", func() error { ipc, err = rt.EventCreate(dev, cudart.EventIPC); return err }},
		{"EventRecord", func() error { return rt.EventRecord(dev, e, s) }},
		{"EventQuery", func() error { _, err := rt.EventQuery(dev, e); return err }},
		{"EventSynchronize", func() error { return rt.EventSynchronize(dev, e) }},
		{"StreamWaitEvent", func() error { return rt.StreamWaitEvent(dev, s2, e) }},
		{"StreamSynchronize", func() error { return rt.StreamSynchronize(dev, s) }},
		{"IpcGetEventHandle", func() error { eh, err = rt.IpcGetEventHandle(dev, ipc); return err }},
		{"IpcOpenEventHandle", func() error { op, err = rt.IpcOpenEventHandle(dev, eh); return err }},
		{"EventRecord of the opened event", func() error { return rt.EventRecord(dev, op, s) }},
		{"MemPoolCreate", func() error {
			pool, err = rt.MemPoolCreate(cudart.PoolProps{HandleTypes: cudart.HandleTypePosixFD, Location: cudart.DeviceLocation(dev)})
			return err
		}},
		{"MemPoolSetAttribute", func() error { return rt.MemPoolSetAttribute(dev, pool, cudart.PoolReleaseThreshold, 1) }},
		{"MemPoolGetAttribute", func() error { _, err := rt.MemPoolGetAttribute(dev, pool, cudart.PoolReleaseThreshold); return err }},
		{"MemPoolSetAccess", func() error { return rt.MemPoolSetAccess(dev, pool, nil) }},
		{"MemPoolGetAccess", func() error { _, err := rt.MemPoolGetAccess(dev, pool, cudart.DeviceLocation(0)); return err }},
		{"MemPoolTrimTo", func() error { return rt.MemPoolTrimTo(dev, pool, 0) }},
		{"MallocFromPoolAsync", func() error { ptr, err = rt.MallocFromPoolAsync(dev, 64, pool, s); return err }},
		{"MemsetAsync", func() error { return rt.MemsetAsync(dev, ptr, 1, 64, s) }},
		{"MemcpyHtoDAsync", func() error { return rt.MemcpyHtoDAsync(dev, ptr, buf, s) }},
		{"MemcpyDtoDAsync", func() error { return rt.MemcpyDtoDAsync(dev, ptr, ptr+32, 32, s) }},
		{"MemcpyDtoHAsync", func() error { return rt.MemcpyDtoHAsync(dev, buf, ptr, s) }},
		{"MemPoolExportToShareableHandle", func() error {
			h, err = rt.MemPoolExportToShareableHandle(dev, pool, cudart.HandleTypePosixFD)
			return err
		}},
		{"MemPoolImportFromShareableHandle", func() error { imp, err = rt.MemPoolImportFromShareableHandle(dev, h); _ = unix.Close(h.FD); return err }}, // test cleanup
		{"MemPoolExportPointer", func() error { data, err = rt.MemPoolExportPointer(dev, ptr); return err }},
		{"MemPoolImportPointer", func() error { got, err = rt.MemPoolImportPointer(dev, imp, data); return err }},
		{"FreeAsync of the import", func() error { return rt.FreeAsync(dev, got, s) }},
		{"FreeAsync", func() error { return rt.FreeAsync(dev, ptr, s) }},
		{"MemPoolDestroy of the import", func() error { return rt.MemPoolDestroy(dev, imp) }},
		{"MemPoolDestroy", func() error { return rt.MemPoolDestroy(dev, pool) }},
		{"EventDestroy", func() error { return rt.EventDestroy(dev, e) }},
		{"StreamDestroy", func() error { return rt.StreamDestroy(dev, s) }},
	} {
		_, _, err := rt.MemGetInfo(other)
		require.NoError(t, err, "making device %d current", other)
		require.NoError(t, step.call(), "%s on device %d with device %d current", step.name, dev, other)
	}
}

// Goroutines on different devices share OS threads; each call must still run with
// its own device current, or the fake refuses the stream or pool of another device.
func TestFakeCurrentDeviceAcrossGoroutines(t *testing.T) {
	rt := loadFake(t)
	const devices, goroutines, rounds = 3, 12, 200
	pools := make([]cudart.MemPool, devices)
	for dev := range pools {
		pools[dev] = newPool(t, rt, dev)
	}
	round := func(dev int, buf []byte) error {
		s, err := rt.StreamCreate(dev, cudart.StreamNonBlocking)
		if err != nil {
			return err
		}
		ptr, err := rt.MallocFromPoolAsync(dev, uint64(len(buf)), pools[dev], s)
		if err != nil {
			return err
		}
		if err := rt.MemsetAsync(dev, ptr, byte(dev+1), uint64(len(buf)), s); err != nil {
			return err
		}
		if err := rt.MemcpyDtoHAsync(dev, buf, ptr, s); err != nil {
			return err
		}
		if !bytes.Equal(buf, bytes.Repeat([]byte{byte(dev + 1)}, len(buf))) {
			return fmt.Errorf("device %d read %x", dev, buf)
		}
		if err := rt.FreeAsync(dev, ptr, s); err != nil {
			return err
		}
		return rt.StreamDestroy(dev, s)
	}
	errs := make(chan error, goroutines)
	var wg sync.WaitGroup
	for g := range goroutines {
		wg.Add(1)
		go func() {
			defer wg.Done()
			buf := make([]byte, 32)
			for range rounds {
				if err := round(g%devices, buf); err != nil {
					errs <- err
					return
				}
				runtime.Gosched()
			}
		}()
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		assert.NoError(t, err)
	}
}

// The fake's own device attributes (testdata/fake.h).
const (
	fakeAttrLazyContexts   cudart.DeviceAttr = 90001
	fakeAttrGetDeviceCalls cudart.DeviceAttr = 90002
)

func fakeCount(t *testing.T, rt cudart.Runtime, dev int, attr cudart.DeviceAttr) int {
	t.Helper()
	return must[int](t, "the fake's count")(rt.DeviceAttribute(dev, attr))
}

// MallocFromPoolAsync, which CUDA runs on its stream's device, neither reads nor
// changes the thread's current device once the thread has a context: no
// cudaGetDevice, one C call. On the current device's stream (NULL) it still makes its
// device current, and every other call keeps the rule.
func TestFakeStreamAllocKeepsTheCurrentDevice(t *testing.T) {
	rt := loadFake(t)
	runtime.LockOSThread()
	defer runtime.UnlockOSThread()
	const dev, other = 1, 2
	pool := newPool(t, rt, dev)
	s := must[cudart.Stream](t, "StreamCreate")(rt.StreamCreate(dev, cudart.StreamNonBlocking))
	current := func() int { return must[int](t, "CurrentDevice")(cudart.CurrentDevice(rt)) }
	_, _, err := rt.MemGetInfo(other)
	require.NoError(t, err, "making device %d current", other)

	calls := fakeCount(t, rt, 0, fakeAttrGetDeviceCalls)
	ptr, err := rt.MallocFromPoolAsync(dev, 64, pool, s)
	require.NoError(t, err, "MallocFromPoolAsync")
	require.Equal(t, calls, fakeCount(t, rt, 0, fakeAttrGetDeviceCalls), "cudaGetDevice calls made by MallocFromPoolAsync on a created stream")
	require.Equal(t, other, current(), "the current device after MallocFromPoolAsync on device %d's stream", dev)
	require.NoError(t, rt.FreeAsync(dev, ptr, s), "FreeAsync")
	require.Equal(t, dev, current(), "the current device after FreeAsync, which keeps the rule")

	_, _, err = rt.MemGetInfo(other)
	require.NoError(t, err, "making device %d current", other)
	ptr, err = rt.MallocFromPoolAsync(dev, 64, pool, 0)
	require.NoError(t, err, "MallocFromPoolAsync on the legacy stream")
	require.Equal(t, dev, current(), "the current device after a call on the legacy stream")
	require.NoError(t, rt.FreeAsync(dev, ptr, 0), "FreeAsync on the legacy stream")
}

// A thread that has no context yet gets its call's device made current before a call
// on a stream, never the context CUDA would make for the default device 0: in a
// process that only uses device 1, that would take device 0's memory.
func TestFakeStreamCallsOnFreshThreadsMakeNoDefaultContext(t *testing.T) {
	rt := loadFake(t) // its own library: no thread has a context of it yet
	const dev, threads = 1, 6
	pool := newPool(t, rt, dev)
	s := must[cudart.Stream](t, "StreamCreate")(rt.StreamCreate(dev, cudart.StreamNonBlocking))
	// Each goroutine keeps its thread locked until the last one has called, so that
	// they run on threads of their own, most of them never used with this library.
	var called sync.WaitGroup
	called.Add(threads)
	errs := make(chan error, threads)
	for range threads {
		go func() {
			runtime.LockOSThread() // never unlocked: the thread ends with the goroutine
			ptr, err := rt.MallocFromPoolAsync(dev, 64, pool, s)
			if err == nil {
				err = rt.FreeAsync(dev, ptr, s)
			}
			cur, cerr := cudart.CurrentDevice(rt)
			if err == nil && cerr == nil && cur != dev {
				err = fmt.Errorf("device %d current after the calls, want %d", cur, dev)
			}
			errs <- errors.Join(err, cerr)
			called.Done()
			called.Wait()
		}()
	}
	for range threads {
		select {
		case err := <-errs:
			require.NoError(t, err)
		case <-time.After(time.Minute):
			t.Fatal("a goroutine's calls did not return within a minute")
		}
	}
	require.Zero(t, fakeCount(t, rt, 0, fakeAttrLazyContexts), "contexts of device 0 made by calls on device %d's stream", dev)
}

// The calls a pool makes per buffer allocate nothing in Go.
func TestFakeHotPathDoesNotAllocate(t *testing.T) {
	rt := loadFake(t)
	pool := newPool(t, rt, 0)
	s := must[cudart.Stream](t, "StreamCreate")(rt.StreamCreate(0, cudart.StreamNonBlocking))
	e := must[cudart.Event](t, "EventCreate")(rt.EventCreate(0, cudart.EventIPC))
	ptr := must[cudart.DevicePtr](t, "MallocFromPoolAsync")(rt.MallocFromPoolAsync(0, 256, pool, s))
	h := must[cudart.ShareableHandle](t, "export")(rt.MemPoolExportToShareableHandle(0, pool, cudart.HandleTypePosixFD))
	imported := must[cudart.MemPool](t, "import")(rt.MemPoolImportFromShareableHandle(1, h))
	_ = unix.Close(h.FD) // test cleanup
	data := must[cudart.PtrExportData](t, "MemPoolExportPointer")(rt.MemPoolExportPointer(0, ptr))

	var failed error
	keep := func(err error) {
		if err != nil && failed == nil {
			failed = err
		}
	}
	for _, tc := range []struct {
		name string
		f    func()
	}{
		{"MallocFromPoolAsync+FreeAsync", func() {
			p, err := rt.MallocFromPoolAsync(0, 256, pool, s)
			keep(err)
			keep(rt.FreeAsync(0, p, s))
		}},
		{"MemPoolImportPointer+FreeAsync", func() {
			p, err := rt.MemPoolImportPointer(1, imported, data)
			keep(err)
			keep(rt.FreeAsync(1, p, 0))
		}},
		{"EventRecord+StreamWaitEvent", func() {
			keep(rt.EventRecord(0, e, s))
			keep(rt.StreamWaitEvent(0, s, e))
		}},
	} {
		assert.Zero(t, testing.AllocsPerRun(200, tc.f), "%s allocates per run", tc.name)
	}
	require.NoError(t, failed, "hot path calls")
}

// BenchmarkFakeCall is the binding's own cost per call: one cgo crossing, the device
// check and a trivial C function (EventQuery of a never recorded event).
func BenchmarkFakeCall(b *testing.B) {
	rt := buildFake(b, nil, nil).load(b)
	e := must[cudart.Event](b, "EventCreate")(rt.EventCreate(0, cudart.EventDisableTiming))
	b.ReportAllocs()
	for b.Loop() {
		// Not require.NoError: its two t.Helper calls cost several times the call timed.
		if _, err := rt.EventQuery(0, e); err != nil {
			b.Fatal(err)
		}
	}
}
