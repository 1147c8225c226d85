//go:build cgo && linux

package cudart

/*
#cgo LDFLAGS: -ldl
#cgo noescape cp_memcpy_from_host
#cgo noescape cp_memcpy_to_host
#cgo noescape cp_mem_pool_set_access
#cgo noescape cp_mem_set_access
#cgo noescape cp_open
#cgo noescape cp_batch_kernel
#cgo noescape cp_batch_memcpy
#cgo noescape cp_batch_pieces
#cgo nocallback cp_batch_kernel
#include "binding.h"
*/
import "C"

import (
	"bytes"
	"fmt"
	"math"
	"strings"
	"sync"
	"sync/atomic"
	"unsafe"
)

// AccessDesc slices are handed to cudaMemPoolSetAccess as they lie in Go memory, so
// their layout must be cudaMemAccessDesc's.
const (
	_ = uint(unsafe.Sizeof(AccessDesc{}) - C.sizeof_cp_access_desc)
	_ = uint(C.sizeof_cp_access_desc - unsafe.Sizeof(AccessDesc{}))
	_ = uint(unsafe.Offsetof(AccessDesc{}.Flags) - 8)
	_ = uint(8 - unsafe.Offsetof(AccessDesc{}.Flags))
)

// library is a Runtime backed by a loaded libcudart and libcuda.
type library struct {
	// c is the table of entry points, as every trampoline takes it: its address (see
	// CP_LIB in binding.h). It is C memory, never freed.
	c    C.uintptr_t
	name string
	// contained is set once a call returned ErrContained: the driver fails every call
	// after it (FACTS 14), and each such error says the context is lost.
	contained atomic.Bool

	batchMu   sync.Mutex
	batch     map[int]*batchCopy // by device, chosen on first use
	kernel    uintptr            // the batch copy kernel, once loaded
	kernelErr error              // why it did not load
	forcePath CopyPath           // a test's choice of path (export_test.go), 0: the best
}

func load(c *loadConfig) (Runtime, error) {
	lib := (*C.cp_lib)(C.calloc(1, C.sizeof_cp_lib))
	var tried []string
	var runtimeHandle unsafe.Pointer
	var runtimePath string
	for _, path := range c.runtimeCandidates() {
		h, why := open(lib, path, false)
		if h != nil {
			runtimeHandle, runtimePath = h, path
			break
		}
		tried = append(tried, path+": "+why)
	}
	// The driver is tried even when no runtime opened, so that the error names
	// everything that is missing at once.
	driverPath := c.driverCandidate()
	driverHandle, why := open(lib, driverPath, true)
	if driverHandle == nil {
		tried = append(tried, driverPath+": "+why)
	}
	if runtimeHandle == nil || driverHandle == nil {
		for _, h := range []unsafe.Pointer{runtimeHandle, driverHandle} {
			if h != nil {
				C.dlclose(h)
			}
		}
		C.free(unsafe.Pointer(lib))
		return nil, &LoadError{Tried: tried}
	}
	l := &library{c: C.uintptr_t(uintptr(unsafe.Pointer(lib)))}
	l.name = fmt.Sprintf("%s (runtime %s, driver %s)", runtimePath, l.versionString(l.RuntimeVersion), l.versionString(l.DriverVersion))
	return l, nil
}

// open opens path into lib, returning its handle, or nil and why not.
func open(lib *C.cp_lib, path string, driver bool) (unsafe.Pointer, string) {
	cpath := C.CString(path)
	defer C.free(unsafe.Pointer(cpath))
	var msg [4096]byte
	isDriver := C.int(0)
	if driver {
		isDriver = 1
	}
	h := C.cp_open(lib, cpath, isDriver, (*C.char)(unsafe.Pointer(&msg[0])), C.size_t(len(msg)))
	if h == nil {
		return nil, cString(msg[:])
	}
	return h, ""
}

// cString is b up to its first NUL.
func cString(b []byte) string {
	if i := bytes.IndexByte(b, 0); i >= 0 {
		b = b[:i]
	}
	return string(b)
}

