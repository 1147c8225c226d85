package cudart_test

// GPU tests: the behaviour FACTS.md records, checked through this binding. They skip
// where no CUDA runtime loads (internal/gputest) and fail there instead under
// CUDAPOOL_REQUIRE_GPU=1.

import (
	"bytes"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"math/bits"
	"net"
	"os"
	"os/exec"
	"regexp"
	"runtime"
	"strconv"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"golang.org/x/sys/unix"

	"github.com/cudapool/cudapool/cudart"
	"github.com/cudapool/cudapool/internal/eventfdtest"
	"github.com/cudapool/cudapool/internal/gputest"
	"github.com/cudapool/cudapool/internal/proctest"
	"github.com/cudapool/cudapool/internal/unixfd"
)

const (
	KiB = 1 << 10
	MiB = 1 << 20

	// hangGuard bounds every wait on the other process of a pair; it only stops a
	// broken test from hanging, and no test depends on its length.
	hangGuard = 3 * time.Minute
)

var childRoles = map[string]func(args []string) int{
	"importer":       importerMain,
	"export-rule":    exportRuleMain,
	"dying-exporter": dyingExporterMain,
	"bench-exporter": benchExporterMain,
}

// gpuFixture is what most GPU tests need: the runtime, and a pool and stream on dev
// that are destroyed when the test ends.
type gpuFixture struct {
	rt     cudart.Runtime
	dev    int
	pool   cudart.MemPool
	stream cudart.Stream
}

func newGPUFixture(t testing.TB, rt cudart.Runtime, dev int, props cudart.PoolProps) *gpuFixture {
	t.Helper()
	props.Location = cudart.DeviceLocation(dev)
	f := &gpuFixture{rt: rt, dev: dev}
	f.pool = must[cudart.MemPool](t, "MemPoolCreate")(rt.MemPoolCreate(props))
	f.stream = must[cudart.Stream](t, "StreamCreate")(rt.StreamCreate(dev, cudart.StreamNonBlocking))
	t.Cleanup(func() {
		assert.NoError(t, rt.StreamSynchronize(dev, f.stream), "StreamSynchronize")
		assert.NoError(t, rt.StreamDestroy(dev, f.stream), "StreamDestroy")
		assert.NoError(t, rt.MemPoolDestroy(dev, f.pool), "MemPoolDestroy")
	})
	return f
}

func (f *gpuFixture) malloc(t testing.TB, size uint64) cudart.DevicePtr {
	t.Helper()
	return must[cudart.DevicePtr](t, "MallocFromPoolAsync")(f.rt.MallocFromPoolAsync(f.dev, size, f.pool, f.stream))
}

func (f *gpuFixture) free(t testing.TB, ptrs ...cudart.DevicePtr) {
	t.Helper()
	for _, p := range ptrs {
		require.NoError(t, f.rt.FreeAsync(f.dev, p, f.stream), "FreeAsync")
	}
	require.NoError(t, f.rt.StreamSynchronize(f.dev, f.stream), "StreamSynchronize")
}

// write puts data at p and waits for it to land.
func (f *gpuFixture) write(t testing.TB, p cudart.DevicePtr, data []byte) {
	t.Helper()
	require.NoError(t, f.rt.MemcpyHtoDAsync(f.dev, p, data, f.stream), "MemcpyHtoDAsync")
	require.NoError(t, f.rt.StreamSynchronize(f.dev, f.stream), "StreamSynchronize")
}

func (f *gpuFixture) read(t testing.TB, p cudart.DevicePtr, n int) []byte {
	t.Helper()
	b := make([]byte, n)
	require.NoError(t, f.rt.MemcpyDtoHAsync(f.dev, b, p, f.stream), "MemcpyDtoHAsync")
	return b
}

var ipcPool = cudart.PoolProps{HandleTypes: cudart.HandleTypePosixFD}

