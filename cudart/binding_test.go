//go:build cgo && linux

package cudart_test

import (
	"bytes"
	"errors"
	"fmt"
	"runtime"
	"strings"
	"sync"
	"testing"

	"golang.org/x/sys/unix"

	"github.com/cudapool/cudapool/cudart"
)

func TestFakeVersionsAndDevices(t *testing.T) {
	fake := buildFake(t, nil, nil)
	rt := fake.load(t)
	if want := fake.runtime + " (runtime 13000, driver 13010)"; rt.Name() != want {
		t.Errorf("Name() = %q, want %q", rt.Name(), want)
	}
	if n := must[int](t, "DeviceCount")(rt.DeviceCount()); n != 4 {
		t.Errorf("DeviceCount = %d, want 4", n)
	}
	if v := must[int](t, "DeviceAttribute")(rt.DeviceAttribute(2, cudart.DevAttrMemoryPoolsSupported)); v != 2115 {
		t.Errorf("DeviceAttribute(2, 115) = %d, want 2115", v)
	}
	u := must[cudart.UUID](t, "DeviceUUID")(rt.DeviceUUID(1))
	if want := "GPU-90919293-9495-9697-9899-9a9b9c9d9e9f"; u.String() != want {
		t.Errorf("DeviceUUID(1) = %s, want %s", u, want)
	}
	if id := must[string](t, "DevicePCIBusID")(rt.DevicePCIBusID(2)); id != "0000:12:00.0" {
		t.Errorf("DevicePCIBusID(2) = %q", id)
	}
	if can := must[bool](t, "DeviceCanAccessPeer")(rt.DeviceCanAccessPeer(0, 1)); !can {
		t.Error("DeviceCanAccessPeer(0, 1) = false, want true")
	}
	if can := must[bool](t, "DeviceCanAccessPeer")(rt.DeviceCanAccessPeer(1, 0)); can {
		t.Error("DeviceCanAccessPeer(1, 0) = true, want false")
	}
	free, total, err := rt.MemGetInfo(2)
	if err != nil || free != 3<<33 || total != 3<<34 {
		t.Errorf("MemGetInfo(2) = %d, %d, %v; want %d, %d", free, total, err, uint64(3<<33), uint64(3<<34))
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
		if err != nil || g != tc.want {
			t.Errorf("AllocationGranularity(%d, %v, %v) = %d, %v; want %d", tc.dev, tc.ht, tc.recommended, g, err, tc.want)
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
	if v := attr(cudart.PoolReleaseThreshold); v != 0x123456789abc {
		t.Errorf("release threshold %#x, want 0x123456789abc", v)
	}
	if v := attr(cudart.PoolReuseAllowOpportunistic); v != 1 {
		t.Errorf("an int attribute reads %d, want 1", v)
	}
	noErr(t, "set an int attribute", rt.MemPoolSetAttribute(dev, p, cudart.PoolReuseAllowOpportunistic, 0))
	noErr(t, "set a uint64 attribute", rt.MemPoolSetAttribute(dev, p, cudart.PoolReleaseThreshold, 1<<40+5))
	if a, b := attr(cudart.PoolReuseAllowOpportunistic), attr(cudart.PoolReleaseThreshold); a != 0 || b != 1<<40+5 {
		t.Errorf("attributes read back %d and %#x, want 0 and %#x", a, b, uint64(1<<40+5))
	}
	wantError(t, rt.MemPoolSetAttribute(dev, p, cudart.PoolReservedMemCurrent, 1), "cudaMemPoolSetAttribute", cudart.ErrInvalidValue)

	// maxSize arrives: 2 MiB fits in 3 MiB, 2 MiB more does not.
	ptr := must[cudart.DevicePtr](t, "MallocFromPoolAsync")(rt.MallocFromPoolAsync(dev, 2<<20, p, s))
	_, err := rt.MallocFromPoolAsync(dev, 2<<20, p, s)
	wantError(t, err, "cudaMallocFromPoolAsync", cudart.ErrOutOfMemory)
	if used, high := attr(cudart.PoolUsedMemCurrent), attr(cudart.PoolUsedMemHigh); used != 2<<20 || high != 2<<20 {
		t.Errorf("used %d, high %d; want 2 MiB each", used, high)
	}
	noErr(t, "FreeAsync", rt.FreeAsync(dev, ptr, s))
	noErr(t, "MemPoolTrimTo", rt.MemPoolTrimTo(dev, p, 1<<20))
	if r := attr(cudart.PoolReservedMemCurrent); r != 1<<20 {
		t.Errorf("reserved %d after trimming to 1 MiB", r)
	}
	noErr(t, "reset the used high-water mark", rt.MemPoolSetAttribute(dev, p, cudart.PoolUsedMemHigh, 0))
	if high := attr(cudart.PoolUsedMemHigh); high != 0 {
		t.Errorf("used high %d after reset, want 0", high)
	}

	access := func(d int) cudart.AccessFlags {
		t.Helper()
		return must[cudart.AccessFlags](t, "MemPoolGetAccess")(rt.MemPoolGetAccess(dev, p, cudart.DeviceLocation(d)))
	}
	if a, b := access(dev), access(0); a != cudart.AccessReadWrite || b != cudart.AccessNone {
		t.Errorf("access before SetAccess: own %d, device 0 %d", a, b)
	}
	noErr(t, "MemPoolSetAccess", rt.MemPoolSetAccess(dev, p, []cudart.AccessDesc{
		{Location: cudart.DeviceLocation(0), Flags: cudart.AccessRead},
		{Location: cudart.DeviceLocation(1), Flags: cudart.AccessReadWrite},
	}))
	if a, b := access(0), access(1); a != cudart.AccessRead || b != cudart.AccessReadWrite {
		t.Errorf("access after SetAccess: device 0 %d, device 1 %d", a, b)
	}
	noErr(t, "MemPoolSetAccess of nothing", rt.MemPoolSetAccess(dev, p, nil))
	err = rt.MemPoolSetAccess(dev, p, []cudart.AccessDesc{{Location: cudart.DeviceLocation(0), Flags: cudart.AccessNone}})
	wantError(t, err, "cudaMemPoolSetAccess", cudart.ErrInvalidDevice)

	// The fake refuses a pool used without its device current: dev is honoured.
	_, err = rt.MemPoolGetAttribute(0, p, cudart.PoolUsedMemCurrent)
	wantError(t, err, "cudaMemPoolGetAttribute", cudart.ErrInvalidResourceHandle)

	def := must[cudart.MemPool](t, "DeviceGetDefaultMemPool")(rt.DeviceGetDefaultMemPool(1))
	wantError(t, rt.MemPoolDestroy(1, def), "cudaMemPoolDestroy", cudart.ErrInvalidResourceHandle)
	noErr(t, "MemPoolDestroy", rt.MemPoolDestroy(dev, p))
	wantError(t, rt.MemPoolDestroy(dev, p), "cudaMemPoolDestroy", cudart.ErrInvalidResourceHandle)
	noErr(t, "StreamDestroy", rt.StreamDestroy(dev, s))
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
	noErr(t, "MemcpyHtoDAsync", rt.MemcpyHtoDAsync(0, a, src, s0))
	noErr(t, "MemsetAsync", rt.MemsetAsync(1, b, 0x5a, 64, 0))
	noErr(t, "MemcpyDtoDAsync", rt.MemcpyDtoDAsync(1, b+8, a+16, 32, 0))
	got := make([]byte, 64)
	noErr(t, "MemcpyDtoHAsync", rt.MemcpyDtoHAsync(1, got, b, 0))
	want := bytes.Repeat([]byte{0x5a}, 64)
	copy(want[8:40], src[16:48])
	if !bytes.Equal(got, want) {
		t.Fatalf("device bytes\n got %x\nwant %x", got, want)
	}
	err := rt.MemcpyHtoDAsync(0, a+60, src[:8], s0) // past the end of a
	wantError(t, err, "cudaMemcpyAsync", cudart.ErrInvalidValue)
	noErr(t, "FreeAsync", rt.FreeAsync(0, a, s0))
	noErr(t, "FreeAsync", rt.FreeAsync(1, b, 0))
}

func TestFakeStreamsAndEvents(t *testing.T) {
	rt := loadFake(t)
	const dev = 1
	s := must[cudart.Stream](t, "StreamCreate")(rt.StreamCreate(dev, cudart.StreamNonBlocking))
	e := must[cudart.Event](t, "EventCreate")(rt.EventCreate(dev, cudart.EventDisableTiming))
	query := func(want bool) {
		t.Helper()
		if done := must[bool](t, "EventQuery")(rt.EventQuery(dev, e)); done != want {
			t.Fatalf("EventQuery = %v, want %v", done, want)
		}
	}
	query(true)
	noErr(t, "EventRecord", rt.EventRecord(dev, e, s))
	query(false)
	noErr(t, "StreamSynchronize", rt.StreamSynchronize(dev, s))
	query(true)
	noErr(t, "EventRecord", rt.EventRecord(dev, e, s))
	query(false)
	noErr(t, "EventSynchronize", rt.EventSynchronize(dev, e))
	query(true)
	noErr(t, "StreamWaitEvent", rt.StreamWaitEvent(dev, s, e))

	_, err := rt.IpcGetEventHandle(dev, e)
	wantError(t, err, "cudaIpcGetEventHandle", cudart.ErrInvalidValue) // not an IPC event
	ipc := must[cudart.Event](t, "EventCreate")(rt.EventCreate(dev, cudart.EventIPC))
	h := must[cudart.IpcEventHandle](t, "IpcGetEventHandle")(rt.IpcGetEventHandle(dev, ipc))
	opened := must[cudart.Event](t, "IpcOpenEventHandle")(rt.IpcOpenEventHandle(2, h))
	noErr(t, "EventRecord of the opened event on its device", rt.EventRecord(2, opened, 0))
	wantError(t, rt.EventRecord(dev, opened, 0), "cudaEventRecord", cudart.ErrInvalidResourceHandle)
	h[63] ^= 1
	_, err = rt.IpcOpenEventHandle(2, h)
	wantError(t, err, "cudaIpcOpenEventHandle", cudart.ErrInvalidValue)

	for _, ev := range []struct {
		dev int
		e   cudart.Event
	}{{dev, e}, {dev, ipc}, {2, opened}} {
		noErr(t, "EventDestroy", rt.EventDestroy(ev.dev, ev.e))
	}
	wantError(t, rt.EventDestroy(dev, e), "cudaEventDestroy", cudart.ErrInvalidResourceHandle)
	noErr(t, "StreamDestroy", rt.StreamDestroy(dev, s))
	wantError(t, rt.StreamDestroy(dev, s), "cudaStreamDestroy", cudart.ErrInvalidResourceHandle)
}

func TestFakeSharingRoundTrips(t *testing.T) {
	rt := loadFake(t)
	pool := newPool(t, rt, 0)
	s := must[cudart.Stream](t, "StreamCreate")(rt.StreamCreate(0, cudart.StreamDefault))
	ptr := must[cudart.DevicePtr](t, "MallocFromPoolAsync")(rt.MallocFromPoolAsync(0, 4096, pool, s))
	src := pattern(4096, 9)
	noErr(t, "MemcpyHtoDAsync", rt.MemcpyHtoDAsync(0, ptr, src, s))

	_, err := rt.MemPoolExportPointer(0, ptr)
	wantError(t, err, "cudaMemPoolExportPointer", cudart.ErrInvalidValue) // the pool is not exported yet

	h := must[cudart.ShareableHandle](t, "export as POSIX fd")(rt.MemPoolExportToShareableHandle(0, pool, cudart.HandleTypePosixFD))
	if h.Type != cudart.HandleTypePosixFD || h.FD < 0 || h.Fabric != (cudart.FabricHandle{}) {
		t.Fatalf("exported handle %+v", h)
	}
	imported := must[cudart.MemPool](t, "import from POSIX fd")(rt.MemPoolImportFromShareableHandle(1, h))
	if _, err := unix.FcntlInt(uintptr(h.FD), unix.F_GETFD, 0); err != nil {
		t.Fatalf("import closed the caller's fd: %v", err)
	}
	noErr(t, "close the exported fd", unix.Close(h.FD))

	data := must[cudart.PtrExportData](t, "MemPoolExportPointer")(rt.MemPoolExportPointer(0, ptr))
	if again := must[cudart.PtrExportData](t, "MemPoolExportPointer")(rt.MemPoolExportPointer(0, ptr)); again != data {
		t.Fatal("exporting the same pointer twice gave different data")
	}
	got := must[cudart.DevicePtr](t, "MemPoolImportPointer")(rt.MemPoolImportPointer(1, imported, data))
	if got != ptr {
		t.Fatalf("imported %#x, want the exporter's address %#x", got, ptr)
	}
	read := make([]byte, len(src))
	noErr(t, "read the import", rt.MemcpyDtoHAsync(1, read, got, 0))
	if !bytes.Equal(read, src) {
		t.Fatal("the import reads other bytes than were written")
	}
	var junk cudart.PtrExportData
	for i := range junk {
		junk[i] = 0x3c
	}
	_, err = rt.MemPoolImportPointer(1, imported, junk)
	wantError(t, err, "cudaMemPoolImportPointer", cudart.ErrInvalidValue)
	_, err = rt.MallocFromPoolAsync(1, 64, imported, 0)
	wantError(t, err, "cudaMallocFromPoolAsync", cudart.ErrInvalidValue)
	noErr(t, "free the import", rt.FreeAsync(1, got, 0))
	noErr(t, "free the original", rt.FreeAsync(0, ptr, s))
	wantError(t, rt.FreeAsync(0, ptr, s), "cudaFreeAsync", cudart.ErrInvalidValue)

	fh := must[cudart.ShareableHandle](t, "export as fabric")(rt.MemPoolExportToShareableHandle(0, pool, cudart.HandleTypeFabric))
	if fh.Type != cudart.HandleTypeFabric || fh.FD != -1 || fh.Fabric == (cudart.FabricHandle{}) {
		t.Fatalf("fabric handle %+v", fh)
	}
	fabricImport := must[cudart.MemPool](t, "import from fabric")(rt.MemPoolImportFromShareableHandle(2, fh))
	noErr(t, "destroy the fabric import", rt.MemPoolDestroy(2, fabricImport))
	fh.Fabric[40] ^= 1
	_, err = rt.MemPoolImportFromShareableHandle(2, fh)
	wantError(t, err, "cudaMemPoolImportFromShareableHandle", cudart.ErrInvalidValue)
}

// refused checks an error that cudapool makes before calling CUDA, named from its own
// table with a reason of its own.
func refused(t *testing.T, err error, op, reason string) {
	t.Helper()
	var e *cudart.Error
	if !errors.As(err, &e) || e.Op != op || e.Code != cudart.ErrInvalidValue || e.Name != "cudaErrorInvalidValue" || !strings.Contains(e.Text, reason) {
		t.Fatalf("want %s refused with %q, got %v", op, reason, err)
	}
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
	t.Cleanup(func() { unix.Close(h.FD) })
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

// Each call makes its own device current: on a thread where another device is
// current, every device-dependent method still works on objects of its own device
// (the fake refuses them otherwise), whatever the call before it left current.
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
		{"MemPoolImportFromShareableHandle", func() error { imp, err = rt.MemPoolImportFromShareableHandle(dev, h); unix.Close(h.FD); return err }},
		{"MemPoolExportPointer", func() error { data, err = rt.MemPoolExportPointer(dev, ptr); return err }},
		{"MemPoolImportPointer", func() error { got, err = rt.MemPoolImportPointer(dev, imp, data); return err }},
		{"FreeAsync of the import", func() error { return rt.FreeAsync(dev, got, s) }},
		{"FreeAsync", func() error { return rt.FreeAsync(dev, ptr, s) }},
		{"MemPoolDestroy of the import", func() error { return rt.MemPoolDestroy(dev, imp) }},
		{"MemPoolDestroy", func() error { return rt.MemPoolDestroy(dev, pool) }},
		{"EventDestroy", func() error { return rt.EventDestroy(dev, e) }},
		{"StreamDestroy", func() error { return rt.StreamDestroy(dev, s) }},
	} {
		if _, _, err := rt.MemGetInfo(other); err != nil {
			t.Fatalf("making device %d current: %v", other, err)
		}
		if err := step.call(); err != nil {
			t.Fatalf("%s on device %d with device %d current: %v", step.name, dev, other, err)
		}
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
		t.Error(err)
	}
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
	unix.Close(h.FD)
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
		if n := testing.AllocsPerRun(200, tc.f); n != 0 {
			t.Errorf("%s allocates %v times per run", tc.name, n)
		}
	}
	noErr(t, "hot path calls", failed)
}

// BenchmarkFakeCall is the binding's own cost per call: one cgo crossing, the device
// check and a trivial C function (EventQuery of a never recorded event).
func BenchmarkFakeCall(b *testing.B) {
	rt := buildFake(b, nil, nil).load(b)
	e := must[cudart.Event](b, "EventCreate")(rt.EventCreate(0, cudart.EventDisableTiming))
	b.ReportAllocs()
	for b.Loop() {
		if _, err := rt.EventQuery(0, e); err != nil {
			b.Fatal(err)
		}
	}
}
