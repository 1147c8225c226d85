//go:build linux

package cudarttest

import (
	"testing"

	"github.com/cudapool/cudapool/cudart"
	"github.com/stretchr/testify/require"
)

// fx wraps a Device with helpers that fail the test on an unexpected error.
type fx struct {
	t testing.TB
	*Device
}

func newFx(t testing.TB, opts ...Option) fx {
	t.Helper()
	d := ForTest(t, opts...) // logs the seed if the test fails
	return fx{t, d}
}

// wantErr fails unless err matches every target.
func wantErr(t testing.TB, err error, targets ...error) {
	t.Helper()
	require.Error(t, err, "want %v", targets)
	for _, target := range targets {
		require.ErrorIs(t, err, target)
	}
}

// wantViolation fails unless err reports a violation of kind.
func wantViolation(t testing.TB, err error, kind ViolationKind) {
	t.Helper()
	var v Violation
	require.ErrorAs(t, err, &v, "want a %v violation", kind)
	require.Equal(t, kind, v.Kind, "error %v: want a %v violation", err, kind)
}

func ipcProps(dev int) cudart.PoolProps {
	return cudart.PoolProps{HandleTypes: cudart.HandleTypePosixFD, Location: cudart.DeviceLocation(dev)}
}

func (f fx) pool(props cudart.PoolProps) cudart.MemPool {
	f.t.Helper()
	p, err := f.MemPoolCreate(props)
	require.NoError(f.t, err)
	return p
}

func (f fx) alloc(p cudart.MemPool, size uint64) cudart.DevicePtr {
	f.t.Helper()
	ptr, err := f.MallocFromPoolAsync(0, size, p, 0)
	require.NoError(f.t, err)
	return ptr
}

func (f fx) write(ptr cudart.DevicePtr, data []byte) {
	f.t.Helper()
	require.NoError(f.t, f.MemcpyHtoDAsync(0, ptr, data, 0))
}

func (f fx) read(ptr cudart.DevicePtr, n int) []byte {
	f.t.Helper()
	buf := make([]byte, n)
	require.NoError(f.t, f.MemcpyDtoHAsync(0, buf, ptr, 0))
	return buf
}

func (f fx) wantBytes(ptr cudart.DevicePtr, want []byte) {
	f.t.Helper()
	require.Equal(f.t, string(want), string(f.read(ptr, len(want))), "read %#x", uint64(ptr))
}

// sync waits for the work queued on f's default stream of device 0 and returns
// the violations it found.
func (f fx) sync() error { return f.StreamSynchronize(0, 0) }

// stall holds f's default stream of device 0 until the returned resume is called (or
// the test ends).
func (f fx) stall() (resume func()) {
	f.t.Helper()
	resume, err := f.Stall(0, 0)
	require.NoError(f.t, err)
	f.t.Cleanup(resume)
	return resume
}

func (f fx) attr(p cudart.MemPool, a cudart.PoolAttr) uint64 {
	f.t.Helper()
	v, err := f.MemPoolGetAttribute(0, p, a)
	require.NoError(f.t, err)
	return v
}

// free is MemGetInfo's free memory of dev.
func (f fx) free(dev int) uint64 {
	f.t.Helper()
	free, _, err := f.MemGetInfo(dev)
	require.NoError(f.t, err)
	return free
}

// exported creates an IPC pool on device 0 and exports it; the caller owns the fd.
func (f fx) exported() (cudart.MemPool, int) {
	f.t.Helper()
	p := f.pool(ipcProps(0))
	h, err := f.MemPoolExportToShareableHandle(0, p, cudart.HandleTypePosixFD)
	require.NoError(f.t, err)
	return p, h.FD
}

func (f fx) importPool(fd int) cudart.MemPool {
	f.t.Helper()
	p, err := f.MemPoolImportFromShareableHandle(0, cudart.ShareableHandle{Type: cudart.HandleTypePosixFD, FD: fd})
	require.NoError(f.t, err)
	return p
}

func (f fx) exportPtr(ptr cudart.DevicePtr) cudart.PtrExportData {
	f.t.Helper()
	data, err := f.MemPoolExportPointer(0, ptr)
	require.NoError(f.t, err)
	return data
}

func (f fx) importPtr(p cudart.MemPool, data cudart.PtrExportData) cudart.DevicePtr {
	f.t.Helper()
	ptr, err := f.MemPoolImportPointer(0, p, data)
	require.NoError(f.t, err)
	return ptr
}

// ipcEvent creates an IPC event in f and opens it in g.
func (f fx) ipcEvent(g fx) (mine, theirs cudart.Event) {
	f.t.Helper()
	e, err := f.EventCreate(0, cudart.EventIPC)
	require.NoError(f.t, err)
	h, err := f.IpcGetEventHandle(0, e)
	require.NoError(f.t, err)
	o, err := g.IpcOpenEventHandle(0, h)
	require.NoError(f.t, err)
	return e, o
}

// ready records e in f and waits on it in g's default stream: what an exporter and
// importer do to order the importer's reads after the exporter's writes.
func ready(f fx, e cudart.Event, g fx, o cudart.Event) {
	f.t.Helper()
	require.NoError(f.t, f.EventRecord(0, e, 0))
	require.NoError(f.t, g.StreamWaitEvent(0, 0, o))
}
