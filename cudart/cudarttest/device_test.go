//go:build linux

package cudarttest

import (
	"testing"

	"github.com/cudapool/cudapool/cudart"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

func TestDeviceQueries(t *testing.T) {
	d := newFx(t)
	require.Equal(t, "cudarttest software device", d.Name())
	n, err := d.DeviceCount()
	require.NoError(t, err)
	require.Equal(t, 2, n, "DeviceCount by default")
	for attr, want := range map[cudart.DeviceAttr]int{
		cudart.DevAttrMemoryPoolsSupported:       1,
		cudart.DevAttrMemoryPoolSupportedHandles: 0x9,
		cudart.DevAttrComputeCapabilityMajor:     9,
	} {
		got, err := d.DeviceAttribute(1, attr)
		if assert.NoError(t, err, "attribute %d", attr) {
			assert.Equal(t, want, got, "attribute %d", attr)
		}
	}
	_, err = d.DeviceAttribute(0, 9999)
	wantErr(t, err, cudart.ErrInvalidValue)

	u0, err := d.DeviceUUID(0)
	require.NoError(t, err)
	u1, err := d.DeviceUUID(1)
	require.NoError(t, err)
	other, err := newFx(t).DeviceUUID(0)
	require.NoError(t, err)
	require.NotEqual(t, u0, u1, "UUIDs of two ordinals")
	require.Equal(t, u0, other, "UUIDs of one ordinal in two Devices")
	b0, err := d.DevicePCIBusID(0)
	require.NoError(t, err)
	b1, err := d.DevicePCIBusID(1)
	require.NoError(t, err)
	require.NotEqual(t, b0, b1, "PCI bus ids of two ordinals")
	require.Len(t, b0, len("0000:18:00.0"), "PCI bus id %q", b0)

	can, err := d.DeviceCanAccessPeer(0, 1)
	require.NoError(t, err)
	require.True(t, can, "CanAccessPeer(0, 1)")
	can, err = d.DeviceCanAccessPeer(1, 1)
	require.NoError(t, err)
	require.False(t, can, "CanAccessPeer(1, 1): CUDA says false for a device and itself")
	can, err = newFx(t, WithPeerAccess(false)).DeviceCanAccessPeer(0, 1)
	require.NoError(t, err)
	require.False(t, can, "WithPeerAccess(false): CanAccessPeer(0, 1)")
	_, err = d.DeviceCanAccessPeer(0, 2)
	wantErr(t, err, cudart.ErrInvalidDevice)
	for _, dev := range []int{-1, 2} {
		_, _, err := d.MemGetInfo(dev)
		wantErr(t, err, cudart.ErrInvalidDevice)
	}
}

func TestOptions(t *testing.T) {
	d := newFx(t, WithDevices(3), WithGranularity(64<<10), WithMemory(1<<30))
	n, err := d.DeviceCount()
	require.NoError(t, err)
	require.Equal(t, 3, n, "DeviceCount")
	for _, rec := range []bool{false, true} {
		g, err := d.AllocationGranularity(2, cudart.HandleTypePosixFD, rec)
		require.NoError(t, err)
		require.EqualValues(t, 64<<10, g, "granularity (recommended %v)", rec)
	}
	g, err := newFx(t).AllocationGranularity(0, cudart.HandleTypeNone, true)
	require.NoError(t, err)
	require.EqualValues(t, 2<<20, g, "default granularity")
	_, err = d.AllocationGranularity(0, 0x2, false)
	wantErr(t, err, cudart.ErrInvalidValue)
	free, total, err := d.MemGetInfo(0)
	require.NoError(t, err)
	require.EqualValues(t, 1<<30, free, "MemGetInfo free")
	require.EqualValues(t, 1<<30, total, "MemGetInfo total")
}

func TestClosedDeviceRefusesCalls(t *testing.T) {
	d := New()
	p, err := d.MemPoolCreate(ipcProps(0))
	require.NoError(t, err)
	require.NoError(t, d.Close())
	require.NoError(t, d.Close())
	_, err = d.MallocFromPoolAsync(0, 512, p, 0)
	wantErr(t, err, ErrClosed, cudart.ErrDevicesUnavailable)
	_, err = d.DeviceCount()
	wantErr(t, err, ErrClosed)
	_, err = d.MemPoolCreate(ipcProps(0))
	wantErr(t, err, ErrClosed)
}

func TestViolationsAreKeptAndJoined(t *testing.T) {
	d := newFx(t)
	require.NoError(t, d.Err())
	p := d.pool(ipcProps(0))
	ptr := d.alloc(p, 512)
	require.NoError(t, d.FreeAsync(0, ptr, 0))
	err := d.FreeAsync(0, ptr, 0)
	wantErr(t, err, ErrViolation, cudart.ErrInvalidValue)
	wantViolation(t, err, ViolationUseAfterRelease)
	var ce *cudart.Error
	require.ErrorAs(t, err, &ce, "the error carries the *cudart.Error the driver would return")
	require.Equal(t, "cudaFreeAsync", ce.Op)
	vs := d.Violations()
	require.Len(t, vs, 1, "Violations = %+v", vs)
	require.Equal(t, ViolationUseAfterRelease, vs[0].Kind, "Violations = %+v", vs)
	require.Equal(t, "cudaFreeAsync", vs[0].Op, "Violations = %+v", vs)
	wantErr(t, d.Err(), ErrViolation)
	wantViolation(t, d.Err(), ViolationUseAfterRelease)
}
