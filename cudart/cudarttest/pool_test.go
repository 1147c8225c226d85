package cudarttest

import (
	"testing"

	"github.com/cudapool/cudapool/cudart"
)

const mib = 1 << 20

// FACTS 1: 1 MiB buffers at 1 MiB offsets, small ones at 512-byte steps, and a 3 MiB
// buffer after small ones starts 6144 bytes into a granule.
func TestSubAllocationPacksBelowGranularity(t *testing.T) {
	d := newFx(t)
	p := d.pool(ipcProps(0))
	base := d.alloc(p, mib)
	for i := 1; i < 4; i++ {
		if got := d.alloc(p, mib) - base; got != cudart.DevicePtr(i*mib) {
			t.Fatalf("1 MiB buffer %d at offset %#x, want %#x", i, got, i*mib)
		}
	}

	q := d.pool(ipcProps(0))
	first := d.alloc(q, 100)
	if first%(2*mib) != 0 {
		t.Fatalf("first allocation at %#x, not granule aligned", first)
	}
	for i := 1; i < 12; i++ {
		if got := d.alloc(q, 512) - first; got != cudart.DevicePtr(i*512) {
			t.Fatalf("small buffer %d at offset %d, want %d", i, got, i*512)
		}
	}
	if big := d.alloc(q, 3*mib); big%(2*mib) != 6144 {
		t.Fatalf("3 MiB buffer %d bytes into its granule, want 6144", big%(2*mib))
	}
}

func TestFirstFitReusesFreedSpace(t *testing.T) {
	d := newFx(t)
	p := d.pool(ipcProps(0))
	a := d.alloc(p, 4096)
	b := d.alloc(p, 4096)
	d.alloc(p, 4096)
	ok(t, d.FreeAsync(0, b, 0))
	ok(t, d.sync()) // freed space comes back when the free has run
	if got := d.alloc(p, 1000); got != b {
		t.Fatalf("after freeing %#x, the next small allocation went to %#x", b, got)
	}
	if got := d.alloc(p, 8192); got != a+3*4096 {
		t.Fatalf("an allocation too big for any hole went to %#x, want the end %#x", got, a+3*4096)
	}
}

