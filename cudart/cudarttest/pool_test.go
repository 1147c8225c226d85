//go:build linux

package cudarttest

import (
	"testing"

	"github.com/cudapool/cudapool/cudart"
	"github.com/stretchr/testify/require"
)

const mib = 1 << 20

// FACTS 1: 1 MiB buffers at 1 MiB offsets, small ones at 512-byte steps, and a 3 MiB
// buffer after small ones starts 6144 bytes into a granule.
func TestSubAllocationPacksBelowGranularity(t *testing.T) {
	d := newFx(t)
	p := d.pool(ipcProps(0))
	base := d.alloc(p, mib)
	for i := 1; i < 4; i++ {
		require.Equal(t, cudart.DevicePtr(i*mib), d.alloc(p, mib)-base, "offset of 1 MiB buffer %d", i)
	}

	q := d.pool(ipcProps(0))
	first := d.alloc(q, 100)
	require.Zero(t, first%(2*mib), "first allocation at %#x, not granule aligned", first)
	for i := 1; i < 12; i++ {
		require.Equal(t, cudart.DevicePtr(i*512), d.alloc(q, 512)-first, "offset of small buffer %d", i)
	}
	require.EqualValues(t, 6144, d.alloc(q, 3*mib)%(2*mib), "bytes into its granule of a 3 MiB buffer")
}

func TestFirstFitReusesFreedSpace(t *testing.T) {
	d := newFx(t)
	p := d.pool(ipcProps(0))
	a := d.alloc(p, 4096)
	b := d.alloc(p, 4096)
	d.alloc(p, 4096)
	require.NoError(t, d.FreeAsync(0, b, 0))
	require.NoError(t, d.sync()) // freed space comes back when the free has run
	require.Equal(t, b, d.alloc(p, 1000), "the next small allocation after a free")
	require.Equal(t, a+3*4096, d.alloc(p, 8192), "an allocation too big for any hole goes at the end")
}

func TestMemoryFiguresAndReservation(t *testing.T) {
	d := newFx(t, WithMemory(64*mib))
	p := d.pool(ipcProps(0))
	a := d.alloc(p, 1000) // rounds to 1024
	b := d.alloc(p, 3*mib)
	require.EqualValues(t, 4*mib, d.attr(p, cudart.PoolReservedMemCurrent), "reserved")
	require.EqualValues(t, 3*mib+1024, d.attr(p, cudart.PoolUsedMemCurrent), "used")
	require.EqualValues(t, 60*mib, d.free(0), "MemGetInfo free")
	require.EqualValues(t, 64*mib, d.free(1), "device 1 free: all of it")
	require.NoError(t, d.FreeAsync(0, b, 0))
	require.NoError(t, d.sync())
	require.EqualValues(t, 1024, d.attr(p, cudart.PoolUsedMemCurrent), "used after free")
	require.EqualValues(t, 3*mib+1024, d.attr(p, cudart.PoolUsedMemHigh), "used high after free")
	require.NoError(t, d.MemPoolSetAttribute(0, p, cudart.PoolUsedMemHigh, 0))
	require.EqualValues(t, 1024, d.attr(p, cudart.PoolUsedMemHigh), "used high after reset: the current figure")
	// IPC pools keep their reservation (FACTS: TrimTo has no effect on them).
	require.NoError(t, d.MemPoolTrimTo(0, p, 0))
	require.EqualValues(t, 4*mib, d.attr(p, cudart.PoolReservedMemCurrent), "IPC pool reserved after trim: all kept")
	require.NoError(t, d.FreeAsync(0, a, 0))

	// A pool that is not IPC capable gives memory back on TrimTo.
	np := d.pool(cudart.PoolProps{Location: cudart.DeviceLocation(0)})
	x := d.alloc(np, 5*mib)
	require.NoError(t, d.FreeAsync(0, x, 0))
	require.NoError(t, d.sync()) // memory whose free has not run is still in use
	require.NoError(t, d.MemPoolTrimTo(0, np, 2*mib))
	require.EqualValues(t, 2*mib, d.attr(np, cudart.PoolReservedMemCurrent), "non-IPC reserved after TrimTo(2 MiB)")
	require.EqualValues(t, 6*mib, d.attr(np, cudart.PoolReservedMemHigh), "reserved high")
	require.NoError(t, d.MemPoolSetAttribute(0, np, cudart.PoolReservedMemHigh, 0))
	require.EqualValues(t, 2*mib, d.attr(np, cudart.PoolReservedMemHigh), "reserved high after reset")
	require.NoError(t, d.MemPoolDestroy(0, np))
	require.NoError(t, d.MemPoolDestroy(0, p))
	require.EqualValues(t, 64*mib, d.free(0), "free after destroying every pool")
}