func TestGPUDeviceQueries(t *testing.T) {
	rt := gputest.Runtime(t)
	t.Log(rt.Name())
	drv := must[int](t, "DriverVersion")(rt.DriverVersion())
	run := must[int](t, "RuntimeVersion")(rt.RuntimeVersion())
	assert.GreaterOrEqual(t, drv, 12000, "driver %d, runtime %d: want CUDA 12 or later", drv, run)
	assert.GreaterOrEqual(t, run, 12000, "driver %d, runtime %d: want CUDA 12 or later", drv, run)
	n := must[int](t, "DeviceCount")(rt.DeviceCount())
	busID := regexp.MustCompile(`^[0-9a-fA-F]{4,8}:([0-9a-fA-F]{2}):[0-9a-fA-F]{2}\.[0-9a-fA-F]$`)
	uuids := map[cudart.UUID]int{}
	for dev := range n {
		attr := func(a cudart.DeviceAttr) int {
			t.Helper()
			return must[int](t, fmt.Sprint("DeviceAttribute ", a))(rt.DeviceAttribute(dev, a))
		}
		assert.Equal(t, 1, attr(cudart.DevAttrMemoryPoolsSupported), "device %d supports memory pools", dev)
		handles := cudart.HandleType(attr(cudart.DevAttrMemoryPoolSupportedHandles))
		assert.NotZero(t, handles&cudart.HandleTypePosixFD, "device %d pools cannot be shared as POSIX fds: handle types %#x", dev, int32(handles))
		u := must[cudart.UUID](t, "DeviceUUID")(rt.DeviceUUID(dev))
		assert.NotZero(t, u, "device %d UUID", dev)
		other, dup := uuids[u]
		assert.False(t, dup, "device %d UUID %s is also device %d's", dev, u, other)
		uuids[u] = dev
		pci := must[string](t, "DevicePCIBusID")(rt.DevicePCIBusID(dev))
		assert.True(t, pciBusMatches(busID.FindStringSubmatch(pci), attr(cudart.DevAttrPciBusID)),
			"device %d PCI bus id %q disagrees with its bus attribute %d", dev, pci, attr(cudart.DevAttrPciBusID))
		free, total, err := rt.MemGetInfo(dev)
		if assert.NoError(t, err, "MemGetInfo(%d)", dev) {
			assert.NotZero(t, free, "MemGetInfo(%d) free of %d", dev, total)
			assert.LessOrEqual(t, free, total, "MemGetInfo(%d): free above total", dev)
		}
		min := must[uint64](t, "AllocationGranularity")(rt.AllocationGranularity(dev, cudart.HandleTypePosixFD, false))
		rec := must[uint64](t, "AllocationGranularity")(rt.AllocationGranularity(dev, cudart.HandleTypePosixFD, true))
		// One check, not three: rec%min is only taken once min is a power of two.
		assert.True(t, bits.OnesCount64(min) == 1 && rec >= min && rec%min == 0,
			"device %d granularity: minimum %d, recommended %d", dev, min, rec)
		t.Logf("device %d: %s %s, cc %d.%d, handle types %#x, granularity %d/%d, %d of %d bytes free",
			dev, u, pci, attr(cudart.DevAttrComputeCapabilityMajor), attr(cudart.DevAttrComputeCapabilityMinor),
			int32(handles), min, rec, free, total)
	}
	for dev := 1; dev < n; dev++ {
		a, errA := rt.DeviceCanAccessPeer(0, dev)
		b, errB := rt.DeviceCanAccessPeer(dev, 0)
		assert.NoError(t, errA, "DeviceCanAccessPeer(0, %d)", dev)
		assert.NoError(t, errB, "DeviceCanAccessPeer(%d, 0)", dev)
		t.Logf("peer access 0->%d %v, %d->0 %v", dev, a, dev, b)
	}
}

// pciBusMatches reports whether a bus id's bus field (m[1], hex) is bus.
func pciBusMatches(m []string, bus int) bool {
	if m == nil {
		return false
	}
	v, err := strconv.ParseInt(m[1], 16, 32)
	return err == nil && int(v) == bus
}

func TestGPUPoolAttributesAndAccess(t *testing.T) {
	rt := gputest.Runtime(t)
	// A pool that is not shareable: IPC pools ignore the release threshold and trims.
	f := newGPUFixture(t, rt, 0, cudart.PoolProps{})
	attr := func(a cudart.PoolAttr) uint64 {
		t.Helper()
		return must[uint64](t, fmt.Sprint("MemPoolGetAttribute ", a))(rt.MemPoolGetAttribute(0, f.pool, a))
	}
	for a := cudart.PoolReuseFollowEventDependencies; a <= cudart.PoolUsedMemHigh; a++ {
		v := attr(a)
		if a.IsBool() {
			assert.LessOrEqual(t, v, uint64(1), "flag attribute %d", a)
		}
		t.Logf("attribute %d = %d", a, v)
	}
	require.NoError(t, rt.MemPoolSetAttribute(0, f.pool, cudart.PoolReuseAllowOpportunistic, 0), "clear a flag")
	require.NoError(t, rt.MemPoolSetAttribute(0, f.pool, cudart.PoolReleaseThreshold, 1<<40+MiB), "set the release threshold")
	assert.Equal(t, uint64(0), attr(cudart.PoolReuseAllowOpportunistic), "the flag read back")
	assert.Equal(t, uint64(1<<40+MiB), attr(cudart.PoolReleaseThreshold), "the threshold read back")
	p := f.malloc(t, MiB)
	require.NoError(t, rt.StreamSynchronize(0, f.stream), "StreamSynchronize")
	used, reserved := attr(cudart.PoolUsedMemCurrent), attr(cudart.PoolReservedMemCurrent)
	assert.GreaterOrEqual(t, used, uint64(MiB), "with 1 MiB allocated: used %d, reserved %d", used, reserved)
	assert.GreaterOrEqual(t, reserved, used, "with 1 MiB allocated: used %d, reserved %d", used, reserved)
	err := rt.MemPoolSetAttribute(0, f.pool, cudart.PoolReservedMemCurrent, 0)
	assert.ErrorIs(t, err, cudart.ErrInvalidValue, "setting the read-only reserved size")
	require.NoError(t, rt.MemPoolSetAttribute(0, f.pool, cudart.PoolUsedMemHigh, 0), "reset the used high-water mark")
	f.free(t, p)
	before := attr(cudart.PoolReservedMemCurrent)
	require.NoError(t, rt.MemPoolTrimTo(0, f.pool, 0), "MemPoolTrimTo")
	assert.LessOrEqual(t, attr(cudart.PoolReservedMemCurrent), before, "reserved grew on trimming")

	own := must[cudart.AccessFlags](t, "MemPoolGetAccess")(rt.MemPoolGetAccess(0, f.pool, cudart.DeviceLocation(0)))
	assert.Equal(t, cudart.AccessReadWrite, own, "own device access")
	if n, _ := rt.DeviceCount(); n < 2 {
		t.Log("one device: peer access not checked")
		return
	}
	if can, _ := rt.DeviceCanAccessPeer(1, 0); !can {
		t.Log("device 1 cannot reach device 0: peer access not checked")
		return
	}
	require.NoError(t, rt.MemPoolSetAccess(0, f.pool, []cudart.AccessDesc{{Location: cudart.DeviceLocation(1), Flags: cudart.AccessReadWrite}}), "MemPoolSetAccess")
	peer := must[cudart.AccessFlags](t, "MemPoolGetAccess")(rt.MemPoolGetAccess(0, f.pool, cudart.DeviceLocation(1)))
	assert.Equal(t, cudart.AccessReadWrite, peer, "device 1 access after granting read-write")
}

