//go:build linux

package cudarttest

import (
	"math/rand/v2"
	"testing"

	"github.com/stretchr/testify/require"
	"golang.org/x/sys/unix"

	"github.com/cudapool/cudapool/cudart"
)

// hostMem maps n bytes of shared anonymous memory, unmapped when the test ends.
func hostMem(t *testing.T, n int) []byte {
	t.Helper()
	mem, err := unix.Mmap(-1, 0, n, unix.PROT_READ|unix.PROT_WRITE, unix.MAP_SHARED|unix.MAP_ANONYMOUS)
	require.NoError(t, err)
	t.Cleanup(func() { _ = unix.Munmap(mem) }) // cleanup: the test is over
	return mem
}

// A batch of scattered pieces of any size and alignment, host to device and device
// to host, gives exactly the bytes that copying each piece one byte at a time does.
func TestMemcpyBatchMatchesAByteReference(t *testing.T) {
	d := newFx(t)
	const hostBytes, devBytes = 1 << 20, 1 << 20
	host := hostMem(t, hostBytes)
	require.NoError(t, d.HostRegister(0, host, cudart.HostRegisterPortable|cudart.HostRegisterMapped))
	hptr, err := d.HostDevicePointer(0, host)
	require.NoError(t, err)
	dev := d.alloc(d.pool(ipcProps(0)), devBytes)

	rng := rand.New(rand.NewPCG(d.Seed(), 1))
	refHost, refDev := make([]byte, hostBytes), make([]byte, devBytes)
	for i := range refHost {
		refHost[i] = byte(rng.Uint32())
		refDev[i] = byte(rng.Uint32())
	}
	copy(host, refHost)
	d.write(dev, refDev)

	// pieces picks n disjoint ranges of each side (sizes 0 to 20,000 bytes, any offset)
	// and pairs them at random.
	pieces := func(n int, toDevice bool) []cudart.CopyPiece {
		ranges := func(space int) [][2]int {
			var rs [][2]int
			at := 0
			for len(rs) < n {
				at += rng.IntN(300)
				size := rng.IntN(20000)
				if at+size > space {
					break
				}
				rs = append(rs, [2]int{at, size})
				at += size
			}
			return rs
		}
		hs, ds := ranges(hostBytes), ranges(devBytes)
		rng.Shuffle(len(ds), func(i, j int) { ds[i], ds[j] = ds[j], ds[i] })
		var ps []cudart.CopyPiece
		for i := range min(len(hs), len(ds)) {
			size := min(hs[i][1], ds[i][1])
			h, dv := hptr+cudart.DevicePtr(hs[i][0]), dev+cudart.DevicePtr(ds[i][0])
			if toDevice {
				ps = append(ps, cudart.CopyPiece{Dst: dv, Src: h, Size: uint64(size)})
				for k := range size {
					refDev[ds[i][0]+k] = refHost[hs[i][0]+k]
				}
			} else {
				ps = append(ps, cudart.CopyPiece{Dst: h, Src: dv, Size: uint64(size)})
				for k := range size {
					refHost[hs[i][0]+k] = refDev[ds[i][0]+k]
				}
			}
		}
		return ps
	}
	for round := range 6 {
		ps := pieces(40, round%2 == 0)
		require.NoError(t, d.MemcpyBatchAsync(0, ps, 0), "round %d", round)
	}
	require.NoError(t, d.sync())
	require.Equal(t, refHost, host, "host memory differs from the byte reference")
	require.Equal(t, refDev, d.read(dev, devBytes), "device memory differs from the byte reference")
	path, err := d.BatchCopyPath(0)
	require.NoError(t, err)
	require.Equal(t, cudart.CopyPathKernel, path)
	require.NoError(t, d.Err())
}