// FACTS 10: maxSize is honoured, and need not be a granularity multiple.
func TestMaxSizeAndDeviceMemory(t *testing.T) {
	d := newFx(t, WithMemory(256*mib))
	props := ipcProps(0)
	props.MaxSize = 64 * mib
	p := d.pool(props)
	d.alloc(p, 48*mib)
	_, err := d.MallocFromPoolAsync(0, 32*mib, p, 0)
	wantErr(t, err, cudart.ErrOutOfMemory)
	d.alloc(p, 16*mib)

	props.MaxSize = 3 * mib
	small := d.pool(props)
	d.alloc(small, 2*mib)
	_, err = d.MallocFromPoolAsync(0, 512, small, 0)
	wantErr(t, err, cudart.ErrOutOfMemory)

	// The device runs out before an unbounded pool does.
	big := d.pool(ipcProps(0))
	_, err = d.MallocFromPoolAsync(0, 254*mib, big, 0)
	wantErr(t, err, cudart.ErrOutOfMemory)
	d.alloc(big, 190*mib)
}

func TestPoolCreateChecksProps(t *testing.T) {
	d := newFx(t)
	for _, c := range []struct {
		props cudart.PoolProps
		want  cudart.Code
	}{
		{cudart.PoolProps{Location: cudart.Location{Type: cudart.LocationHost}}, cudart.ErrNotSupported},
		{cudart.PoolProps{Location: cudart.Location{Type: cudart.LocationInvalid}}, cudart.ErrInvalidValue},
		{cudart.PoolProps{Location: cudart.DeviceLocation(2)}, cudart.ErrInvalidDevice},
		{cudart.PoolProps{HandleTypes: 0x2, Location: cudart.DeviceLocation(0)}, cudart.ErrNotSupported},
	} {
		_, err := d.MemPoolCreate(c.props)
		wantErr(t, err, c.want)
	}
	// FACTS 11: a FABRIC pool is created; only its export is refused.
	d.pool(cudart.PoolProps{HandleTypes: cudart.HandleTypeFabric | cudart.HandleTypePosixFD, Location: cudart.DeviceLocation(1)})
}

func TestPoolAttributesFollowCUDARules(t *testing.T) {
	d := newFx(t)
	p := d.pool(ipcProps(0))
	for _, a := range []cudart.PoolAttr{cudart.PoolReuseFollowEventDependencies, cudart.PoolReuseAllowOpportunistic, cudart.PoolReuseAllowInternalDependencies} {
		require.EqualValues(t, 1, d.attr(p, a), "attribute %d by default", a)
		require.NoError(t, d.MemPoolSetAttribute(0, p, a, 0))
		require.Zero(t, d.attr(p, a), "attribute %d after setting 0", a)
		wantErr(t, d.MemPoolSetAttribute(0, p, a, 2), cudart.ErrInvalidValue)
	}
	require.NoError(t, d.MemPoolSetAttribute(0, p, cudart.PoolReleaseThreshold, 1<<40))
	require.EqualValues(t, 1<<40, d.attr(p, cudart.PoolReleaseThreshold), "release threshold")
	for _, a := range []cudart.PoolAttr{cudart.PoolReservedMemCurrent, cudart.PoolUsedMemCurrent, 99} {
		wantErr(t, d.MemPoolSetAttribute(0, p, a, 0), cudart.ErrInvalidValue)
	}
	wantErr(t, d.MemPoolSetAttribute(0, p, cudart.PoolUsedMemHigh, 5), cudart.ErrInvalidValue)
	_, err := d.MemPoolGetAttribute(0, p, 99)
	wantErr(t, err, cudart.ErrInvalidValue)
	_, err = d.MemPoolGetAttribute(0, 12345, cudart.PoolUsedMemCurrent)
	wantErr(t, err, cudart.ErrInvalidValue)
}