func (l *library) versionString(version func() (int, error)) string {
	v, err := version()
	if err != nil {
		return "unknown: " + err.Error()
	}
	return fmt.Sprint(v)
}

func (l *library) Name() string { return l.name }

// check turns a trampoline's status into nil or the error of op; it stays small so
// that the success path inlines.
func (l *library) check(op string, r C.cp_res) error {
	if r.err == 0 {
		return nil
	}
	return l.fail(op, r.err, r.at)
}

func (l *library) checkBlob(op string, r *C.cp_blob_res) error {
	if r.err == 0 {
		return nil
	}
	return l.fail(op, r.err, r.at)
}

// fail is the error of op having returned code at step at of its trampoline.
func (l *library) fail(op string, code C.cp_err, at C.int) error {
	switch at {
	case C.cp_at_get_device:
		op = "cudaGetDevice (for " + op + ")"
	case C.cp_at_set_device:
		op = "cudaSetDevice (for " + op + ")"
	case C.cp_at_cu_init:
		op = "cuInit (for " + op + ")"
	case C.cp_at_cu_device_get:
		op = "cuDeviceGet (for " + op + ")"
	}
	e := NewError(op, Code(code))
	if e.Code == ErrContained {
		l.contained.Store(true)
	}
	e.ContextLost = l.contained.Load()
	var name, text *C.char
	if strings.HasPrefix(op, "cuda") {
		name, text = C.cp_error_name(l.c, code), C.cp_error_string(l.c, code)
	} else {
		// Driver calls return a CUresult, which the driver names; its values agree with
		// cudaError_t's for every Code cudapool names.
		name, text = C.cp_cu_error_name(l.c, code), C.cp_cu_error_string(l.c, code)
	}
	if name != nil {
		e.Name = C.GoString(name)
	}
	if text != nil {
		e.Text = C.GoString(text)
	}
	return e
}

// invalidArgument is the error for an argument cudapool refuses before calling CUDA.
func invalidArgument(op, why string) error {
	e := NewError(op, ErrInvalidValue)
	e.Text = why
	return e
}

func (l *library) DriverVersion() (int, error) {
	r := C.cp_driver_version(l.c)
	if err := l.check("cudaDriverGetVersion", r); err != nil {
		return 0, err
	}
	return int(r.v), nil
}

func (l *library) RuntimeVersion() (int, error) {
	r := C.cp_runtime_version(l.c)
	if err := l.check("cudaRuntimeGetVersion", r); err != nil {
		return 0, err
	}
	return int(r.v), nil
}

func (l *library) DeviceCount() (int, error) {
	r := C.cp_device_count(l.c)
	if err := l.check("cudaGetDeviceCount", r); err != nil {
		return 0, err
	}
	return int(r.v), nil
}

func (l *library) DeviceAttribute(dev int, attr DeviceAttr) (int, error) {
	r := C.cp_device_attribute(l.c, C.longlong(dev), C.int(attr))
	if err := l.check("cudaDeviceGetAttribute", r); err != nil {
		return 0, err
	}
	return int(int64(r.v)), nil
}

func (l *library) DeviceUUID(dev int) (UUID, error) {
	r := C.cp_device_uuid(l.c, C.longlong(dev))
	if err := l.checkBlob("cuDeviceGetUuid", &r); err != nil {
		return UUID{}, err
	}
	b := bytes64(&r.blob)
	return UUID(b[:16]), nil
}

func (l *library) DevicePCIBusID(dev int) (string, error) {
	r := C.cp_device_pci_bus_id(l.c, C.longlong(dev))
	if err := l.checkBlob("cudaDeviceGetPCIBusId", &r); err != nil {
		return "", err
	}
	b := bytes64(&r.blob)
	return cString(b[:]), nil
}

func (l *library) DeviceCanAccessPeer(dev, peer int) (bool, error) {
	r := C.cp_device_can_access_peer(l.c, C.longlong(dev), C.longlong(peer))
	if err := l.check("cudaDeviceCanAccessPeer", r); err != nil {
		return false, err
	}
	return r.v != 0, nil
}