// FACTS 1: small buffers pack below the allocation granularity.
func TestGPUCopiesSetsAndPacking(t *testing.T) {
	rt := gputest.Runtime(t)
	f := newGPUFixture(t, rt, 0, ipcPool)
	a, b := f.malloc(t, MiB), f.malloc(t, MiB)
	src := pattern(MiB, 3)
	require.NoError(t, rt.MemcpyHtoDAsync(0, a, src, f.stream), "MemcpyHtoDAsync")
	require.NoError(t, rt.MemsetAsync(0, b, 0x11, MiB, f.stream), "MemsetAsync")
	require.NoError(t, rt.MemcpyDtoDAsync(0, b+4*KiB, a, 64*KiB, f.stream), "MemcpyDtoDAsync")
	want := bytes.Repeat([]byte{0x11}, MiB)
	copy(want[4*KiB:], src[:64*KiB])
	assert.True(t, bytes.Equal(f.read(t, b, MiB), want), "device bytes differ from what was copied and set")
	f.free(t, a, b)

	gran := must[uint64](t, "AllocationGranularity")(rt.AllocationGranularity(0, cudart.HandleTypePosixFD, false))
	granules := map[uint64]bool{}
	var small []cudart.DevicePtr
	for range 8 {
		p := f.malloc(t, 4*KiB)
		small = append(small, p)
		granules[uint64(p)/gran] = true
	}
	assert.Less(t, len(granules), len(small), "8 buffers of 4 KiB in as many granules of %d bytes: no packing (%#x)", gran, small)
	f.free(t, small...)
}

// StreamDevice tells each stream's device, from whichever device asks: export relies on
// it to refuse, at Open, a stream on another device than the Importer's.
func TestGPUStreamDevice(t *testing.T) {
	rt := gputest.Runtime(t)
	n := must[int](t, "DeviceCount")(rt.DeviceCount())
	if _, err := rt.StreamDevice(0, 0); errors.Is(err, cudart.ErrNotSupported) {
		t.Skipf("%s predates cudaStreamGetDevice (CUDA 12.8)", rt.Name())
	}
	for dev := range n {
		s := must[cudart.Stream](t, "StreamCreate")(rt.StreamCreate(dev, cudart.StreamNonBlocking))
		for asker := range n {
			got := must[int](t, "StreamDevice")(rt.StreamDevice(asker, s))
			assert.Equal(t, dev, got, "StreamDevice(%d, stream of device %d)", asker, dev)
		}
		got := must[int](t, "StreamDevice")(rt.StreamDevice(dev, 0))
		assert.Equal(t, dev, got, "StreamDevice(%d, null stream)", dev)
		require.NoError(t, rt.StreamDestroy(dev, s), "StreamDestroy")
	}
}

// MallocFromPoolAsync, which CUDA runs on its stream's device whatever device is
// current ("cudaMallocAsync ignores the current device/context"), works on device 1's
// pool and stream from a thread where device 0 is current and leaves device 0 current:
// the binding makes no cudaGetDevice or cudaSetDevice for it. The memory is device 1's
// pool's, and usable. The calls after it keep the rule: FreeAsync makes device 1
// current. On the legacy stream, the current device's, the allocation makes its device
// current too.
func TestGPUStreamAllocKeepsTheCurrentDevice(t *testing.T) {
	rt := gputest.Devices(t, 2)
	runtime.LockOSThread()
	defer runtime.UnlockOSThread()
	const dev, other = 1, 0
	f := newGPUFixture(t, rt, dev, ipcPool)
	current := func() int { return must[int](t, "CurrentDevice")(cudart.CurrentDevice(rt)) }
	makeOtherCurrent := func() {
		t.Helper()
		_, _, err := rt.MemGetInfo(other)
		require.NoError(t, err, "MemGetInfo, making device %d current", other)
		require.Equal(t, other, current(), "the current device after MemGetInfo(%d)", other)
	}

	makeOtherCurrent()
	ptr, err := rt.MallocFromPoolAsync(dev, MiB, f.pool, f.stream)
	require.NoError(t, err, "MallocFromPoolAsync on device %d's stream", dev)
	t.Cleanup(func() { f.free(t, ptr) })
	assert.Equal(t, other, current(), "the current device after MallocFromPoolAsync on device %d's stream", dev)
	want := pattern(MiB, 5)
	got := make([]byte, MiB)
	require.NoError(t, rt.MemcpyHtoDAsync(dev, ptr, want, f.stream), "MemcpyHtoDAsync")
	require.NoError(t, rt.MemcpyDtoHAsync(dev, got, ptr, f.stream), "MemcpyDtoHAsync")
	assert.True(t, bytes.Equal(want, got), "the bytes through the allocation")
	high := must[uint64](t, "MemPoolGetAttribute")(rt.MemPoolGetAttribute(dev, f.pool, cudart.PoolUsedMemHigh))
	assert.GreaterOrEqual(t, high, uint64(MiB), "device %d's pool served the allocation", dev)

	makeOtherCurrent()
	p2, err := rt.MallocFromPoolAsync(dev, MiB, f.pool, 0)
	require.NoError(t, err, "MallocFromPoolAsync on the legacy stream")
	assert.Equal(t, dev, current(), "the current device after an allocation on the legacy stream")
	require.NoError(t, rt.FreeAsync(dev, p2, 0), "FreeAsync on the legacy stream")
	require.NoError(t, rt.StreamSynchronize(dev, 0), "StreamSynchronize of the legacy stream")

	makeOtherCurrent()
	p3, err := rt.MallocFromPoolAsync(dev, MiB, f.pool, f.stream)
	require.NoError(t, err, "MallocFromPoolAsync on device %d's stream", dev)
	require.NoError(t, rt.FreeAsync(dev, p3, f.stream), "FreeAsync")
	assert.Equal(t, dev, current(), "the current device after FreeAsync, which keeps the rule")
}

