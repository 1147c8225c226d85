//go:build linux

package cudarttest

import (
	"testing"

	"github.com/stretchr/testify/require"
	"golang.org/x/sys/unix"

	"github.com/cudapool/cudapool/cudart"
)

const gran = 2 << 20

var rw0 = []cudart.AccessDesc{{Location: cudart.DeviceLocation(0), Flags: cudart.AccessReadWrite}}

// chunk creates a POSIX-shareable chunk of n granules on device 0.
func (f fx) chunk(n uint64) cudart.MemHandle {
	f.t.Helper()
	h, err := f.MemCreate(0, n*gran, cudart.HandleTypePosixFD)
	require.NoError(f.t, err)
	return h
}

func (f fx) exportChunk(h cudart.MemHandle) int {
	f.t.Helper()
	sh, err := f.MemExportToShareableHandle(0, h, cudart.HandleTypePosixFD)
	require.NoError(f.t, err)
	f.t.Cleanup(func() { _ = unix.Close(sh.FD) }) // test cleanup; closed twice is harmless here
	return sh.FD
}

func (f fx) importChunk(fd int) cudart.MemHandle {
	f.t.Helper()
	h, err := f.MemImportFromShareableHandle(0, cudart.ShareableHandle{Type: cudart.HandleTypePosixFD, FD: fd})
	require.NoError(f.t, err)
	return h
}

func (f fx) reserve(n uint64) cudart.DevicePtr {
	f.t.Helper()
	ptr, err := f.MemAddressReserve(0, n*gran, 0)
	require.NoError(f.t, err)
	return ptr
}

// mapRW maps all of h (n granules) at ptr, readable and writable from device 0.
func (f fx) mapRW(ptr cudart.DevicePtr, n uint64, h cudart.MemHandle) {
	f.t.Helper()
	require.NoError(f.t, f.MemMap(0, ptr, n*gran, 0, h))
	require.NoError(f.t, f.MemSetAccess(0, ptr, n*gran, rw0))
}

// sharedChunk maps one chunk of maker's in maker and in user, readable and writable, and
// returns its addresses in each.
func sharedChunk(maker, user fx) (p, q cudart.DevicePtr) {
	maker.t.Helper()
	h := maker.chunk(1)
	p = maker.reserve(1)
	maker.mapRW(p, 1, h)
	q = user.reserve(1)
	user.mapRW(q, 1, user.importChunk(maker.exportChunk(h)))
	return p, q
}

// Two chunks made in one Device, mapped contiguously in another that imported their
// descriptors: a copy across the boundary lands in both, the maker sees it, and the
// importer still reads it once the maker released its handles and exited.
func TestVMMChunksMapContiguouslyInAnImporter(t *testing.T) {
	maker, user := newFx(t), newFx(t)
	a, b := maker.chunk(1), maker.chunk(2)
	fa, fb := maker.exportChunk(a), maker.exportChunk(b)
	mp := maker.reserve(3)
	maker.mapRW(mp, 1, a)
	maker.mapRW(mp+gran, 2, b)

	up := user.reserve(4)
	user.mapRW(up, 1, user.importChunk(fa))
	user.mapRW(up+gran, 2, user.importChunk(fb))
	across := []byte("these bytes cross the boundary of two chunks")
	at := cudart.DevicePtr(gran - 10)
	user.write(up+at, across)
	e, o := user.ipcEvent(maker)
	ready(user, e, maker, o)
	maker.wantBytes(mp+at, across)

	require.NoError(t, maker.sync())
	require.NoError(t, maker.MemUnmap(0, mp, gran))
	require.NoError(t, maker.MemRelease(0, a))
	require.NoError(t, maker.MemRelease(0, b))
	require.NoError(t, maker.Err())
	require.NoError(t, maker.Close())
	user.wantBytes(up+at, across)
	require.NoError(t, user.Err())
}