func (l *library) MemGetInfo(dev int) (free, total uint64, err error) {
	r := C.cp_mem_get_info(l.c, C.longlong(dev))
	if err := l.check("cudaMemGetInfo", r); err != nil {
		return 0, 0, err
	}
	return uint64(r.v), uint64(r.w), nil
}

func (l *library) AllocationGranularity(dev int, ht HandleType, recommended bool) (uint64, error) {
	rec := C.int(0)
	if recommended {
		rec = 1
	}
	r := C.cp_allocation_granularity(l.c, C.longlong(dev), C.int(ht), rec)
	if err := l.check("cuMemGetAllocationGranularity", r); err != nil {
		return 0, err
	}
	return uint64(r.v), nil
}

func (l *library) StreamCreate(dev int, flags StreamFlags) (Stream, error) {
	r := C.cp_stream_create(l.c, C.longlong(dev), C.uint(flags))
	if err := l.check("cudaStreamCreateWithFlags", r); err != nil {
		return 0, err
	}
	return Stream(r.v), nil
}

func (l *library) StreamDestroy(dev int, s Stream) error {
	return l.check("cudaStreamDestroy", C.cp_stream_destroy(l.c, C.longlong(dev), C.uintptr_t(s)))
}

func (l *library) StreamSynchronize(dev int, s Stream) error {
	return l.check("cudaStreamSynchronize", C.cp_stream_synchronize(l.c, C.longlong(dev), C.uintptr_t(s)))
}

func (l *library) StreamQuery(dev int, s Stream) (bool, error) {
	r := C.cp_stream_query(l.c, C.longlong(dev), C.uintptr_t(s))
	if Code(r.err) == ErrNotReady && r.at == C.cp_at_call {
		return false, nil
	}
	if err := l.check("cudaStreamQuery", r); err != nil {
		return false, err
	}
	return true, nil
}

func (l *library) StreamDevice(dev int, s Stream) (int, error) {
	r := C.cp_stream_get_device(l.c, C.longlong(dev), C.uintptr_t(s))
	return int(int64(r.v)), l.check("cudaStreamGetDevice", r)
}

func (l *library) StreamWaitEvent(dev int, s Stream, e Event) error {
	return l.check("cudaStreamWaitEvent", C.cp_stream_wait_event(l.c, C.longlong(dev), C.uintptr_t(s), C.uintptr_t(e)))
}

func (l *library) StreamNotify(dev int, s Stream, fd int) error {
	if fd < 0 {
		return NewError("cudaLaunchHostFunc", ErrInvalidValue)
	}
	return l.check("cudaLaunchHostFunc", C.cp_stream_notify(l.c, C.longlong(dev), C.uintptr_t(s), C.int(fd)))
}

func (l *library) EventCreate(dev int, flags EventFlags) (Event, error) {
	r := C.cp_event_create(l.c, C.longlong(dev), C.uint(flags))
	if err := l.check("cudaEventCreateWithFlags", r); err != nil {
		return 0, err
	}
	return Event(r.v), nil
}

func (l *library) EventDestroy(dev int, e Event) error {
	return l.check("cudaEventDestroy", C.cp_event_destroy(l.c, C.longlong(dev), C.uintptr_t(e)))
}

func (l *library) EventRecord(dev int, e Event, s Stream) error {
	return l.check("cudaEventRecord", C.cp_event_record(l.c, C.longlong(dev), C.uintptr_t(e), C.uintptr_t(s)))
}

func (l *library) EventSynchronize(dev int, e Event) error {
	return l.check("cudaEventSynchronize", C.cp_event_synchronize(l.c, C.longlong(dev), C.uintptr_t(e)))
}

func (l *library) EventQuery(dev int, e Event) (bool, error) {
	r := C.cp_event_query(l.c, C.longlong(dev), C.uintptr_t(e))
	if Code(r.err) == ErrNotReady && r.at == C.cp_at_call {
		return false, nil
	}
	if err := l.check("cudaEventQuery", r); err != nil {
		return false, err
	}
	return true, nil
}

