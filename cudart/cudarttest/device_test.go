package cudarttest

import (
	"errors"
	"testing"

	"github.com/cudapool/cudapool/cudart"
)

func TestDeviceQueries(t *testing.T) {
	d := newFx(t)
	if d.Name() != "cudarttest software device" {
		t.Fatalf("Name = %q", d.Name())
	}
	if n, err := d.DeviceCount(); err != nil || n != 2 {
		t.Fatalf("DeviceCount = %d, %v; want 2 by default", n, err)
	}
	for attr, want := range map[cudart.DeviceAttr]int{
		cudart.DevAttrMemoryPoolsSupported:       1,
		cudart.DevAttrMemoryPoolSupportedHandles: 0x9,
		cudart.DevAttrComputeCapabilityMajor:     9,
	} {
		if got, err := d.DeviceAttribute(1, attr); err != nil || got != want {
			t.Errorf("attribute %d = %d, %v; want %d", attr, got, err, want)
		}
	}
	_, err := d.DeviceAttribute(0, 9999)
	wantErr(t, err, cudart.ErrInvalidValue)

	u0, err := d.DeviceUUID(0)
	ok(t, err)
	u1, err := d.DeviceUUID(1)
	ok(t, err)
	other, err := newFx(t).DeviceUUID(0)
	ok(t, err)
	if u0 == u1 || u0 != other {
		t.Fatalf("UUIDs %v %v, other Device's device 0 %v: want distinct per ordinal, equal across Devices", u0, u1, other)
	}
	b0, err := d.DevicePCIBusID(0)
	ok(t, err)
	b1, err := d.DevicePCIBusID(1)
	ok(t, err)
	if b0 == b1 || len(b0) != len("0000:18:00.0") {
		t.Fatalf("PCI bus ids %q %q", b0, b1)
	}

	if can, err := d.DeviceCanAccessPeer(0, 1); err != nil || !can {
		t.Fatalf("CanAccessPeer(0, 1) = %v, %v", can, err)
	}
	if can, err := d.DeviceCanAccessPeer(1, 1); err != nil || can {
		t.Fatalf("CanAccessPeer(1, 1) = %v, %v; CUDA says false for a device and itself", can, err)
	}
	if can, err := newFx(t, WithPeerAccess(false)).DeviceCanAccessPeer(0, 1); err != nil || can {
		t.Fatalf("WithPeerAccess(false): CanAccessPeer = %v, %v", can, err)
	}
	_, err = d.DeviceCanAccessPeer(0, 2)
	wantErr(t, err, cudart.ErrInvalidDevice)
	for _, dev := range []int{-1, 2} {
		_, _, err := d.MemGetInfo(dev)
		wantErr(t, err, cudart.ErrInvalidDevice)
	}
}

func TestOptions(t *testing.T) {
	d := newFx(t, WithDevices(3), WithGranularity(64<<10), WithMemory(1<<30))
	if n, _ := d.DeviceCount(); n != 3 {
		t.Fatalf("DeviceCount = %d, want 3", n)
	}
	for _, rec := range []bool{false, true} {
		if g, err := d.AllocationGranularity(2, cudart.HandleTypePosixFD, rec); err != nil || g != 64<<10 {
			t.Fatalf("granularity = %d, %v; want 64 KiB", g, err)
		}
	}
	if g, _ := newFx(t).AllocationGranularity(0, cudart.HandleTypeNone, true); g != 2<<20 {
		t.Fatalf("default granularity = %d, want 2 MiB", g)
	}
	_, err := d.AllocationGranularity(0, 0x2, false)
	wantErr(t, err, cudart.ErrInvalidValue)
	if free, total, err := d.MemGetInfo(0); err != nil || free != 1<<30 || total != 1<<30 {
		t.Fatalf("MemGetInfo = %d, %d, %v; want 1 GiB free of 1 GiB", free, total, err)
	}
}

func TestClosedDeviceRefusesCalls(t *testing.T) {
	d := New()
	p, err := d.MemPoolCreate(ipcProps(0))
	ok(t, err)
	ok(t, d.Close())
	ok(t, d.Close())
	_, err = d.MallocFromPoolAsync(0, 512, p, 0)
	wantErr(t, err, ErrClosed, cudart.ErrDevicesUnavailable)
	_, err = d.DeviceCount()
	wantErr(t, err, ErrClosed)
	_, err = d.MemPoolCreate(ipcProps(0))
	wantErr(t, err, ErrClosed)
}

func TestViolationsAreKeptAndJoined(t *testing.T) {
	d := newFx(t)
	ok(t, d.Err())
	p := d.pool(ipcProps(0))
	ptr := d.alloc(p, 512)
	ok(t, d.FreeAsync(0, ptr, 0))
	err := d.FreeAsync(0, ptr, 0)
	wantErr(t, err, ErrViolation, cudart.ErrInvalidValue)
	wantViolation(t, err, ViolationUseAfterRelease)
	var ce *cudart.Error
	if !errors.As(err, &ce) || ce.Op != "cudaFreeAsync" {
		t.Fatalf("error %v carries no *cudart.Error for cudaFreeAsync", err)
	}
	vs := d.Violations()
	if len(vs) != 1 || vs[0].Kind != ViolationUseAfterRelease || vs[0].Op != "cudaFreeAsync" {
		t.Fatalf("Violations = %+v", vs)
	}
	wantErr(t, d.Err(), ErrViolation)
	wantViolation(t, d.Err(), ViolationUseAfterRelease)
}