// The descriptor alone keeps the memory: the maker releases its handle and unmaps
// before anyone imported it.
func TestVMMDescriptorKeepsTheMemory(t *testing.T) {
	maker, user := newFx(t), newFx(t)
	h := maker.chunk(1)
	p := maker.reserve(1)
	maker.mapRW(p, 1, h)
	maker.write(p+5, []byte("kept"))
	require.NoError(t, maker.sync())
	fd := maker.exportChunk(h)
	require.NoError(t, maker.MemUnmap(0, p, gran))
	require.NoError(t, maker.MemRelease(0, h))
	require.NoError(t, maker.MemAddressFree(0, p, gran))
	require.NoError(t, maker.Close())

	q := user.reserve(1)
	user.mapRW(q, 1, user.importChunk(fd))
	user.wantBytes(q+5, []byte("kept"))
}

func TestVMMSizesAndOffsetsAreGranules(t *testing.T) {
	f := newFx(t)
	_, err := f.MemCreate(0, gran+4096, cudart.HandleTypePosixFD)
	wantErr(t, err, cudart.ErrInvalidValue)
	_, err = f.MemCreate(0, 0, cudart.HandleTypePosixFD)
	wantErr(t, err, cudart.ErrInvalidValue)
	_, err = f.MemAddressReserve(0, gran/2, 0)
	wantErr(t, err, cudart.ErrInvalidValue)
	_, err = f.MemAddressReserve(0, gran, 3*gran)
	wantErr(t, err, cudart.ErrInvalidValue)
	h := f.chunk(2)
	p := f.reserve(4)
	wantErr(t, f.MemMap(0, p+4096, gran, 0, h), cudart.ErrInvalidValue)
	wantErr(t, f.MemMap(0, p, gran, 4096, h), cudart.ErrInvalidValue)
	wantErr(t, f.MemMap(0, p, gran+4096, 0, h), cudart.ErrInvalidValue)
	wantErr(t, f.MemMap(0, p, 2*gran, gran, h), cudart.ErrInvalidValue)     // past the chunk's end
	wantErr(t, f.MemMap(0, p+3*gran, 2*gran, 0, h), cudart.ErrInvalidValue) // past the reservation's end
	// A part of a chunk maps where asked.
	require.NoError(t, f.MemMap(0, p+3*gran, gran, gran, h))
	require.NoError(t, f.MemSetAccess(0, p+3*gran, gran, rw0))
	require.NoError(t, f.Err())
}

func TestVMMMappingRules(t *testing.T) {
	f := newFx(t)
	h := f.chunk(2)
	p := f.reserve(4)
	require.NoError(t, f.MemMap(0, p, 2*gran, 0, h))

	// New mappings are inaccessible until granted.
	err := f.MemcpyHtoDAsync(0, p, []byte("x"), 0)
	wantErr(t, err, cudart.ErrInvalidValue)
	wantViolation(t, err, ViolationAccessDenied)
	require.NoError(t, f.MemSetAccess(0, p, 2*gran, []cudart.AccessDesc{{Location: cudart.DeviceLocation(0), Flags: cudart.AccessRead}}))
	wantViolation(t, f.MemcpyHtoDAsync(0, p, []byte("x"), 0), ViolationAccessDenied)
	wantErr(t, f.MemSetAccess(0, p, gran, rw0), cudart.ErrInvalidValue) // part of a mapping
	wantErr(t, f.MemSetAccess(0, p, 3*gran, rw0), cudart.ErrInvalidValue)
	require.NoError(t, f.MemSetAccess(0, p, 2*gran, rw0))
	f.write(p, []byte("mapped"))

	// A mapped part is not mapped again; unmap takes exactly one mapping.
	wantErr(t, f.MemMap(0, p+gran, 2*gran, 0, f.chunk(2)), cudart.ErrInvalidValue)
	wantErr(t, f.MemUnmap(0, p, gran), cudart.ErrInvalidValue)
	wantErr(t, f.MemAddressFree(0, p, 4*gran), cudart.ErrInvalidValue) // still mapped

	// Unmapping under queued work is refused; after it, a use is a use after release.
	resume := f.stall()
	f.write(p, []byte("queued"))
	wantViolation(t, f.MemUnmap(0, p, 2*gran), ViolationUseAfterRelease)
	resume()
	require.NoError(t, f.sync())
	require.NoError(t, f.MemUnmap(0, p, 2*gran))
	err = f.MemcpyHtoDAsync(0, p, []byte("x"), 0)
	wantErr(t, err, cudart.ErrInvalidValue)
	wantViolation(t, err, ViolationUseAfterRelease)
	wantErr(t, f.MemcpyHtoDAsync(0, p+3*gran, []byte("x"), 0), cudart.ErrInvalidValue) // never mapped

	// Mapped again, the bytes are the chunk's, and access must be granted again.
	require.NoError(t, f.MemMap(0, p+2*gran, 2*gran, 0, h))
	wantViolation(t, f.MemcpyHtoDAsync(0, p+2*gran, []byte("x"), 0), ViolationAccessDenied)
	require.NoError(t, f.MemSetAccess(0, p+2*gran, 2*gran, rw0))
	f.wantBytes(p+2*gran, []byte("queued"))

	// Release of a mapped chunk keeps its memory until the unmap; a released handle
	// is not used again.
	require.NoError(t, f.MemRelease(0, h))
	f.wantBytes(p+2*gran, []byte("queued"))
	wantViolation(t, f.MemMap(0, p, gran, 0, h), ViolationUseAfterRelease)
	wantViolation(t, f.MemRelease(0, h), ViolationUseAfterRelease)
	require.NoError(t, f.MemUnmap(0, p+2*gran, 2*gran))
	require.NoError(t, f.MemAddressFree(0, p, 4*gran))
}

