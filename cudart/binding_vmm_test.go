//go:build cgo && linux

package cudart_test

import (
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/cudapool/cudapool/cudart"
)

// The fake driver answers each VMM call from its arguments (testdata/fakecuda.c):
// every argument reaches its place, and the results come back.
func TestFakeVMMArgumentsAndResults(t *testing.T) {
	v, err := cudart.VMMOf(loadFake(t))
	require.NoError(t, err)
	const dev = 2
	h, err := v.MemCreate(dev, 4<<20, cudart.HandleTypePosixFD|cudart.HandleTypeFabric)
	require.NoError(t, err)
	require.Equal(t, cudart.MemHandle(4<<20+9*16+dev), h, "size, handle types and device")
	sh, err := v.MemExportToShareableHandle(dev, 41, cudart.HandleTypePosixFD)
	require.NoError(t, err)
	require.Equal(t, cudart.ShareableHandle{Type: cudart.HandleTypePosixFD, FD: 42}, sh)
	sh, err = v.MemExportToShareableHandle(dev, 7, cudart.HandleTypeFabric)
	require.NoError(t, err)
	require.Equal(t, -1, sh.FD)
	require.Equal(t, byte(7), sh.Fabric[0])
	require.Equal(t, byte(7+63), sh.Fabric[63])
	got, err := v.MemImportFromShareableHandle(dev, cudart.ShareableHandle{Type: cudart.HandleTypePosixFD, FD: 99})
	require.NoError(t, err)
	require.Equal(t, cudart.MemHandle(100), got, "the descriptor travels as the pointer's value")
	got, err = v.MemImportFromShareableHandle(dev, sh)
	require.NoError(t, err)
	require.Equal(t, cudart.MemHandle(7+70+8), got, "the FABRIC handle's bytes travel by pointer")
	ptr, err := v.MemAddressReserve(dev, 6<<20, 2<<20)
	require.NoError(t, err)
	require.Equal(t, cudart.DevicePtr(8<<20), ptr)
	require.NoError(t, v.MemMap(dev, ptr, 2<<20, 0, h))
	require.NoError(t, v.MemSetAccess(dev, ptr, 2<<20, []cudart.AccessDesc{
		{Location: cudart.DeviceLocation(0), Flags: cudart.AccessRead},
		{Location: cudart.DeviceLocation(1), Flags: cudart.AccessReadWrite},
	}))
	require.NoError(t, v.MemUnmap(dev, ptr, 2<<20))
	require.NoError(t, v.MemAddressFree(dev, ptr, 6<<20))
	require.NoError(t, v.MemRelease(dev, h))
}