// A batch runs when its stream reaches it, and another stream's copy of the same host
// memory that is not ordered after it is a violation.
func TestMemcpyBatchIsStreamOrdered(t *testing.T) {
	d := newFx(t)
	host := hostMem(t, 4096)
	require.NoError(t, d.HostRegister(0, host, cudart.HostRegisterMapped))
	hptr, err := d.HostDevicePointer(0, host)
	require.NoError(t, err)
	p := d.pool(ipcProps(0))
	dev, dev2 := d.alloc(p, 4096), d.alloc(p, 4096)
	d.write(dev, []byte("spilled"))
	require.NoError(t, d.sync())

	resume := d.stall()
	require.NoError(t, d.MemcpyBatchAsync(0, []cudart.CopyPiece{{Dst: hptr, Src: dev, Size: 7}}, 0))
	require.Equal(t, make([]byte, 7), host[:7], "a batch ran before its stream reached it")
	other, err := d.StreamCreate(0, cudart.StreamNonBlocking)
	require.NoError(t, err)
	require.NoError(t, d.MemcpyBatchAsync(0, []cudart.CopyPiece{{Dst: dev2, Src: hptr, Size: 7}}, other))
	require.NoError(t, d.StreamSynchronize(0, other))
	resume()
	err = d.sync()
	wantViolation(t, err, ViolationUnorderedWrite) // the stalled batch overwrites what the other stream read
	require.Equal(t, "spilled", string(host[:7]))
}

// Registration is checked as the driver checks it, and bad batches fail whole.
func TestHostRegisterRules(t *testing.T) {
	d := newFx(t)
	host := hostMem(t, 8192)
	require.NoError(t, d.HostRegister(0, host[:4096], cudart.HostRegisterPortable))
	wantErr(t, d.HostRegister(0, host[2048:6144], cudart.HostRegisterMapped), cudart.ErrHostAlreadyRegistered)
	wantErr(t, d.HostRegister(0, nil, 0), cudart.ErrInvalidValue)
	wantErr(t, d.HostRegister(0, host[4096:], 0x80), cudart.ErrInvalidValue)
	_, err := d.HostDevicePointer(0, host[:4096])
	wantErr(t, err, cudart.ErrInvalidValue) // not mapped
	_, err = d.HostDevicePointer(0, host[4096:])
	wantErr(t, err, cudart.ErrInvalidValue) // not registered
	wantErr(t, d.HostUnregister(0, host[4096:]), cudart.ErrHostNotRegistered)
	require.NoError(t, d.HostUnregister(0, host[:4096]))

	require.NoError(t, d.HostRegister(0, host, cudart.HostRegisterMapped))
	hptr, err := d.HostDevicePointer(0, host)
	require.NoError(t, err)
	dev := d.alloc(d.pool(ipcProps(0)), 8192)
	wantErr(t, d.MemcpyBatchAsync(0, []cudart.CopyPiece{{Dst: dev, Src: hptr + 8000, Size: 500}}, 0), cudart.ErrInvalidValue)
	wantErr(t, d.MemcpyBatchAsync(0, []cudart.CopyPiece{{Dst: dev, Src: 0x1000, Size: 16}}, 0), cudart.ErrInvalidValue)
	wantViolation(t, d.MemcpyBatchAsync(0, []cudart.CopyPiece{
		{Dst: dev, Src: hptr, Size: 100}, {Dst: dev + 50, Src: hptr + 200, Size: 100},
	}, 0), ViolationUnorderedWrite)
	// Two reads of one range are fine.
	require.NoError(t, d.MemcpyBatchAsync(0, []cudart.CopyPiece{
		{Dst: dev, Src: hptr, Size: 100}, {Dst: dev + 100, Src: hptr, Size: 100},
	}, 0))

	resume := d.stall()
	require.NoError(t, d.MemcpyBatchAsync(0, []cudart.CopyPiece{{Dst: hptr, Src: dev, Size: 100}}, 0))
	wantViolation(t, d.HostUnregister(0, host), ViolationUseAfterRelease)
	resume()
	require.NoError(t, d.sync())
	require.NoError(t, d.HostUnregister(0, host))
}