func TestDefaultPool(t *testing.T) {
	d := newFx(t)
	p, err := d.DeviceGetDefaultMemPool(1)
	require.NoError(t, err)
	again, err := d.DeviceGetDefaultMemPool(1)
	require.NoError(t, err)
	require.Equal(t, p, again, "the default pool changed")
	other, err := d.DeviceGetDefaultMemPool(0)
	require.NoError(t, err)
	require.NotEqual(t, p, other, "devices 0 and 1 share a default pool")
	ptr, err := d.MallocFromPoolAsync(1, 100, p, 0)
	require.NoError(t, err)
	require.NoError(t, d.MemcpyHtoDAsync(1, ptr, []byte("x"), 0))
	// FACTS 9: not IPC capable.
	_, err = d.MemPoolExportToShareableHandle(1, p, cudart.HandleTypePosixFD)
	wantErr(t, err, cudart.ErrInvalidValue)
	_, err = d.MemPoolExportPointer(1, ptr)
	wantErr(t, err, cudart.ErrInvalidValue)
	wantErr(t, d.MemPoolDestroy(1, p), cudart.ErrInvalidValue)
}

func TestDestroyWaitsForLiveAllocations(t *testing.T) {
	d := newFx(t, WithMemory(64*mib))
	p := d.pool(ipcProps(0))
	ptr := d.alloc(p, 100)
	d.write(ptr, []byte("still here"))
	require.NoError(t, d.MemPoolDestroy(0, p))
	_, err := d.MallocFromPoolAsync(0, 100, p, 0)
	wantErr(t, err, cudart.ErrInvalidValue)
	wantErr(t, d.MemPoolDestroy(0, p), cudart.ErrInvalidValue)
	d.wantBytes(ptr, []byte("still here"))
	require.EqualValues(t, 62*mib, d.free(0), "free while the destroyed pool still has an allocation")
	require.NoError(t, d.FreeAsync(0, ptr, 0))
	require.NoError(t, d.sync())
	require.EqualValues(t, 64*mib, d.free(0), "free after the last allocation of a destroyed pool went")
	_, err = d.MemcpyDtoHAsyncN(ptr, 1)
	wantErr(t, err, cudart.ErrInvalidValue)
}

// MemcpyDtoHAsyncN reads n bytes, returning the error.
func (f fx) MemcpyDtoHAsyncN(ptr cudart.DevicePtr, n int) ([]byte, error) {
	buf := make([]byte, n)
	return buf, f.MemcpyDtoHAsync(0, buf, ptr, 0)
}

func TestBadAddressesAndSizes(t *testing.T) {
	d := newFx(t)
	p := d.pool(ipcProps(0))
	ptr := d.alloc(p, 1000) // 1024 bytes
	_, err := d.MallocFromPoolAsync(0, 0, p, 0)
	wantErr(t, err, cudart.ErrInvalidValue)
	for _, huge := range []uint64{1 << 62, ^uint64(0)} {
		_, err = d.MallocFromPoolAsync(0, huge, p, 0)
		wantErr(t, err, cudart.ErrOutOfMemory)
	}

	_, err = d.MemcpyDtoHAsyncN(ptr+1000, 24)
	require.NoError(t, err)
	_, err = d.MemcpyDtoHAsyncN(ptr+1000, 25)
	wantErr(t, err, cudart.ErrInvalidValue)
	_, err = d.MemcpyDtoHAsyncN(ptr+4096, 1) // in the pool, never allocated
	wantErr(t, err, cudart.ErrInvalidValue)
	_, err = d.MemcpyDtoHAsyncN(12345, 1)
	wantErr(t, err, cudart.ErrInvalidValue)
	wantErr(t, d.FreeAsync(0, ptr+512, 0), cudart.ErrInvalidValue)
	wantErr(t, d.FreeAsync(0, 12345, 0), cudart.ErrInvalidValue)
	wantErr(t, d.MemsetAsync(0, ptr, 1, 2048, 0), cudart.ErrInvalidValue)
	require.NoError(t, d.MemsetAsync(0, ptr, 0, 0, 0))
	require.NoError(t, d.Err()) // wild addresses are errors, not violations

	// A freed allocation is a use after release.
	require.NoError(t, d.FreeAsync(0, ptr, 0))
	_, err = d.MemcpyDtoHAsyncN(ptr, 1)
	wantErr(t, err, cudart.ErrInvalidValue)
	wantViolation(t, err, ViolationUseAfterRelease)
	err = d.MemcpyHtoDAsync(0, ptr, []byte{1}, 0)
	wantViolation(t, err, ViolationUseAfterRelease)
}