func TestGPUEvents(t *testing.T) {
	rt := gputest.Runtime(t)
	f := newGPUFixture(t, rt, 0, ipcPool)
	s2 := must[cudart.Stream](t, "StreamCreate")(rt.StreamCreate(0, cudart.StreamNonBlocking))
	defer func() { _ = rt.StreamDestroy(0, s2) }() // test cleanup
	for _, flags := range []cudart.EventFlags{cudart.EventDisableTiming, cudart.EventIPC} {
		e := must[cudart.Event](t, "EventCreate")(rt.EventCreate(0, flags))
		assert.True(t, must[bool](t, "EventQuery")(rt.EventQuery(0, e)), "flags %#x: an event never recorded is not complete", flags)
		require.NoError(t, rt.EventRecord(0, e, f.stream), "EventRecord")
		require.NoError(t, rt.StreamWaitEvent(0, s2, e), "StreamWaitEvent")
		require.NoError(t, rt.EventSynchronize(0, e), "EventSynchronize")
		require.NoError(t, rt.StreamSynchronize(0, s2), "StreamSynchronize")
		assert.True(t, must[bool](t, "EventQuery")(rt.EventQuery(0, e)), "flags %#x: the event is not complete after EventSynchronize", flags)
		_, err := rt.IpcGetEventHandle(0, e)
		if flags == cudart.EventIPC {
			assert.NoError(t, err, "IpcGetEventHandle of an IPC event")
		} else {
			var cerr *cudart.Error
			assert.ErrorAs(t, err, &cerr, "IpcGetEventHandle of a non-IPC event: want a CUDA error")
		}
		require.NoError(t, rt.EventDestroy(0, e), "EventDestroy")
	}
}

// StreamNotify on the real runtime: the host function writes the eventfd once the
// work queued before it has completed, in stream order, so the bytes of the memsets
// before it are there when the host sees the count (read on another stream, with no
// wait of its own).
func TestGPUStreamNotify(t *testing.T) {
	rt := gputest.Runtime(t)
	f := newGPUFixture(t, rt, 0, ipcPool)
	s2 := must[cudart.Stream](t, "StreamCreate")(rt.StreamCreate(0, cudart.StreamNonBlocking))
	defer func() { _ = rt.StreamDestroy(0, s2) }() // test cleanup
	const size = 256 * MiB
	p := f.malloc(t, size)
	defer f.free(t, p)
	fd := eventfdtest.New(t)
	for i := range 8 {
		require.NoError(t, rt.MemsetAsync(0, p, byte(i+1), size, f.stream), "MemsetAsync")
	}
	start := time.Now()
	require.NoError(t, rt.StreamNotify(0, f.stream, fd), "StreamNotify")
	queued := time.Since(start)
	require.NoError(t, rt.MemsetAsync(0, p, 0x5a, size, f.stream), "MemsetAsync")
	require.NoError(t, rt.StreamNotify(0, f.stream, fd), "StreamNotify")
	var total uint64
	for total < 2 {
		total += eventfdtest.Take(t, fd, true)
	}
	t.Logf("StreamNotify took %v to queue; both points counted %v after the first was queued", queued, time.Since(start))
	require.Equal(t, uint64(2), total)
	b := make([]byte, 4096)
	require.NoError(t, rt.MemcpyDtoHAsync(0, b, p+cudart.DevicePtr(size-4096), s2), "MemcpyDtoHAsync on another stream")
	assert.Equal(t, bytes.Repeat([]byte{0x5a}, 4096), b, "the last memset's bytes, once its point was counted")
}

// FACTS 9, 11 and 12: what may be exported, and when. Each sequence runs in a child
// process and ends by destroying its pools, so that a crash ends one child, not the
// test binary: on the 2xH200 host (driver 580.159.04, no IMEX) cudaMemPoolDestroy of a
// FABRIC pool whose export had been refused (800) crashed with SIGSEGV, twice, while a
// FABRIC pool never exported was destroyed cleanly. A crash is a failure except in the
// sequence marked driverMayCrash, where it is recorded as the driver's.
func TestGPUExportRules(t *testing.T) {
	gputest.Runtime(t)
	for _, seq := range []struct {
		name           string
		driverMayCrash bool
	}{
		{"none-and-default", false},
		{"pointer-before-pool", false},
		{"fabric-unexported", false},
		{"fabric-refused", true},
	} {
		t.Run(seq.name, func(t *testing.T) {
			var stderr bytes.Buffer
			cmd := proctest.Command(t, "export-rule", seq.name)
			cmd.Stderr = io.MultiWriter(&stderr, os.Stderr)
			err := cmd.Run()
			crashed := bytes.Contains(stderr.Bytes(), []byte("signal arrived during cgo execution"))
			switch {
			case err == nil:
			case crashed && seq.driverMayCrash:
				t.Logf("the driver crashed in this sequence at the step above (%v)", err)
			default:
				assert.NoError(t, err, "sequence %s", seq.name)
			}
		})
	}
}