func (l *library) IpcGetEventHandle(dev int, e Event) (IpcEventHandle, error) {
	r := C.cp_ipc_get_event_handle(l.c, C.longlong(dev), C.uintptr_t(e))
	if err := l.checkBlob("cudaIpcGetEventHandle", &r); err != nil {
		return IpcEventHandle{}, err
	}
	return bytes64(&r.blob), nil
}

func (l *library) IpcOpenEventHandle(dev int, h IpcEventHandle) (Event, error) {
	r := C.cp_ipc_open_event_handle(l.c, C.longlong(dev), blob(h))
	if err := l.check("cudaIpcOpenEventHandle", r); err != nil {
		return 0, err
	}
	return Event(r.v), nil
}

// blob is 64 bytes as the C struct that carries them by value, so that no Go pointer
// reaches C and nothing escapes to the heap.
func blob(b [64]byte) C.cp_blob64 { return *(*C.cp_blob64)(unsafe.Pointer(&b)) }

// bytes64 is the 64 bytes of a C blob.
func bytes64(b *C.cp_blob64) [64]byte { return *(*[64]byte)(unsafe.Pointer(b)) }

func (l *library) MemPoolCreate(props PoolProps) (MemPool, error) {
	r := C.cp_mem_pool_create(l.c, C.int(props.HandleTypes), C.int(props.Location.Type), C.int(props.Location.ID), C.ulonglong(props.MaxSize))
	if err := l.check("cudaMemPoolCreate", r); err != nil {
		return 0, err
	}
	return MemPool(r.v), nil
}

func (l *library) MemPoolDestroy(dev int, p MemPool) error {
	return l.check("cudaMemPoolDestroy", C.cp_mem_pool_destroy(l.c, C.longlong(dev), C.uintptr_t(p)))
}

func (l *library) DeviceGetDefaultMemPool(dev int) (MemPool, error) {
	r := C.cp_device_default_mem_pool(l.c, C.longlong(dev))
	if err := l.check("cudaDeviceGetDefaultMemPool", r); err != nil {
		return 0, err
	}
	return MemPool(r.v), nil
}

// poolAttrArg checks attr and value before they reach C, where an unknown attribute
// would have no known size.
func poolAttrArg(op string, attr PoolAttr, value uint64) (isInt C.int, err error) {
	switch {
	case attr < PoolReuseFollowEventDependencies || attr > PoolUsedMemHigh:
		return 0, invalidArgument(op, fmt.Sprintf("unknown pool attribute %d", attr))
	case attr.IsBool() && value > math.MaxInt32:
		return 0, invalidArgument(op, fmt.Sprintf("pool attribute %d is an int; %d does not fit", attr, value))
	case attr.IsBool():
		return 1, nil
	}
	return 0, nil
}

func (l *library) MemPoolGetAttribute(dev int, p MemPool, attr PoolAttr) (uint64, error) {
	const op = "cudaMemPoolGetAttribute"
	isInt, err := poolAttrArg(op, attr, 0)
	if err != nil {
		return 0, err
	}
	r := C.cp_mem_pool_get_attribute(l.c, C.longlong(dev), C.uintptr_t(p), C.int(attr), isInt)
	if err := l.check(op, r); err != nil {
		return 0, err
	}
	return uint64(r.v), nil
}

func (l *library) MemPoolSetAttribute(dev int, p MemPool, attr PoolAttr, value uint64) error {
	const op = "cudaMemPoolSetAttribute"
	isInt, err := poolAttrArg(op, attr, value)
	if err != nil {
		return err
	}
	return l.check(op, C.cp_mem_pool_set_attribute(l.c, C.longlong(dev), C.uintptr_t(p), C.int(attr), isInt, C.uint64_t(value)))
}

func (l *library) MemPoolSetAccess(dev int, p MemPool, descs []AccessDesc) error {
	d := (*C.cp_access_desc)(unsafe.Pointer(unsafe.SliceData(descs)))
	return l.check("cudaMemPoolSetAccess", C.cp_mem_pool_set_access(l.c, C.longlong(dev), C.uintptr_t(p), d, C.size_t(len(descs))))
}

