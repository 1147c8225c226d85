package cudarttest

import (
	"bytes"
	"errors"
	"testing"

	"github.com/cudapool/cudapool/cudart"
)

// fx wraps a Device with helpers that fail the test on an unexpected error.
type fx struct {
	t testing.TB
	*Device
}

func newFx(t testing.TB, opts ...Option) fx {
	t.Helper()
	d := New(opts...)
	t.Cleanup(func() { d.Close() })
	return fx{t, d}
}

func ok(t testing.TB, err error) {
	t.Helper()
	if err != nil {
		t.Fatal(err)
	}
}

// wantErr fails unless err matches every target.
func wantErr(t testing.TB, err error, targets ...error) {
	t.Helper()
	if err == nil {
		t.Fatalf("got no error, want %v", targets)
	}
	for _, target := range targets {
		if !errors.Is(err, target) {
			t.Fatalf("error %v does not match %v", err, target)
		}
	}
}

// wantViolation fails unless err reports a violation of kind.
func wantViolation(t testing.TB, err error, kind ViolationKind) {
	t.Helper()
	var v Violation
	if !errors.As(err, &v) || v.Kind != kind {
		t.Fatalf("error %v: want a %v violation", err, kind)
	}
}

func ipcProps(dev int) cudart.PoolProps {
	return cudart.PoolProps{HandleTypes: cudart.HandleTypePosixFD, Location: cudart.DeviceLocation(dev)}
}

func (f fx) pool(props cudart.PoolProps) cudart.MemPool {
	f.t.Helper()
	p, err := f.MemPoolCreate(props)
	ok(f.t, err)
	return p
}

func (f fx) alloc(p cudart.MemPool, size uint64) cudart.DevicePtr {
	f.t.Helper()
	ptr, err := f.MallocFromPoolAsync(0, size, p, 0)
	ok(f.t, err)
	return ptr
}

func (f fx) write(ptr cudart.DevicePtr, data []byte) {
	f.t.Helper()
	ok(f.t, f.MemcpyHtoDAsync(0, ptr, data, 0))
}

func (f fx) read(ptr cudart.DevicePtr, n int) []byte {
	f.t.Helper()
	buf := make([]byte, n)
	ok(f.t, f.MemcpyDtoHAsync(0, buf, ptr, 0))
	return buf
}

func (f fx) wantBytes(ptr cudart.DevicePtr, want []byte) {
	f.t.Helper()
	if got := f.read(ptr, len(want)); !bytes.Equal(got, want) {
		f.t.Fatalf("read %#x: got %q, want %q", uint64(ptr), got, want)
	}
}

// sync waits for the work queued on f's default stream of device 0 and returns
// the violations it found.
func (f fx) sync() error { return f.StreamSynchronize(0, 0) }

// stall holds f's default stream of device 0 until the returned resume is called (or
// the test ends).
func (f fx) stall() (resume func()) {
	f.t.Helper()
	resume, err := f.Stall(0, 0)
	ok(f.t, err)
	f.t.Cleanup(resume)
	return resume
}

func (f fx) attr(p cudart.MemPool, a cudart.PoolAttr) uint64 {
	f.t.Helper()
	v, err := f.MemPoolGetAttribute(0, p, a)
	ok(f.t, err)
	return v
}

// exported creates an IPC pool on device 0 and exports it; the caller owns the fd.
func (f fx) exported() (cudart.MemPool, int) {
	f.t.Helper()
	p := f.pool(ipcProps(0))
	h, err := f.MemPoolExportToShareableHandle(0, p, cudart.HandleTypePosixFD)
	ok(f.t, err)
	return p, h.FD
}

func (f fx) importPool(fd int) cudart.MemPool {
	f.t.Helper()
	p, err := f.MemPoolImportFromShareableHandle(0, cudart.ShareableHandle{Type: cudart.HandleTypePosixFD, FD: fd})
	ok(f.t, err)
	return p
}

func (f fx) exportPtr(ptr cudart.DevicePtr) cudart.PtrExportData {
	f.t.Helper()
	data, err := f.MemPoolExportPointer(0, ptr)
	ok(f.t, err)
	return data
}

func (f fx) importPtr(p cudart.MemPool, data cudart.PtrExportData) cudart.DevicePtr {
	f.t.Helper()
	ptr, err := f.MemPoolImportPointer(0, p, data)
	ok(f.t, err)
	return ptr
}

// ipcEvent creates an IPC event in f and opens it in g.
func (f fx) ipcEvent(g fx) (mine, theirs cudart.Event) {
	f.t.Helper()
	e, err := f.EventCreate(0, cudart.EventIPC)
	ok(f.t, err)
	h, err := f.IpcGetEventHandle(0, e)
	ok(f.t, err)
	o, err := g.IpcOpenEventHandle(0, h)
	ok(f.t, err)
	return e, o
}

// ready records e in f and waits on it in g's default stream: what an exporter and
// importer do to order the importer's reads after the exporter's writes.
func ready(f fx, e cudart.Event, g fx, o cudart.Event) {
	f.t.Helper()
	ok(f.t, f.EventRecord(0, e, 0))
	ok(f.t, g.StreamWaitEvent(0, 0, o))
}