func TestMemoryFiguresAndReservation(t *testing.T) {
	d := newFx(t, WithMemory(64*mib))
	p := d.pool(ipcProps(0))
	a := d.alloc(p, 1000) // rounds to 1024
	b := d.alloc(p, 3*mib)
	if r, u := d.attr(p, cudart.PoolReservedMemCurrent), d.attr(p, cudart.PoolUsedMemCurrent); r != 4*mib || u != 3*mib+1024 {
		t.Fatalf("reserved %d used %d, want 4 MiB and 3 MiB + 1024", r, u)
	}
	if free, _, _ := d.MemGetInfo(0); free != 60*mib {
		t.Fatalf("MemGetInfo free = %d, want 60 MiB", free)
	}
	if free, _, _ := d.MemGetInfo(1); free != 64*mib {
		t.Fatalf("device 1 free = %d, want all of it", free)
	}
	ok(t, d.FreeAsync(0, b, 0))
	ok(t, d.sync())
	if u, h := d.attr(p, cudart.PoolUsedMemCurrent), d.attr(p, cudart.PoolUsedMemHigh); u != 1024 || h != 3*mib+1024 {
		t.Fatalf("after free: used %d high %d", u, h)
	}
	ok(t, d.MemPoolSetAttribute(0, p, cudart.PoolUsedMemHigh, 0))
	if h := d.attr(p, cudart.PoolUsedMemHigh); h != 1024 {
		t.Fatalf("used high after reset = %d, want the current 1024", h)
	}
	// IPC pools keep their reservation (FACTS: TrimTo has no effect on them).
	ok(t, d.MemPoolTrimTo(0, p, 0))
	if r := d.attr(p, cudart.PoolReservedMemCurrent); r != 4*mib {
		t.Fatalf("IPC pool reserved after trim = %d, want 4 MiB kept", r)
	}
	ok(t, d.FreeAsync(0, a, 0))

	// A pool that is not IPC capable gives memory back on TrimTo.
	np := d.pool(cudart.PoolProps{Location: cudart.DeviceLocation(0)})
	x := d.alloc(np, 5*mib)
	ok(t, d.FreeAsync(0, x, 0))
	ok(t, d.sync()) // memory whose free has not run is still in use
	ok(t, d.MemPoolTrimTo(0, np, 2*mib))
	if r := d.attr(np, cudart.PoolReservedMemCurrent); r != 2*mib {
		t.Fatalf("non-IPC reserved after TrimTo(2 MiB) = %d", r)
	}
	if rh := d.attr(np, cudart.PoolReservedMemHigh); rh != 6*mib {
		t.Fatalf("reserved high = %d, want 6 MiB", rh)
	}
	ok(t, d.MemPoolSetAttribute(0, np, cudart.PoolReservedMemHigh, 0))
	if rh := d.attr(np, cudart.PoolReservedMemHigh); rh != 2*mib {
		t.Fatalf("reserved high after reset = %d, want 2 MiB", rh)
	}
	ok(t, d.MemPoolDestroy(0, np))
	ok(t, d.MemPoolDestroy(0, p))
	if free, _, _ := d.MemGetInfo(0); free != 64*mib {
		t.Fatalf("free after destroying every pool = %d, want 64 MiB", free)
	}
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
		if v := d.attr(p, a); v != 1 {
			t.Fatalf("attribute %d defaults to %d, want 1", a, v)
		}
		ok(t, d.MemPoolSetAttribute(0, p, a, 0))
		if v := d.attr(p, a); v != 0 {
			t.Fatalf("attribute %d = %d after setting 0", a, v)
		}
		wantErr(t, d.MemPoolSetAttribute(0, p, a, 2), cudart.ErrInvalidValue)
	}
	ok(t, d.MemPoolSetAttribute(0, p, cudart.PoolReleaseThreshold, 1<<40))
	if v := d.attr(p, cudart.PoolReleaseThreshold); v != 1<<40 {
		t.Fatalf("release threshold = %d", v)
	}
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
	ok(t, err)
	if again, _ := d.DeviceGetDefaultMemPool(1); again != p {
		t.Fatalf("default pool changed: %#x then %#x", p, again)
	}
	if other, _ := d.DeviceGetDefaultMemPool(0); other == p {
		t.Fatal("devices 0 and 1 share a default pool")
	}
	ptr, err := d.MallocFromPoolAsync(1, 100, p, 0)
	ok(t, err)
	ok(t, d.MemcpyHtoDAsync(1, ptr, []byte("x"), 0))
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
	ok(t, d.MemPoolDestroy(0, p))
	_, err := d.MallocFromPoolAsync(0, 100, p, 0)
	wantErr(t, err, cudart.ErrInvalidValue)
	wantErr(t, d.MemPoolDestroy(0, p), cudart.ErrInvalidValue)
	d.wantBytes(ptr, []byte("still here"))
	if free, _, _ := d.MemGetInfo(0); free != 62*mib {
		t.Fatalf("free = %d while the destroyed pool still has an allocation", free)
	}
	ok(t, d.FreeAsync(0, ptr, 0))
	ok(t, d.sync())
	if free, _, _ := d.MemGetInfo(0); free != 64*mib {
		t.Fatalf("free = %d after the last allocation of a destroyed pool went", free)
	}
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
	ok(t, err)
	_, err = d.MemcpyDtoHAsyncN(ptr+1000, 25)
	wantErr(t, err, cudart.ErrInvalidValue)
	_, err = d.MemcpyDtoHAsyncN(ptr+4096, 1) // in the pool, never allocated
	wantErr(t, err, cudart.ErrInvalidValue)
	_, err = d.MemcpyDtoHAsyncN(12345, 1)
	wantErr(t, err, cudart.ErrInvalidValue)
	wantErr(t, d.FreeAsync(0, ptr+512, 0), cudart.ErrInvalidValue)
	wantErr(t, d.FreeAsync(0, 12345, 0), cudart.ErrInvalidValue)
	wantErr(t, d.MemsetAsync(0, ptr, 1, 2048, 0), cudart.ErrInvalidValue)
	ok(t, d.MemsetAsync(0, ptr, 0, 0, 0))
	ok(t, d.Err()) // wild addresses are errors, not violations

	// A freed allocation is a use after release.
	ok(t, d.FreeAsync(0, ptr, 0))
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
	ok(t, err)
	a := d.alloc(p, 64)
	b, err := d.MallocFromPoolAsync(1, 64, q, 0)
	ok(t, err)
	ok(t, d.StreamSynchronize(1, 0)) // the allocation has run: any stream may use it
	ok(t, d.MemsetAsync(0, a, 'z', 64, 0))
	d.write(a+8, []byte("hello"))
	ok(t, d.MemcpyDtoDAsync(0, b, a, 64, 0)) // across devices, as cudaMemcpyDefault
	ok(t, d.MemcpyDtoDAsync(0, a+1, a, 16, 0))
	ok(t, d.sync()) // device 1's default stream is another stream
	got := make([]byte, 16)
	ok(t, d.MemcpyDtoHAsync(1, got, b, 0))
	if string(got) != "zzzzzzzzhellozzz" {
		t.Fatalf("copy across devices read %q", got)
	}
	d.wantBytes(a, []byte("zzzzzzzzzhellozz")) // overlapping copies move
	ok(t, d.StreamSynchronize(0, 0))
}

func TestPoolAccess(t *testing.T) {
	d := newFx(t)
	p := d.pool(ipcProps(0))
	get := func(dev int32) cudart.AccessFlags {
		f, err := d.MemPoolGetAccess(0, p, cudart.DeviceLocation(int(dev)))
		ok(t, err)
		return f
	}
	if get(0) != cudart.AccessReadWrite || get(1) != cudart.AccessNone {
		t.Fatalf("default access: device 0 %d, device 1 %d", get(0), get(1))
	}
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
	if get(1) != cudart.AccessNone {
		t.Fatal("a failed MemPoolSetAccess applied part of its descriptors")
	}
	ok(t, d.MemPoolSetAccess(0, p, desc(1, cudart.AccessRead)))
	if get(1) != cudart.AccessRead {
		t.Fatalf("device 1 access = %d after granting read", get(1))
	}
	_, err = d.MemPoolGetAccess(0, p, cudart.Location{Type: cudart.LocationHost})
	wantErr(t, err, cudart.ErrInvalidValue)

	np := newFx(t, WithPeerAccess(false))
	q := np.pool(ipcProps(0))
	wantErr(t, np.MemPoolSetAccess(0, q, desc(1, cudart.AccessReadWrite)), cudart.ErrInvalidDevice)
}