func (l *library) MemPoolGetAccess(dev int, p MemPool, loc Location) (AccessFlags, error) {
	r := C.cp_mem_pool_get_access(l.c, C.longlong(dev), C.uintptr_t(p), C.int(loc.Type), C.int(loc.ID))
	if err := l.check("cudaMemPoolGetAccess", r); err != nil {
		return 0, err
	}
	return AccessFlags(r.v), nil
}

func (l *library) MemPoolTrimTo(dev int, p MemPool, minBytesToKeep uint64) error {
	return l.check("cudaMemPoolTrimTo", C.cp_mem_pool_trim_to(l.c, C.longlong(dev), C.uintptr_t(p), C.uint64_t(minBytesToKeep)))
}

func (l *library) MallocFromPoolAsync(dev int, size uint64, p MemPool, s Stream) (DevicePtr, error) {
	r := C.cp_malloc_from_pool_async(l.c, C.longlong(dev), C.uint64_t(size), C.uintptr_t(p), C.uintptr_t(s))
	if err := l.check("cudaMallocFromPoolAsync", r); err != nil {
		return 0, err
	}
	return DevicePtr(r.v), nil
}

func (l *library) FreeAsync(dev int, ptr DevicePtr, s Stream) error {
	return l.check("cudaFreeAsync", C.cp_free_async(l.c, C.longlong(dev), C.uintptr_t(ptr), C.uintptr_t(s)))
}

func (l *library) MemPoolExportToShareableHandle(dev int, p MemPool, ht HandleType) (ShareableHandle, error) {
	const op = "cudaMemPoolExportToShareableHandle"
	if ht != HandleTypePosixFD && ht != HandleTypeFabric {
		return ShareableHandle{}, invalidArgument(op, "cannot export a pool as handle type "+ht.String())
	}
	r := C.cp_mem_pool_export(l.c, C.longlong(dev), C.uintptr_t(p), C.int(ht))
	if err := l.checkBlob(op, &r); err != nil {
		return ShareableHandle{}, err
	}
	h := ShareableHandle{Type: ht, FD: int(r.v)}
	if ht == HandleTypeFabric {
		h.Fabric = bytes64(&r.blob)
	}
	return h, nil
}

func (l *library) MemPoolImportFromShareableHandle(dev int, h ShareableHandle) (MemPool, error) {
	const op = "cudaMemPoolImportFromShareableHandle"
	switch {
	case h.Type != HandleTypePosixFD && h.Type != HandleTypeFabric:
		return 0, invalidArgument(op, "cannot import a pool from handle type "+h.Type.String())
	case h.Type == HandleTypePosixFD && (h.FD < 0 || h.FD > math.MaxInt32):
		return 0, invalidArgument(op, fmt.Sprintf("%d is not a file descriptor", h.FD))
	}
	r := C.cp_mem_pool_import(l.c, C.longlong(dev), C.int(h.Type), C.int(h.FD), blob(h.Fabric))
	if err := l.check(op, r); err != nil {
		return 0, err
	}
	return MemPool(r.v), nil
}

func (l *library) MemPoolExportPointer(dev int, ptr DevicePtr) (PtrExportData, error) {
	r := C.cp_mem_pool_export_pointer(l.c, C.longlong(dev), C.uintptr_t(ptr))
	if err := l.checkBlob("cudaMemPoolExportPointer", &r); err != nil {
		return PtrExportData{}, err
	}
	return bytes64(&r.blob), nil
}

func (l *library) MemPoolImportPointer(dev int, p MemPool, data PtrExportData) (DevicePtr, error) {
	r := C.cp_mem_pool_import_pointer(l.c, C.longlong(dev), C.uintptr_t(p), blob(data))
	if err := l.check("cudaMemPoolImportPointer", r); err != nil {
		return 0, err
	}
	return DevicePtr(r.v), nil
}

// currentDevice is the calling thread's current device; see CurrentDevice in
// export_test.go.
func (l *library) currentDevice() (int, error) {
	r := C.cp_current_device(l.c)
	return int(int64(r.v)), l.check("cudaGetDevice", r)
}