// MemGetInfo counts a chunk from its creation until its last handle and mapping in
// the Device are gone.
func TestVMMMemoryIsCountedUntilTheLastMapping(t *testing.T) {
	f := newFx(t)
	before := f.free(0)
	h := f.chunk(3)
	require.Equal(t, before-3*gran, f.free(0))
	p := f.reserve(3)
	f.mapRW(p, 3, h)
	require.NoError(t, f.MemRelease(0, h))
	require.Equal(t, before-3*gran, f.free(0), "mapped")
	require.NoError(t, f.MemUnmap(0, p, 3*gran))
	require.Equal(t, before, f.free(0))
}

func TestVMMImportRefusesWhatIsNoChunk(t *testing.T) {
	f := newFx(t)
	imp := func(fd int) error {
		_, err := f.MemImportFromShareableHandle(0, cudart.ShareableHandle{Type: cudart.HandleTypePosixFD, FD: fd})
		return err
	}
	fd := f.exportChunk(f.chunk(1))
	closed, err := unix.Dup(fd)
	require.NoError(t, err)
	require.NoError(t, unix.Close(closed))
	wantErr(t, imp(closed), cudart.ErrInvalidValue)
	wantErr(t, imp(-1), cudart.ErrInvalidValue)
	var pipe [2]int
	require.NoError(t, unix.Pipe(pipe[:]))
	defer func() { _ = unix.Close(pipe[0]); _ = unix.Close(pipe[1]) }() // test cleanup
	wantErr(t, imp(pipe[0]), cudart.ErrInvalidValue)
	_, poolFD := f.exported()
	defer func() { _ = unix.Close(poolFD) }() // test cleanup
	wantErr(t, imp(poolFD), cudart.ErrInvalidValue)

	// An imported handle is not exported again: its descriptor is passed on instead.
	h := f.importChunk(fd)
	_, err = f.MemExportToShareableHandle(0, h, cudart.HandleTypePosixFD)
	wantErr(t, err, cudart.ErrInvalidValue)
	// A chunk that is not shareable is not exported.
	n, err := f.MemCreate(0, gran, cudart.HandleTypeNone)
	require.NoError(t, err)
	_, err = f.MemExportToShareableHandle(0, n, cudart.HandleTypePosixFD)
	wantErr(t, err, cudart.ErrInvalidValue)
}

func TestVMMFabric(t *testing.T) {
	f := newFx(t)
	_, err := f.MemCreate(0, gran, cudart.HandleTypeFabric)
	wantErr(t, err, cudart.ErrNotPermitted)
	_, err = f.MemImportFromShareableHandle(0, cudart.ShareableHandle{Type: cudart.HandleTypeFabric})
	wantErr(t, err, cudart.ErrNotPermitted)

	maker, user := newFx(t, WithFabric()), newFx(t, WithFabric())
	h, err := maker.MemCreate(0, gran, cudart.HandleTypeFabric|cudart.HandleTypePosixFD)
	require.NoError(t, err)
	p := maker.reserve(1)
	maker.mapRW(p, 1, h)
	maker.write(p, []byte("over the fabric"))
	require.NoError(t, maker.sync())
	sh, err := maker.MemExportToShareableHandle(0, h, cudart.HandleTypeFabric)
	require.NoError(t, err)
	require.Equal(t, -1, sh.FD)
	g, err := user.MemImportFromShareableHandle(0, sh)
	require.NoError(t, err)
	q := user.reserve(1)
	user.mapRW(q, 1, g)
	user.wantBytes(q, []byte("over the fabric"))

	forged := sh
	forged.Fabric[24]++ // another inode
	_, err = user.MemImportFromShareableHandle(0, forged)
	wantErr(t, err, cudart.ErrInvalidValue)
}