// exportRuleMain runs one sequence of TestGPUExportRules, saying each step before it
// takes it, so that a crash shows where.
func exportRuleMain(args []string) int {
	rt, err := cudart.Load()
	if err != nil || len(args) != 1 {
		fmt.Fprintln(os.Stderr, "child: want a runtime and one sequence:", err, args)
		return 1
	}
	c := &childChecks{}
	step := func(format string, a ...any) { fmt.Fprintf(os.Stderr, "child: "+format+"\n", a...) }
	newPool := func(ht cudart.HandleType) (cudart.MemPool, bool) {
		p, err := rt.MemPoolCreate(cudart.PoolProps{HandleTypes: ht, Location: cudart.DeviceLocation(0)})
		return p, c.check(err == nil, "creating a pool of handle type %v: %v", ht, err)
	}
	destroy := func(p cudart.MemPool, what string) {
		step("destroying %s", what)
		c.check(rt.MemPoolDestroy(0, p) == nil, "destroying %s", what)
		step("destroyed %s", what)
	}
	s, err := rt.StreamCreate(0, cudart.StreamNonBlocking)
	if !c.check(err == nil, "StreamCreate: %v", err) {
		return 1
	}
	alloc := func(p cudart.MemPool) cudart.DevicePtr {
		ptr, err := rt.MallocFromPoolAsync(0, MiB, p, s)
		c.check(err == nil && rt.StreamSynchronize(0, s) == nil, "allocating: %v", err)
		return ptr
	}
	free := func(ptr cudart.DevicePtr) {
		c.check(rt.FreeAsync(0, ptr, s) == nil && rt.StreamSynchronize(0, s) == nil, "freeing")
	}

	switch args[0] {
	case "none-and-default":
		plain, ok := newPool(cudart.HandleTypeNone)
		if !ok {
			return 1
		}
		p := alloc(plain)
		_, err := rt.MemPoolExportPointer(0, p)
		c.check(errors.Is(err, cudart.ErrInvalidValue), "exporting memory of a handle-type-none pool: %v, want invalid value", err)
		_, err = rt.MemPoolExportToShareableHandle(0, plain, cudart.HandleTypePosixFD)
		c.check(errors.Is(err, cudart.ErrInvalidValue), "exporting a handle-type-none pool: %v, want invalid value", err)
		free(p)
		def, err := rt.DeviceGetDefaultMemPool(0)
		if c.check(err == nil, "DeviceGetDefaultMemPool: %v", err) {
			d := alloc(def)
			_, err = rt.MemPoolExportPointer(0, d)
			c.check(errors.Is(err, cudart.ErrInvalidValue), "exporting memory of the default pool: %v, want invalid value", err)
			free(d)
		}
		destroy(plain, "a handle-type-none pool")

	case "pointer-before-pool":
		pool, ok := newPool(cudart.HandleTypePosixFD)
		if !ok {
			return 1
		}
		q := alloc(pool)
		_, err := rt.MemPoolExportPointer(0, q)
		c.check(errors.Is(err, cudart.ErrInvalidValue), "exporting a pointer before its pool: %v, want invalid value", err)
		h, err := rt.MemPoolExportToShareableHandle(0, pool, cudart.HandleTypePosixFD)
		if c.check(err == nil, "exporting the pool: %v", err) {
			_ = unix.Close(h.FD) // test cleanup
			first, err1 := rt.MemPoolExportPointer(0, q)
			again, err2 := rt.MemPoolExportPointer(0, q)
			c.check(err1 == nil && err2 == nil && first == again, "exporting the pointer twice: %v, %v, same bytes %v", err1, err2, first == again)
		}
		free(q)
		destroy(pool, "a POSIX-fd pool whose pointer export was refused before the pool's export")

	case "fabric-unexported", "fabric-refused":
		pool, ok := newPool(cudart.HandleTypeFabric)
		if !ok {
			return 1
		}
		if args[0] == "fabric-unexported" {
			destroy(pool, "a fabric pool never exported")
			break
		}
		fh, err := rt.MemPoolExportToShareableHandle(0, pool, cudart.HandleTypeFabric)
		switch {
		case err == nil:
			step("this host exports fabric handles (IMEX is set up): %x", fh.Fabric[:8])
		case errors.Is(err, cudart.ErrNotPermitted), errors.Is(err, cudart.ErrNotSupported):
			step("fabric export refused, as without IMEX: %v", err)
		default:
			c.check(false, "fabric export: %v", err)
		}
		destroy(pool, "a fabric pool after its export")

	default:
		c.check(false, "unknown sequence %q", args[0])
	}
	c.check(rt.StreamDestroy(0, s) == nil, "StreamDestroy")
	return c.status()
}

// FACTS 10: maxSize bounds a pool.
func TestGPUPoolMaxSize(t *testing.T) {
	rt := gputest.Runtime(t)
	f := newGPUFixture(t, rt, 0, cudart.PoolProps{HandleTypes: cudart.HandleTypePosixFD, MaxSize: 64 * MiB})
	p := f.malloc(t, 48*MiB)
	_, err := rt.MallocFromPoolAsync(0, 32*MiB, f.pool, f.stream)
	assert.ErrorIs(t, err, cudart.ErrOutOfMemory, "32 MiB more in a 64 MiB pool holding 48")
	f.free(t, p)
	newGPUFixture(t, rt, 0, cudart.PoolProps{HandleTypes: cudart.HandleTypePosixFD, MaxSize: 3 * MiB})
}