func (l *library) MemcpyHtoDAsync(dev int, dst DevicePtr, src []byte, s Stream) error {
	r := C.cp_memcpy_from_host(l.c, C.longlong(dev), C.uintptr_t(dst), unsafe.Pointer(unsafe.SliceData(src)), C.uint64_t(len(src)), C.uintptr_t(s))
	return l.check("cudaMemcpyAsync", r)
}

func (l *library) MemcpyDtoHAsync(dev int, dst []byte, src DevicePtr, s Stream) error {
	r := C.cp_memcpy_to_host(l.c, C.longlong(dev), unsafe.Pointer(unsafe.SliceData(dst)), C.uintptr_t(src), C.uint64_t(len(dst)), C.uintptr_t(s))
	return l.check("cudaMemcpyAsync", r)
}

func (l *library) MemcpyDtoDAsync(dev int, dst, src DevicePtr, n uint64, s Stream) error {
	r := C.cp_memcpy_device(l.c, C.longlong(dev), C.uintptr_t(dst), C.uintptr_t(src), C.uint64_t(n), C.uintptr_t(s))
	return l.check("cudaMemcpyAsync", r)
}

func (l *library) MemsetAsync(dev int, dst DevicePtr, value byte, n uint64, s Stream) error {
	r := C.cp_memset(l.c, C.longlong(dev), C.uintptr_t(dst), C.int(value), C.uint64_t(n), C.uintptr_t(s))
	return l.check("cudaMemsetAsync", r)
}

// hostArg is mem's address and length for a trampoline: mem is not Go's memory (see
// HostRegister), so it travels as an integer.
func hostArg(op string, mem []byte) (C.uintptr_t, C.uint64_t, error) {
	if len(mem) == 0 {
		return 0, 0, invalidArgument(op, "no host memory")
	}
	return C.uintptr_t(uintptr(unsafe.Pointer(unsafe.SliceData(mem)))), C.uint64_t(len(mem)), nil
}

func (l *library) HostRegister(dev int, mem []byte, flags HostRegisterFlags) error {
	const op = "cudaHostRegister"
	p, n, err := hostArg(op, mem)
	if err != nil {
		return err
	}
	return l.check(op, C.cp_host_register(l.c, C.longlong(dev), p, n, C.uint(flags)))
}

func (l *library) HostUnregister(dev int, mem []byte) error {
	const op = "cudaHostUnregister"
	p, _, err := hostArg(op, mem)
	if err != nil {
		return err
	}
	return l.check(op, C.cp_host_unregister(l.c, C.longlong(dev), p))
}

func (l *library) HostDevicePointer(dev int, mem []byte) (DevicePtr, error) {
	const op = "cudaHostGetDevicePointer"
	p, _, err := hostArg(op, mem)
	if err != nil {
		return 0, err
	}
	r := C.cp_host_device_pointer(l.c, C.longlong(dev), p)
	if err := l.check(op, r); err != nil {
		return 0, err
	}
	return DevicePtr(r.v), nil
}

// CopyPiece slices are handed to the trampolines as they lie in Go memory, so their
// layout must be cp_piece's.
const (
	_ = uint(unsafe.Sizeof(CopyPiece{}) - C.sizeof_cp_piece)
	_ = uint(C.sizeof_cp_piece - unsafe.Sizeof(CopyPiece{}))
)

func (l *library) MemcpyBatchAsync(dev int, pieces []CopyPiece, s Stream) error {
	const op = "MemcpyBatchAsync"
	if len(pieces) == 0 {
		return nil
	}
	b, err := l.batchOn(dev)
	if err != nil {
		return err
	}
	ps := (*C.cp_piece)(unsafe.Pointer(unsafe.SliceData(pieces)))
	n := C.uint64_t(len(pieces))
	switch b.path {
	case CopyPathKernel:
		return l.check("cudaLaunchKernel (batch copy)", C.cp_batch_kernel(l.c, C.longlong(dev), C.uintptr_t(b.kernel), ps, n, C.uint(min(uint64(len(pieces)), b.blocks)), C.uintptr_t(s)))
	case CopyPathBatch:
		if s > 2 { // cudaMemcpyBatchAsync refuses the legacy and per-thread streams
			return l.check("cudaMemcpyBatchAsync", C.cp_batch_memcpy(l.c, C.longlong(dev), ps, n, C.uintptr_t(s)))
		}
	}
	return l.check("cudaMemcpyAsync (batch copy, one per piece)", C.cp_batch_pieces(l.c, C.longlong(dev), ps, n, C.uintptr_t(s)))
}

