// Package cudart owns cudapool's view of the CUDA runtime: the subset of calls that
// IPC-capable stream-ordered memory pools need, the Go types for their C arguments, and
// the errors they return.
//
// Everything above this package talks to a Runtime. Load returns one backed by the real
// runtime (libcudart.so.13, then .12, opened at run time so that the module builds and
// its tests run with no CUDA toolkit, driver or GPU); package cudarttest returns one
// backed by a software device for machines without a GPU.
//
// CUDA's current device is per OS thread and goroutines move between threads. Every
// Runtime method whose meaning depends on the current device takes the device ordinal
// and makes that device current on the very thread that makes the call, so goroutines
// working on different devices never observe each other's choice. MallocFromPoolAsync
// on a created stream, which CUDA runs on the device of its pool or stream whatever
// device is current, leaves the current device as it is once the thread has a
// context: it is half of every allocation pair, and a cudaGetDevice per call is time
// the C caller does not spend. With the legacy or per-thread stream, which are the
// current device's, it makes dev current too. The calls that take a device pointer
// keep the rule: the runtime checks the pointer against the current device.
package cudart

import "fmt"

// DevicePtr is a device address (CUdeviceptr / void* in device space).
type DevicePtr uintptr

// Stream is a cudaStream_t. The zero Stream is the legacy default stream.
type Stream uintptr

// Event is a cudaEvent_t.
type Event uintptr

// MemPool is a cudaMemPool_t.
type MemPool uintptr

// PtrExportData is cudaMemPoolPtrExportData: the record that shares one allocation of
// an exported pool. Its bytes are identical each time the same pointer is exported.
type PtrExportData [64]byte

// IpcEventHandle is cudaIpcEventHandle_t.
type IpcEventHandle [64]byte

// FabricHandle is cudaMemFabricHandle_t, the shareable handle of a FABRIC pool.
type FabricHandle [64]byte

// UUID is a device's 16-byte UUID (cudaUUID_t).
type UUID [16]byte

func (u UUID) String() string {
	return fmt.Sprintf("GPU-%x-%x-%x-%x-%x", u[0:4], u[4:6], u[6:8], u[8:10], u[10:16])
}

// HandleType is cudaMemAllocationHandleType: how a pool can be shared.
type HandleType int32

const (
	HandleTypeNone    HandleType = 0x0 // not shareable
	HandleTypePosixFD HandleType = 0x1 // a POSIX file descriptor, passed with SCM_RIGHTS
	HandleTypeFabric  HandleType = 0x8 // a 64-byte fabric handle, authorised by IMEX
)

func (h HandleType) String() string {
	switch h {
	case HandleTypeNone:
		return "none"
	case HandleTypePosixFD:
		return "posix-fd"
	case HandleTypeFabric:
		return "fabric"
	}
	return fmt.Sprintf("HandleType(%#x)", int32(h))
}

// MarshalText writes h as String does ("posix-fd"), so that JSON shows the name.
func (h HandleType) MarshalText() ([]byte, error) { return []byte(h.String()), nil }

// UnmarshalText reads a name MarshalText wrote.
func (h *HandleType) UnmarshalText(b []byte) error {
	for _, t := range []HandleType{HandleTypeNone, HandleTypePosixFD, HandleTypeFabric} {
		if string(b) == t.String() {
			*h = t
			return nil
		}
	}
	var n int32
	if _, err := fmt.Sscanf(string(b), "HandleType(%v)", &n); err == nil {
		*h = HandleType(n)
		return nil
	}
	return fmt.Errorf("cudart: unknown handle type %q", b)
}

// ShareableHandle is what MemPoolExportToShareableHandle returns and
// MemPoolImportFromShareableHandle takes. For HandleTypePosixFD, FD is a file
// descriptor the caller owns and must close; for HandleTypeFabric, Fabric holds the
// handle bytes and FD is -1.
type ShareableHandle struct {
	Type   HandleType
	FD     int
	Fabric FabricHandle
}

// LocationType is cudaMemLocationType.
type LocationType int32