// startChild starts this test binary in role with a Unix socket to it on the child's
// fd 3, and returns the parent's end.
func startChild(t testing.TB, role string, args ...string) (*exec.Cmd, *net.UnixConn) {
	t.Helper()
	fds, err := unix.Socketpair(unix.AF_UNIX, unix.SOCK_STREAM, 0)
	require.NoError(t, err)
	unix.CloseOnExec(fds[0]) // the child gets its end as fd 3 through ExtraFiles
	unix.CloseOnExec(fds[1])
	child := os.NewFile(uintptr(fds[1]), "child socket")
	defer func() { _ = child.Close() }() // test cleanup
	parent := os.NewFile(uintptr(fds[0]), "parent socket")
	defer func() { _ = parent.Close() }() // test cleanup
	c, err := net.FileConn(parent)
	require.NoError(t, err)
	conn := c.(*net.UnixConn)
	t.Cleanup(func() { _ = conn.Close() })          // test cleanup
	_ = conn.SetDeadline(time.Now().Add(hangGuard)) // test cleanup
	cmd := proctest.Command(t, role, args...)
	cmd.ExtraFiles = []*os.File{child}
	require.NoError(t, cmd.Start())
	return cmd, conn
}

// parentConn is a child's end of the socket startChild made.
func parentConn() (*net.UnixConn, error) {
	f := os.NewFile(3, "parent socket")
	defer func() { _ = f.Close() }() // test cleanup
	c, err := net.FileConn(f)
	if err != nil {
		return nil, err
	}
	_ = c.SetDeadline(time.Now().Add(hangGuard)) // test cleanup
	return c.(*net.UnixConn), nil
}

// sendWithFD sends msg and fd in one message.
func sendWithFD(c *net.UnixConn, msg []byte, fd int) error { return unixfd.Send(c, msg, fd) }

// recvWithFD reads a message of exactly size bytes that carries one descriptor.
func recvWithFD(c *net.UnixConn, size int) ([]byte, int, error) {
	msg := make([]byte, size)
	n, fds, err := unixfd.Recv(c, msg, 1)
	if err != nil {
		return nil, -1, err
	}
	if len(fds) != 1 {
		return nil, -1, fmt.Errorf("got %d descriptors, want 1", len(fds))
	}
	if _, err := io.ReadFull(c, msg[n:]); err != nil {
		_ = unix.Close(fds[0]) // test cleanup
		return nil, -1, err
	}
	return msg, fds[0], nil
}

// The importer's message: the exported buffer's address, its never-exported
// neighbour's address, the buffer's export data, the export data of a buffer freed
// since, and an IPC event handle recorded after the writes.
type importerMsg struct {
	Buffer, Neighbour uint64
	Data, Stale       cudart.PtrExportData
	Event             cudart.IpcEventHandle
}

const importerMsgSize = 8 + 8 + 64 + 64 + 64

// FACTS 2-6 and 8, across two processes: the child imports the pool from an fd sent
// over SCM_RIGHTS and reads what the parent wrote.
func TestGPUTwoProcessSharing(t *testing.T) {
	rt := gputest.Runtime(t)
	f := newGPUFixture(t, rt, 0, ipcPool)
	h := must[cudart.ShareableHandle](t, "MemPoolExportToShareableHandle")(rt.MemPoolExportToShareableHandle(0, f.pool, cudart.HandleTypePosixFD))
	defer func() { _ = unix.Close(h.FD) }() // test cleanup
	buf, neighbour := f.malloc(t, MiB), f.malloc(t, MiB)
	f.write(t, buf, pattern(MiB, 1))
	f.write(t, neighbour, pattern(MiB, 2))
	stale := f.malloc(t, MiB)
	m := importerMsg{Buffer: uint64(buf), Neighbour: uint64(neighbour)}
	m.Stale = must[cudart.PtrExportData](t, "MemPoolExportPointer")(rt.MemPoolExportPointer(0, stale))
	f.free(t, stale)
	m.Data = must[cudart.PtrExportData](t, "MemPoolExportPointer")(rt.MemPoolExportPointer(0, buf))
	ev := must[cudart.Event](t, "EventCreate")(rt.EventCreate(0, cudart.EventIPC))
	defer func() { _ = rt.EventDestroy(0, ev) }() // test cleanup
	require.NoError(t, rt.EventRecord(0, ev, f.stream), "EventRecord")
	m.Event = must[cudart.IpcEventHandle](t, "IpcGetEventHandle")(rt.IpcGetEventHandle(0, ev))

	cmd, conn := startChild(t, "importer")
	var msg bytes.Buffer
	_ = binary.Write(&msg, binary.LittleEndian, &m) // test cleanup
	require.NoError(t, sendWithFD(conn, msg.Bytes(), h.FD), "send to the importer")
	// The importer acknowledges once it has freed every import, as CUDA requires
	// before the exporter frees.
	ack := make([]byte, 1)
	_, ackErr := io.ReadFull(conn, ack)
	waitErr := cmd.Wait()
	acked := assert.NoError(t, ackErr, "the importer's acknowledgement (its stderr is above)")
	if !assert.NoError(t, waitErr, "the importer's exit (its stderr is above)") || !acked {
		t.FailNow()
	}
	f.free(t, buf, neighbour)
}

// childChecks collects a child's failures; each is printed to stderr at once.
type childChecks struct{ failed bool }