func TestCopiesAndSets(t *testing.T) {
	d := newFx(t)
	p := d.pool(ipcProps(0))
	q, err := d.DeviceGetDefaultMemPool(1)
	require.NoError(t, err)
	a := d.alloc(p, 64)
	b, err := d.MallocFromPoolAsync(1, 64, q, 0)
	require.NoError(t, err)
	require.NoError(t, d.StreamSynchronize(1, 0)) // the allocation has run: any stream may use it
	require.NoError(t, d.MemsetAsync(0, a, 'z', 64, 0))
	d.write(a+8, []byte("hello"))
	err = d.MemcpyDtoDAsync(0, b, a, 64, 0)
	wantViolation(t, err, ViolationAccessDenied) // device 0 was not granted device 1's pool
	require.ErrorIs(t, err, cudart.ErrInvalidValue, "the driver's answer")
	require.NoError(t, d.MemPoolSetAccess(1, q, []cudart.AccessDesc{{Location: cudart.DeviceLocation(0), Flags: cudart.AccessReadWrite}}))
	require.NoError(t, d.MemcpyDtoDAsync(0, b, a, 64, 0)) // across devices, as cudaMemcpyDefault
	require.NoError(t, d.MemcpyDtoDAsync(0, a+1, a, 16, 0))
	require.NoError(t, d.sync()) // device 1's default stream is another stream
	got := make([]byte, 16)
	require.NoError(t, d.MemcpyDtoHAsync(1, got, b, 0))
	require.Equal(t, "zzzzzzzzhellozzz", string(got), "copy across devices")
	d.wantBytes(a, []byte("zzzzzzzzzhellozz")) // overlapping copies move
	require.NoError(t, d.StreamSynchronize(0, 0))
}

func TestPoolAccess(t *testing.T) {
	d := newFx(t)
	p := d.pool(ipcProps(0))
	get := func(dev int32) cudart.AccessFlags {
		f, err := d.MemPoolGetAccess(0, p, cudart.DeviceLocation(int(dev)))
		require.NoError(t, err)
		return f
	}
	require.Equal(t, cudart.AccessReadWrite, get(0), "default access of the resident device")
	require.Equal(t, cudart.AccessNone, get(1), "default access of another device")
	desc := func(dev int, f cudart.AccessFlags) []cudart.AccessDesc {
		return []cudart.AccessDesc{{Location: cudart.DeviceLocation(dev), Flags: f}}
	}
	// FACTS: AccessNone fails with invalid device.
	wantErr(t, d.MemPoolSetAccess(0, p, desc(1, cudart.AccessNone)), cudart.ErrInvalidDevice)
	wantErr(t, d.MemPoolSetAccess(0, p, desc(2, cudart.AccessRead)), cudart.ErrInvalidDevice)
	wantErr(t, d.MemPoolSetAccess(0, p, desc(0, cudart.AccessRead)), cudart.ErrInvalidValue)
	// Checked as a whole: a bad descriptor applies none.
	err := d.MemPoolSetAccess(0, p, append(desc(1, cudart.AccessRead), desc(1, 7)...))
	wantErr(t, err, cudart.ErrInvalidValue)
	require.Equal(t, cudart.AccessNone, get(1), "a failed MemPoolSetAccess applied part of its descriptors")
	require.NoError(t, d.MemPoolSetAccess(0, p, desc(1, cudart.AccessRead)))
	require.Equal(t, cudart.AccessRead, get(1), "device 1 access after granting read")
	_, err = d.MemPoolGetAccess(0, p, cudart.Location{Type: cudart.LocationHost})
	wantErr(t, err, cudart.ErrInvalidValue)

	np := newFx(t, WithPeerAccess(false))
	q := np.pool(ipcProps(0))
	wantErr(t, np.MemPoolSetAccess(0, q, desc(1, cudart.AccessReadWrite)), cudart.ErrInvalidDevice)
}