// An argument the fake calls bad fails the call with 1000 + its position, named by
// the driver: each argument is where the driver looks for it.
func TestFakeVMMArgumentsInTheirPlaces(t *testing.T) {
	v, err := cudart.VMMOf(loadFake(t))
	require.NoError(t, err)
	const bad, dev = 0xbad, 1
	rw := []cudart.AccessDesc{{Location: cudart.DeviceLocation(0), Flags: cudart.AccessReadWrite}}
	badFlags := []cudart.AccessDesc{{Location: cudart.DeviceLocation(0), Flags: bad}}
	discard := func(_ any, err error) error { return err }
	for _, tc := range []struct {
		op   string
		pos  int
		call func() error
	}{
		{"cuMemCreate", 2, func() error { return discard(v.MemCreate(dev, bad, cudart.HandleTypePosixFD)) }},
		{"cuMemRelease", 1, func() error { return v.MemRelease(dev, bad) }},
		{"cuMemExportToShareableHandle", 2, func() error { return discard(v.MemExportToShareableHandle(dev, bad, cudart.HandleTypePosixFD)) }},
		{"cuMemImportFromShareableHandle", 2, func() error {
			return discard(v.MemImportFromShareableHandle(dev, cudart.ShareableHandle{Type: cudart.HandleTypePosixFD, FD: bad}))
		}},
		{"cuMemAddressReserve", 2, func() error { return discard(v.MemAddressReserve(dev, bad, 0)) }},
		{"cuMemAddressReserve", 3, func() error { return discard(v.MemAddressReserve(dev, 1, bad)) }},
		{"cuMemAddressFree", 1, func() error { return v.MemAddressFree(dev, bad, 1) }},
		{"cuMemAddressFree", 2, func() error { return v.MemAddressFree(dev, 1, bad) }},
		{"cuMemMap", 1, func() error { return v.MemMap(dev, bad, 1, 1, 1) }},
		{"cuMemMap", 2, func() error { return v.MemMap(dev, 1, bad, 1, 1) }},
		{"cuMemMap", 3, func() error { return v.MemMap(dev, 1, 1, bad, 1) }},
		{"cuMemMap", 4, func() error { return v.MemMap(dev, 1, 1, 1, bad) }},
		{"cuMemUnmap", 1, func() error { return v.MemUnmap(dev, bad, 1) }},
		{"cuMemUnmap", 2, func() error { return v.MemUnmap(dev, 1, bad) }},
		{"cuMemSetAccess", 1, func() error { return v.MemSetAccess(dev, bad, 1, rw) }},
		{"cuMemSetAccess", 2, func() error { return v.MemSetAccess(dev, 1, bad, rw) }},
		{"cuMemSetAccess", 3, func() error { return v.MemSetAccess(dev, 1, 1, badFlags) }},
		{"cuStreamWriteValue32", 1, func() error { return v.StreamWriteValue32(dev, 1, 1, bad) }},
		{"cuStreamWriteValue32", 2, func() error { return v.StreamWriteValue32(dev, bad, 1, 1) }},
		{"cuStreamWriteValue32", 3, func() error { return v.StreamWriteValue32(dev, 1, bad, 1) }},
		{"cuStreamWaitValue32", 1, func() error { return v.StreamWaitValue32(dev, 1, 1, cudart.WaitEQ, bad) }},
		{"cuStreamWaitValue32", 2, func() error { return v.StreamWaitValue32(dev, bad, 1, cudart.WaitEQ, 1) }},
		{"cuStreamWaitValue32", 3, func() error { return v.StreamWaitValue32(dev, 1, bad, cudart.WaitEQ, 1) }},
		{"cuStreamWaitValue32", 4, func() error { return v.StreamWaitValue32(dev, 1, 1, cudart.WaitNor, 1) }},
	} {
		wantError(t, tc.call(), tc.op, cudart.Code(1000+tc.pos))
	}
}

// Arguments the binding refuses before calling the driver, and a device the runtime
// refuses while making it current.
func TestFakeVMMRefusals(t *testing.T) {
	v, err := cudart.VMMOf(loadFake(t))
	require.NoError(t, err)
	_, err = v.MemCreate(0, 2<<20, 0x2)
	refused(t, err, "cuMemCreate", "handle type HandleType(0x2)")
	_, err = v.MemExportToShareableHandle(0, 1, cudart.HandleTypeNone)
	refused(t, err, "cuMemExportToShareableHandle", "handle type none")
	_, err = v.MemImportFromShareableHandle(0, cudart.ShareableHandle{Type: cudart.HandleTypePosixFD, FD: -1})
	refused(t, err, "cuMemImportFromShareableHandle", "-1 is not a file descriptor")
	refused(t, v.MemSetAccess(0, 1, 1, nil), "cuMemSetAccess", "no access to set")
	refused(t, v.StreamWaitValue32(0, 1, 1, 4, 1), "cuStreamWaitValue32", "unknown wait condition 4")
	_, err = v.MemAddressReserve(7, 2<<20, 0)
	wantError(t, err, "cudaSetDevice (for cuMemAddressReserve)", cudart.ErrInvalidDevice)
}