func (l *library) BatchCopyPath(dev int) (CopyPath, error) {
	b, err := l.batchOn(dev)
	if err != nil {
		return 0, err
	}
	return b.path, nil
}

// batchCopy is how MemcpyBatchAsync copies on one device.
type batchCopy struct {
	path   CopyPath
	kernel uintptr // the kernel's cudaKernel_t, for CopyPathKernel
	blocks uint64  // the kernel's grid: 8 blocks of 256 threads per multiprocessor
	why    string  // why the kernel is not used, where it is not
}

// batchOn is dev's batch copy, chosen on first use: the kernel if its library loads
// (once per process: a library is loaded into every context), else
// cudaMemcpyBatchAsync on a CUDA 13 runtime, else one copy per piece.
func (l *library) batchOn(dev int) (*batchCopy, error) {
	l.batchMu.Lock()
	defer l.batchMu.Unlock()
	if b, ok := l.batch[dev]; ok {
		return b, nil
	}
	if dev < 0 || dev > math.MaxInt32 {
		return nil, NewError("MemcpyBatchAsync", ErrInvalidDevice)
	}
	b := &batchCopy{path: CopyPathKernel}
	if l.forcePath != 0 {
		b.path = l.forcePath
	}
	if b.path == CopyPathKernel {
		if l.kernel == 0 && l.kernelErr == nil {
			ptx := C.CString(batchCopyPTX)
			r := C.cp_load_batch_kernel(l.c, C.longlong(dev), ptx)
			C.free(unsafe.Pointer(ptx))
			if l.kernelErr = l.check("cudaLibraryLoadData (batch copy kernel)", r); l.kernelErr == nil {
				l.kernel = uintptr(r.w)
			}
		}
		sms, err := l.DeviceAttribute(dev, DevAttrMultiProcessorCount)
		switch {
		case l.kernelErr != nil:
			b.path, b.why = CopyPathBatch, l.kernelErr.Error()
		case err != nil:
			return nil, err
		default:
			b.kernel, b.blocks = l.kernel, 8*uint64(max(sms, 1))
		}
	}
	if b.path == CopyPathBatch {
		if v, err := l.RuntimeVersion(); err != nil || v < 13000 {
			b.path = CopyPathPieces // 12.8's cudaMemcpyBatchAsync takes another argument
		}
	}
	if l.batch == nil {
		l.batch = map[int]*batchCopy{}
	}
	l.batch[dev] = b
	return b, nil
}

var _ VMM = (*library)(nil)

// vmmHandleArg checks a handle type for a VMM call that shares memory.
func vmmHandleArg(op string, ht HandleType) error {
	if ht != HandleTypePosixFD && ht != HandleTypeFabric {
		return invalidArgument(op, "cannot share a VMM allocation as handle type "+ht.String())
	}
	return nil
}

func (l *library) MemCreate(dev int, size uint64, ht HandleType) (MemHandle, error) {
	const op = "cuMemCreate"
	if ht&^(HandleTypePosixFD|HandleTypeFabric) != 0 {
		return 0, invalidArgument(op, "cannot share a VMM allocation as handle type "+ht.String())
	}
	r := C.cp_mem_create(l.c, C.longlong(dev), C.uint64_t(size), C.int(ht))
	if err := l.check(op, r); err != nil {
		return 0, err
	}
	return MemHandle(r.v), nil
}

func (l *library) MemRelease(dev int, h MemHandle) error {
	return l.check("cuMemRelease", C.cp_mem_release(l.c, C.longlong(dev), C.uint64_t(h)))
}