func (c *childChecks) check(ok bool, format string, args ...any) bool {
	if !ok {
		c.failed = true
		fmt.Fprintf(os.Stderr, "child: "+format+"\n", args...)
	}
	return ok
}

func (c *childChecks) status() int {
	if c.failed {
		return 1
	}
	return 0
}

// childStart is what every child of a GPU pair does first: load the real runtime and
// take its end of the parent's socket.
func childStart() (cudart.Runtime, *net.UnixConn, error) {
	rt, err := cudart.Load()
	if err != nil {
		return nil, nil, err
	}
	conn, err := parentConn()
	if err != nil {
		return nil, nil, err
	}
	return rt, conn, nil
}

func childSetup(msgSize int) (cudart.Runtime, *net.UnixConn, []byte, int, error) {
	rt, conn, err := childStart()
	if err != nil {
		return nil, nil, nil, -1, err
	}
	msg, fd, err := recvWithFD(conn, msgSize)
	if err != nil {
		_ = conn.Close() // test cleanup
		return nil, nil, nil, -1, err
	}
	return rt, conn, msg, fd, nil
}

func importerMain([]string) int {
	rt, conn, raw, fd, err := childSetup(importerMsgSize)
	if err != nil {
		fmt.Fprintln(os.Stderr, "child:", err)
		return 1
	}
	defer func() { _ = conn.Close() }() // test cleanup
	var m importerMsg
	_ = binary.Read(bytes.NewReader(raw), binary.LittleEndian, &m) // test cleanup
	c := &childChecks{}
	defer func() { _, _ = conn.Write([]byte{'k'}) }() // after every import is freed, failed or not
	pool, err := rt.MemPoolImportFromShareableHandle(0, cudart.ShareableHandle{Type: cudart.HandleTypePosixFD, FD: fd})
	_ = unix.Close(fd) // test cleanup
	if !c.check(err == nil, "importing the pool: %v", err) {
		return 1
	}
	s, err := rt.StreamCreate(0, cudart.StreamNonBlocking)
	if !c.check(err == nil, "StreamCreate: %v", err) {
		return 1
	}
	ev, err := rt.IpcOpenEventHandle(0, m.Event)
	if c.check(err == nil, "IpcOpenEventHandle: %v", err) {
		c.check(rt.StreamWaitEvent(0, s, ev) == nil, "StreamWaitEvent on the parent's event")
		c.check(rt.StreamSynchronize(0, s) == nil, "StreamSynchronize after the wait")
		c.check(rt.EventDestroy(0, ev) == nil, "EventDestroy of the opened event")
	}

	p, err := rt.MemPoolImportPointer(0, pool, m.Data)
	if !c.check(err == nil, "MemPoolImportPointer: %v", err) {
		return 1
	}
	c.check(uint64(p) == m.Buffer, "imported at %#x, the exporter's address is %#x", p, m.Buffer)
	got := make([]byte, MiB)
	err = rt.MemcpyDtoHAsync(0, got, p, s)
	c.check(err == nil && bytes.Equal(got, pattern(MiB, 1)), "reading the import: %v, bytes equal %v", err, bytes.Equal(got, pattern(MiB, 1)))
	err = rt.MemcpyDtoHAsync(0, got[:4096], cudart.DevicePtr(m.Neighbour), s)
	c.check(errors.Is(err, cudart.ErrInvalidValue), "copying from the never-exported neighbour: %v, want invalid value", err)
	var junk cudart.PtrExportData
	for i := range junk {
		junk[i] = 0x3c
	}
	_, err = rt.MemPoolImportPointer(0, pool, junk)
	c.check(errors.Is(err, cudart.ErrInvalidValue), "importing junk: %v, want invalid value", err)
	_, err = rt.MallocFromPoolAsync(0, MiB, pool, s)
	c.check(errors.Is(err, cudart.ErrInvalidValue), "allocating from the imported pool: %v, want invalid value", err)
	readOnOtherDevice(rt, c, pool, p)

	p2, err := rt.MemPoolImportPointer(0, pool, m.Data)
	c.check(err == nil && p2 == p, "importing again: %#x, %v; want the same pointer %#x", p2, err, p)
	c.check(rt.FreeAsync(0, p, s) == nil, "freeing the import")
	c.check(rt.StreamSynchronize(0, s) == nil, "StreamSynchronize after the free")
	err = rt.FreeAsync(0, p2, s)
	c.check(errors.Is(err, cudart.ErrInvalidValue), "freeing the second import after the first: %v, want invalid value", err)
	_ = rt.StreamSynchronize(0, s) // test cleanup

	sp, err := rt.MemPoolImportPointer(0, pool, m.Stale)
	c.check(err == nil, "importing the export data of a freed buffer: %v, want success (the driver cannot tell)", err)
	if err == nil {
		err = rt.FreeAsync(0, sp, s)
		fmt.Fprintf(os.Stderr, "child: freeing the stale import: %v; synchronizing: %v\n", err, rt.StreamSynchronize(0, s))
	}
	c.check(rt.StreamDestroy(0, s) == nil, "StreamDestroy")
	return c.status()
}