const (
	LocationInvalid LocationType = 0
	LocationDevice  LocationType = 1
	LocationHost    LocationType = 2
)

// Location is cudaMemLocation.
type Location struct {
	Type LocationType
	ID   int32
}

// DeviceLocation is the location of device dev.
func DeviceLocation(dev int) Location { return Location{Type: LocationDevice, ID: int32(dev)} }

// AccessFlags is cudaMemAccessFlags.
type AccessFlags int32

const (
	// AccessNone must never be passed to MemPoolSetAccess: the driver answers
	// invalid device. It is only ever returned by MemPoolGetAccess.
	AccessNone      AccessFlags = 0
	AccessRead      AccessFlags = 1
	AccessReadWrite AccessFlags = 3
)

// AccessDesc is cudaMemAccessDesc.
type AccessDesc struct {
	Location Location
	Flags    AccessFlags
}

// PoolProps is cudaMemPoolProps, less the Windows-only and reserved fields. Only pinned
// device allocations are supported (cudaMemAllocationTypePinned).
type PoolProps struct {
	HandleTypes HandleType
	Location    Location
	// MaxSize bounds the pool's reserved memory; 0 means the driver's default (the
	// device's memory).
	MaxSize uint64
}

// PoolAttr is cudaMemPoolAttr.
type PoolAttr int32

const (
	PoolReuseFollowEventDependencies   PoolAttr = 1 // int (bool)
	PoolReuseAllowOpportunistic        PoolAttr = 2 // int (bool)
	PoolReuseAllowInternalDependencies PoolAttr = 3 // int (bool)
	PoolReleaseThreshold               PoolAttr = 4 // uint64
	PoolReservedMemCurrent             PoolAttr = 5 // uint64
	PoolReservedMemHigh                PoolAttr = 6 // uint64; settable to 0 only
	PoolUsedMemCurrent                 PoolAttr = 7 // uint64
	PoolUsedMemHigh                    PoolAttr = 8 // uint64; settable to 0 only
)

// IsBool reports whether the attribute is an int-sized flag rather than a uint64.
func (a PoolAttr) IsBool() bool { return a >= 1 && a <= 3 }

// DeviceAttr is cudaDeviceAttr; only the ones cudapool asks for are named.
type DeviceAttr int32

const (
	DevAttrPciBusID                   DeviceAttr = 33
	DevAttrPciDeviceID                DeviceAttr = 34
	DevAttrPciDomainID                DeviceAttr = 50
	DevAttrMultiProcessorCount        DeviceAttr = 16
	DevAttrComputeCapabilityMajor     DeviceAttr = 75
	DevAttrComputeCapabilityMinor     DeviceAttr = 76
	DevAttrMemoryPoolsSupported       DeviceAttr = 115
	DevAttrMemoryPoolSupportedHandles DeviceAttr = 119
)

// EventFlags is the flags argument of cudaEventCreateWithFlags.
type EventFlags uint32

const (
	EventDefault       EventFlags = 0x0
	EventBlockingSync  EventFlags = 0x1
	EventDisableTiming EventFlags = 0x2
	EventInterprocess  EventFlags = 0x4
	EventIPC                      = EventInterprocess | EventDisableTiming // what an IPC event needs
)

// StreamFlags is the flags argument of cudaStreamCreateWithFlags.
type StreamFlags uint32

const (
	StreamDefault     StreamFlags = 0x0
	StreamNonBlocking StreamFlags = 0x1
)

// Runtime is the CUDA runtime subset cudapool uses. Load returns the real one; package
// cudarttest returns a software device. Methods are safe for concurrent use.
//
// StreamQuerier is a Runtime that can tell whether a stream's work has completed
// without queueing anything on it (cudaStreamQuery): the cudart library and the
// software device are. It is an interface of its own so that a Runtime wrapping another
// need not have it; callers fall back to recording an event.
type StreamQuerier interface {
	// StreamQuery reports whether all the work queued on s so far has completed.
	StreamQuery(dev int, s Stream) (bool, error)
}