func (l *library) MemExportToShareableHandle(dev int, h MemHandle, ht HandleType) (ShareableHandle, error) {
	const op = "cuMemExportToShareableHandle"
	if err := vmmHandleArg(op, ht); err != nil {
		return ShareableHandle{}, err
	}
	r := C.cp_mem_export(l.c, C.longlong(dev), C.uint64_t(h), C.int(ht))
	if err := l.checkBlob(op, &r); err != nil {
		return ShareableHandle{}, err
	}
	sh := ShareableHandle{Type: ht, FD: int(r.v)}
	if ht == HandleTypeFabric {
		sh.Fabric = bytes64(&r.blob)
	}
	return sh, nil
}

func (l *library) MemImportFromShareableHandle(dev int, sh ShareableHandle) (MemHandle, error) {
	const op = "cuMemImportFromShareableHandle"
	if err := vmmHandleArg(op, sh.Type); err != nil {
		return 0, err
	}
	if sh.Type == HandleTypePosixFD && (sh.FD < 0 || sh.FD > math.MaxInt32) {
		return 0, invalidArgument(op, fmt.Sprintf("%d is not a file descriptor", sh.FD))
	}
	r := C.cp_mem_import(l.c, C.longlong(dev), C.int(sh.Type), C.int(sh.FD), blob(sh.Fabric))
	if err := l.check(op, r); err != nil {
		return 0, err
	}
	return MemHandle(r.v), nil
}

func (l *library) MemAddressReserve(dev int, size, alignment uint64) (DevicePtr, error) {
	r := C.cp_mem_address_reserve(l.c, C.longlong(dev), C.uint64_t(size), C.uint64_t(alignment))
	if err := l.check("cuMemAddressReserve", r); err != nil {
		return 0, err
	}
	return DevicePtr(r.v), nil
}

func (l *library) MemAddressFree(dev int, ptr DevicePtr, size uint64) error {
	return l.check("cuMemAddressFree", C.cp_mem_address_free(l.c, C.longlong(dev), C.uint64_t(ptr), C.uint64_t(size)))
}

func (l *library) MemMap(dev int, ptr DevicePtr, size, offset uint64, h MemHandle) error {
	return l.check("cuMemMap", C.cp_mem_map(l.c, C.longlong(dev), C.uint64_t(ptr), C.uint64_t(size), C.uint64_t(offset), C.uint64_t(h)))
}

func (l *library) MemUnmap(dev int, ptr DevicePtr, size uint64) error {
	return l.check("cuMemUnmap", C.cp_mem_unmap(l.c, C.longlong(dev), C.uint64_t(ptr), C.uint64_t(size)))
}

func (l *library) MemSetAccess(dev int, ptr DevicePtr, size uint64, descs []AccessDesc) error {
	const op = "cuMemSetAccess"
	if len(descs) == 0 {
		return invalidArgument(op, "no access to set")
	}
	d := (*C.cp_access_desc)(unsafe.Pointer(unsafe.SliceData(descs)))
	return l.check(op, C.cp_mem_set_access(l.c, C.longlong(dev), C.uint64_t(ptr), C.uint64_t(size), d, C.size_t(len(descs))))
}

func (l *library) StreamWriteValue32(dev int, ptr DevicePtr, value uint32, s Stream) error {
	return l.check("cuStreamWriteValue32", C.cp_stream_write_value32(l.c, C.longlong(dev), C.uint64_t(ptr), C.uint(value), C.uintptr_t(s)))
}

func (l *library) StreamWaitValue32(dev int, ptr DevicePtr, value uint32, cond WaitCond, s Stream) error {
	const op = "cuStreamWaitValue32"
	if cond > WaitNor {
		return invalidArgument(op, fmt.Sprintf("unknown wait condition %d", cond))
	}
	return l.check(op, C.cp_stream_wait_value32(l.c, C.longlong(dev), C.uint64_t(ptr), C.uint(value), C.uint(cond), C.uintptr_t(s)))
}