// readOnOtherDevice checks FACTS 8: with access granted in the importing process,
// device 1 reads the imported device-0 pointer.
func readOnOtherDevice(rt cudart.Runtime, c *childChecks, pool cudart.MemPool, p cudart.DevicePtr) {
	if n, _ := rt.DeviceCount(); n < 2 {
		fmt.Fprintln(os.Stderr, "child: one device, reading from another GPU not checked")
		return
	}
	err := rt.MemPoolSetAccess(0, pool, []cudart.AccessDesc{{Location: cudart.DeviceLocation(1), Flags: cudart.AccessReadWrite}})
	if !c.check(err == nil, "granting device 1 access to the imported pool: %v", err) {
		return
	}
	local, err := rt.MemPoolCreate(cudart.PoolProps{Location: cudart.DeviceLocation(1)})
	if !c.check(err == nil, "a pool on device 1: %v", err) {
		return
	}
	defer func() { _ = rt.MemPoolDestroy(1, local) }() // test cleanup
	s1, err := rt.StreamCreate(1, cudart.StreamNonBlocking)
	if !c.check(err == nil, "a stream on device 1: %v", err) {
		return
	}
	defer func() { _ = rt.StreamDestroy(1, s1) }() // test cleanup
	dst, err := rt.MallocFromPoolAsync(1, MiB, local, s1)
	if !c.check(err == nil, "allocating on device 1: %v", err) {
		return
	}
	got := make([]byte, MiB)
	err = rt.MemcpyDtoDAsync(1, dst, p, MiB, s1)
	if c.check(err == nil, "copying the import to device 1: %v", err) {
		err = rt.MemcpyDtoHAsync(1, got, dst, s1)
		c.check(err == nil && bytes.Equal(got, pattern(MiB, 1)), "device 1 read the import: %v, bytes equal %v", err, bytes.Equal(got, pattern(MiB, 1)))
	}
	c.check(rt.FreeAsync(1, dst, s1) == nil, "freeing on device 1")
	c.check(rt.StreamSynchronize(1, s1) == nil, "StreamSynchronize on device 1")
}

// FACTS 7: the exporter may exit first, with its buffer still allocated; the import
// still reads it and frees without error.
func TestGPUExporterDiesFirst(t *testing.T) {
	rt := gputest.Runtime(t)
	cmd, conn := startChild(t, "dying-exporter")
	msg, fd, err := recvWithFD(conn, 64)
	require.NoError(t, err, "from the exporter")
	pool, err := rt.MemPoolImportFromShareableHandle(0, cudart.ShareableHandle{Type: cudart.HandleTypePosixFD, FD: fd})
	_ = unix.Close(fd) // test cleanup
	require.NoError(t, err, "importing the pool")
	p := must[cudart.DevicePtr](t, "MemPoolImportPointer")(rt.MemPoolImportPointer(0, pool, cudart.PtrExportData(msg)))
	_, err = conn.Write([]byte{'x'})
	require.NoError(t, err)
	require.NoError(t, cmd.Wait(), "exporter")
	got := make([]byte, MiB)
	require.NoError(t, rt.MemcpyDtoHAsync(0, got, p, 0), "reading the import after the exporter exited")
	assert.True(t, bytes.Equal(got, pattern(MiB, 5)), "the import of a dead exporter reads other bytes")
	require.NoError(t, rt.FreeAsync(0, p, 0), "freeing the import")
	require.NoError(t, rt.StreamSynchronize(0, 0), "StreamSynchronize")
	// FACTS.md saw invalid value here; on the 2xH200 host, with the import made while
	// the exporter lived, it succeeded. It is recorded, not required.
	t.Logf("destroying the imported pool of a dead exporter: %v", rt.MemPoolDestroy(0, pool))
}

// dyingExporterMain writes pattern 5 into a buffer, sends its pool and export data,
// and, once told to, exits with the buffer still allocated.
func dyingExporterMain([]string) int {
	rt, conn, err := childStart()
	if err != nil {
		fmt.Fprintln(os.Stderr, "child:", err)
		return 1
	}
	defer func() { _ = conn.Close() }() // test cleanup
	h, data, err := exportBuffers(rt, 1, func(p cudart.DevicePtr, s cudart.Stream) error {
		return rt.MemcpyHtoDAsync(0, p, pattern(MiB, 5), s)
	})
	if err == nil {
		err = sendWithFD(conn, data[0][:], h.FD)
	}
	if err == nil {
		_, err = io.ReadFull(conn, make([]byte, 1))
	}
	if err != nil {
		fmt.Fprintln(os.Stderr, "child:", err)
		return 1
	}
	return 0
}

// exportBuffers makes an exported POSIX-fd pool on device 0 with n buffers of 1 MiB,
// fills each with fill and waits, and returns the pool's handle and each buffer's
// export data. The pool and buffers live until the process exits.
func exportBuffers(rt cudart.Runtime, n int, fill func(cudart.DevicePtr, cudart.Stream) error) (cudart.ShareableHandle, []cudart.PtrExportData, error) {
	pool, err := rt.MemPoolCreate(cudart.PoolProps{HandleTypes: cudart.HandleTypePosixFD, Location: cudart.DeviceLocation(0)})
	if err != nil {
		return cudart.ShareableHandle{}, nil, err
	}
	h, err := rt.MemPoolExportToShareableHandle(0, pool, cudart.HandleTypePosixFD)
	if err != nil {
		return h, nil, err
	}
	s, err := rt.StreamCreate(0, cudart.StreamNonBlocking)
	if err != nil {
		return h, nil, err
	}
	data := make([]cudart.PtrExportData, n)
	for i := range data {
		p, err := rt.MallocFromPoolAsync(0, MiB, pool, s)
		if err == nil && fill != nil {
			err = fill(p, s)
		}
		if err == nil {
			err = rt.StreamSynchronize(0, s)
		}
		if err == nil {
			data[i], err = rt.MemPoolExportPointer(0, p)
		}
		if err != nil {
			return h, nil, err
		}
	}
	return h, data, nil
}