// Every error a Runtime method returns wraps a Code, so errors.Is(err, ErrOutOfMemory)
// and friends work; failures that are not CUDA's own (no runtime, a missing symbol)
// wrap ErrNoRuntime.
type Runtime interface {
	// Name says what backs this Runtime, e.g. "libcudart.so.13 (runtime 13000, driver
	// 13000)" or "cudarttest software device".
	Name() string
	DriverVersion() (int, error)
	RuntimeVersion() (int, error)

	DeviceCount() (int, error)
	DeviceAttribute(dev int, attr DeviceAttr) (int, error)
	DeviceUUID(dev int) (UUID, error)
	DevicePCIBusID(dev int) (string, error)
	DeviceCanAccessPeer(dev, peer int) (bool, error)
	// MemGetInfo returns the free and total memory of dev.
	MemGetInfo(dev int) (free, total uint64, err error)
	// AllocationGranularity is cuMemGetAllocationGranularity for pinned device memory
	// on dev that can be shared as ht; recommended picks the recommended granularity
	// over the minimum one.
	AllocationGranularity(dev int, ht HandleType, recommended bool) (uint64, error)

	StreamCreate(dev int, flags StreamFlags) (Stream, error)
	StreamDestroy(dev int, s Stream) error
	StreamSynchronize(dev int, s Stream) error
	// StreamDevice is the device s belongs to; the legacy, per-thread and null
	// streams belong to dev. It needs cudaStreamGetDevice (CUDA 12.8 and later):
	// with an older runtime it fails with ErrNotSupported.
	StreamDevice(dev int, s Stream) (int, error)
	// StreamWaitEvent makes all future work on s wait for the work captured by the
	// last EventRecord of e before this call; it does not block the host.
	StreamWaitEvent(dev int, s Stream, e Event) error
	// StreamNotify queues on s a write of 1 to eventfd fd (cudaLaunchHostFunc with a
	// host function in C that makes no CUDA call): it runs once all the work queued
	// on s before it has completed, in stream order, so the eventfd's running total
	// counts the points of s that have completed. fd must stay open until the write
	// has run: the write goes to whatever fd names then. On success the write is
	// queued; on failure nothing is. A write that fails (fd closed) is lost, and
	// nothing reports it.
	StreamNotify(dev int, s Stream, fd int) error

	EventCreate(dev int, flags EventFlags) (Event, error)
	EventDestroy(dev int, e Event) error
	EventRecord(dev int, e Event, s Stream) error
	EventSynchronize(dev int, e Event) error
	// EventQuery reports whether the work captured by e has completed.
	EventQuery(dev int, e Event) (bool, error)
	IpcGetEventHandle(dev int, e Event) (IpcEventHandle, error)
	// IpcOpenEventHandle opens another process's event on dev; destroy it with
	// EventDestroy.
	IpcOpenEventHandle(dev int, h IpcEventHandle) (Event, error)

	MemPoolCreate(props PoolProps) (MemPool, error)
	MemPoolDestroy(dev int, p MemPool) error
	DeviceGetDefaultMemPool(dev int) (MemPool, error)
	MemPoolGetAttribute(dev int, p MemPool, attr PoolAttr) (uint64, error)
	MemPoolSetAttribute(dev int, p MemPool, attr PoolAttr, value uint64) error
	MemPoolSetAccess(dev int, p MemPool, descs []AccessDesc) error
	MemPoolGetAccess(dev int, p MemPool, loc Location) (AccessFlags, error)
	MemPoolTrimTo(dev int, p MemPool, minBytesToKeep uint64) error
	MallocFromPoolAsync(dev int, size uint64, p MemPool, s Stream) (DevicePtr, error)
	FreeAsync(dev int, ptr DevicePtr, s Stream) error

	// MemPoolExportToShareableHandle exports p. For a POSIX fd the caller owns the
	// returned descriptor.
	MemPoolExportToShareableHandle(dev int, p MemPool, ht HandleType) (ShareableHandle, error)
	// MemPoolImportFromShareableHandle imports a pool exported by another process. It
	// does not take ownership of h.FD: the caller closes it.
	MemPoolImportFromShareableHandle(dev int, h ShareableHandle) (MemPool, error)
	MemPoolExportPointer(dev int, ptr DevicePtr) (PtrExportData, error)
	MemPoolImportPointer(dev int, p MemPool, data PtrExportData) (DevicePtr, error)

	// MemcpyHtoDAsync copies src to dst. Go memory is pageable, so when it returns src
	// has been consumed (staged by the driver) and may be reused.
	MemcpyHtoDAsync(dev int, dst DevicePtr, src []byte, s Stream) error
	// MemcpyDtoHAsync copies into dst. Go memory is pageable, so the copy has
	// completed when it returns.
	MemcpyDtoHAsync(dev int, dst []byte, src DevicePtr, s Stream) error
	// MemcpyDtoDAsync copies n bytes between device addresses, across devices too
	// (cudaMemcpyDefault through unified addressing).
	MemcpyDtoDAsync(dev int, dst, src DevicePtr, n uint64, s Stream) error
	MemsetAsync(dev int, dst DevicePtr, value byte, n uint64, s Stream) error

	// HostRegister page-locks mem and maps it into the device address space
	// (cudaHostRegister), for every device with HostRegisterPortable. mem must not be
	// Go's memory (the garbage collector may free it): an mmap of a file or memfd. It
	// stays registered until HostUnregister, which must not run before the work that
	// touches it has. On failure nothing is registered.
	HostRegister(dev int, mem []byte, flags HostRegisterFlags) error
	// HostUnregister undoes HostRegister of the same mem.
	HostUnregister(dev int, mem []byte) error
	// HostDevicePointer is the device address of mem[0], which lies in memory
	// registered with HostRegisterMapped (cudaHostGetDevicePointer).
	HostDevicePointer(dev int, mem []byte) (DevicePtr, error)
	// MemcpyBatchAsync queues every piece's copy on s in one call: on a GPU one launch
	// of a gather/scatter kernel, else cudaMemcpyBatchAsync, else one copy per piece
	// (BatchCopyPath says which). Each address is device memory or the device pointer
	// of registered host memory; the pieces must not overlap where one writes, as they
	// run in any order. The pieces slice may be reused once it returns. On failure,
	// pieces of a call on the fallback paths may have been queued before it.
	MemcpyBatchAsync(dev int, pieces []CopyPiece, s Stream) error
	// BatchCopyPath says how MemcpyBatchAsync copies on dev, loading the kernel there
	// on first use.
	BatchCopyPath(dev int) (CopyPath, error)
}