// Accesses of one chunk from two Devices are checked for order as pool memory's are.
func TestVMMUnorderedAccessAcrossDevices(t *testing.T) {
	maker, user := newFx(t), newFx(t)
	p, q := sharedChunk(maker, user)
	resume := maker.stall()
	maker.write(p, []byte("late"))
	resume()
	require.NoError(t, maker.sync())
	// The user's stream was not ordered after the maker's write... but the maker's
	// write had completed when the user queued its read, so the read is ordered.
	user.wantBytes(q, []byte("late"))
	require.NoError(t, user.Err())

	// A write by the user still queued when the maker reads is unordered.
	stalled := user.stall()
	user.write(q+100, []byte("racing"))
	buf := make([]byte, 6)
	require.NoError(t, maker.MemcpyDtoHAsync(0, buf, p+100, 0))
	stalled()
	err := user.sync()
	wantViolation(t, err, ViolationUnorderedWrite)
}

// A stream of one Device waits for a word another Device's stream writes behind its
// data: the waiting stream holds until then, and reads the data in order.
func TestVMMStreamMemoryOperations(t *testing.T) {
	maker, user := newFx(t), newFx(t)
	p, q := sharedChunk(maker, user)
	const flag = gran - 4

	require.NoError(t, user.StreamWaitValue32(0, q+flag, 7, cudart.WaitGEQ, 0))
	got := make([]byte, 4)
	done := make(chan error, 1)
	go func() { done <- user.MemcpyDtoHAsync(0, got, q+64, 0) }()
	idle, err := user.StreamQuery(0, 0)
	require.NoError(t, err)
	require.False(t, idle, "the wait did not hold the stream")

	maker.write(p+64, []byte("data"))
	require.NoError(t, maker.StreamWriteValue32(0, p+flag, 6, 0))
	require.NoError(t, maker.StreamWriteValue32(0, p+flag, 8, 0))
	require.NoError(t, <-done)
	require.Equal(t, "data", string(got))
	require.NoError(t, user.Err())
	require.NoError(t, maker.Err())

	for _, c := range []struct {
		cond        cudart.WaitCond
		word, value uint32
		met         bool
	}{
		{cudart.WaitGEQ, 8, 7, true}, {cudart.WaitGEQ, 6, 7, false}, {cudart.WaitGEQ, 1, 0xffffffff, true},
		{cudart.WaitEQ, 7, 7, true}, {cudart.WaitEQ, 8, 7, false},
		{cudart.WaitAnd, 6, 2, true}, {cudart.WaitAnd, 4, 2, false},
		{cudart.WaitNor, 1, 2, true}, {cudart.WaitNor, 0xfffffffe, 1, false},
	} {
		require.Equal(t, c.met, c.cond.Met(c.word, c.value), "%d.Met(%#x, %#x)", c.cond, c.word, c.value)
	}
}

func TestVMMStreamMemoryOperationsRefusals(t *testing.T) {
	f := newFx(t)
	p := f.reserve(1)
	f.mapRW(p, 1, f.chunk(1))
	wantErr(t, f.StreamWriteValue32(0, p+2, 1, 0), cudart.ErrInvalidValue)
	wantErr(t, f.StreamWaitValue32(0, p, 1, 9, 0), cudart.ErrInvalidValue)
	pool, fd := f.exported()
	defer func() { _ = unix.Close(fd) }() // test cleanup
	ptr := f.alloc(pool, 4096)
	wantErr(t, f.StreamWriteValue32(0, ptr, 1, 0), cudart.ErrInvalidValue) // FACTS 15
	require.NoError(t, f.FreeAsync(0, ptr, 0))
}