// HostRegisterFlags is the flags argument of cudaHostRegister.
type HostRegisterFlags uint32

const (
	HostRegisterDefault  HostRegisterFlags = 0x0
	HostRegisterPortable HostRegisterFlags = 0x1 // pinned for every device, not only the current one
	HostRegisterMapped   HostRegisterFlags = 0x2 // mapped into the device address space (HostDevicePointer)
)

// CopyPiece is one copy of a batch: Size bytes from Src to Dst, device addresses.
type CopyPiece struct {
	Dst, Src DevicePtr
	Size     uint64
}

// CopyPath is how MemcpyBatchAsync copies.
type CopyPath int

const (
	// CopyPathKernel: one launch of cudapool's batch copy kernel (cudart/kernels),
	// loaded from PTX at run time. The software device's batches are one op, as
	// this kernel's.
	CopyPathKernel CopyPath = iota + 1
	// CopyPathBatch: cudaMemcpyBatchAsync (CUDA 13), 4,096 pieces a call, where the
	// kernel did not load.
	CopyPathBatch
	// CopyPathPieces: one cudaMemcpyAsync per piece, where neither is available.
	CopyPathPieces
)

func (p CopyPath) String() string {
	switch p {
	case CopyPathKernel:
		return "kernel"
	case CopyPathBatch:
		return "cudaMemcpyBatchAsync"
	case CopyPathPieces:
		return "one cudaMemcpyAsync per piece"
	}
	return fmt.Sprintf("CopyPath(%d)", int(p))
}
