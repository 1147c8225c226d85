package cudart

import "fmt"

// MemHandle is a CUmemGenericAllocationHandle: one physical allocation of device
// memory (a chunk) that MemCreate made or MemImportFromShareableHandle imported. It
// has no address until MemMap maps it into reserved addresses.
type MemHandle uint64

// VMM is the driver's virtual memory management API (cuMemCreate, cuMemMap and
// friends): physical allocations shared as POSIX file descriptors or FABRIC handles,
// mapped into address ranges the caller reserves. It is a sibling of Runtime rather
// than part of it: only the VMM route needs it, and a Runtime that wraps another
// (internal/intercept's) need not grow ten methods for it. VMMOf finds it behind a
// Runtime.
//
// Every method takes the device whose primary context it makes current on the
// calling thread first, as Runtime's do: the driver API needs a current context.
// The granularity every size and offset must be a multiple of is Runtime's
// AllocationGranularity for the handle type. Errors wrap a Code, as Runtime's do
// (the driver's CUresult values agree with cudaError_t's for every Code named here).
// Methods are safe for concurrent use.
type VMM interface {
	// MemCreate makes a chunk of size bytes of pinned memory on dev that can be
	// exported as ht (HandleTypeNone: not at all). A FABRIC chunk on a host without an
	// IMEX channel fails with ErrNotPermitted (FACTS 25). On failure nothing is made.
	MemCreate(dev int, size uint64, ht HandleType) (MemHandle, error)
	// MemRelease gives up h. The memory lives on while a mapping of it, or an
	// exported descriptor of it in any process, remains (cuMemRelease).
	MemRelease(dev int, h MemHandle) error
	// MemExportToShareableHandle exports h as ht; for a POSIX fd the caller owns the
	// returned descriptor, and that descriptor alone keeps the memory alive (FACTS
	// 26). A handle that was itself imported cannot be exported again
	// (ErrInvalidValue, FACTS 25): pass its descriptor on instead.
	MemExportToShareableHandle(dev int, h MemHandle, ht HandleType) (ShareableHandle, error)
	// MemImportFromShareableHandle imports a chunk another process exported. It does
	// not take ownership of sh.FD: the caller closes it. Release the result with
	// MemRelease.
	MemImportFromShareableHandle(dev int, sh ShareableHandle) (MemHandle, error)
	// MemAddressReserve reserves size bytes of device addresses aligned to alignment
	// (0: the granularity). Nothing is mapped there yet.
	MemAddressReserve(dev int, size, alignment uint64) (DevicePtr, error)
	// MemAddressFree gives back what MemAddressReserve reserved at ptr, of the same
	// size, once nothing is mapped in it.
	MemAddressFree(dev int, ptr DevicePtr, size uint64) error
	// MemMap maps size bytes of h, from offset, at ptr in a reservation, where nothing
	// is mapped yet. A new mapping is not accessible until MemSetAccess grants it.
	MemMap(dev int, ptr DevicePtr, size, offset uint64, h MemHandle) error
	// MemUnmap unmaps [ptr, ptr+size), which must be exactly what one MemMap mapped;
	// the addresses stay reserved. Work still queued that touches them must have run.
	MemUnmap(dev int, ptr DevicePtr, size uint64) error
	// MemSetAccess grants each desc's device access to the mapped [ptr, ptr+size).
	MemSetAccess(dev int, ptr DevicePtr, size uint64, descs []AccessDesc) error

	// StreamWriteValue32 writes value to the 4-byte aligned word at ptr once the
	// work queued on s before it has run (cuStreamWriteValue32). It works on VMM
	// memory, where pool memory refuses it with ErrInvalidValue (FACTS 15, 27).
	StreamWriteValue32(dev int, ptr DevicePtr, value uint32, s Stream) error
	// StreamWaitValue32 holds the work queued on s after it until the word at ptr
	// meets cond against value (cuStreamWaitValue32); it does not block the host.
	StreamWaitValue32(dev int, ptr DevicePtr, value uint32, cond WaitCond, s Stream) error
}

// WaitCond is the condition StreamWaitValue32 waits for (CUstreamWaitValue_flags).
type WaitCond uint32

const (
	WaitGEQ WaitCond = 0x0 // int32(word - value) >= 0: the word reached value, with wrap-around
	WaitEQ  WaitCond = 0x1 // word == value
	WaitAnd WaitCond = 0x2 // word & value != 0
	WaitNor WaitCond = 0x3 // ^(word | value) != 0
)

// Met reports whether word meets c against value, as the GPU decides it.
func (c WaitCond) Met(word, value uint32) bool {
	switch c {
	case WaitGEQ:
		return int32(word-value) >= 0
	case WaitEQ:
		return word == value
	case WaitAnd:
		return word&value != 0
	case WaitNor:
		return ^(word | value) != 0
	}
	return false
}

// VMMOf is the VMM behind rt: rt itself where it has one, else that of the Runtime
// it wraps (a Runtime with an Unwrap method, as internal/intercept's), recursively.
// Where none has one the error wraps ErrNoVMM.
func VMMOf(rt Runtime) (VMM, error) {
	for r := rt; r != nil; {
		if v, ok := r.(VMM); ok {
			return v, nil
		}
		u, ok := r.(interface{ Unwrap() Runtime })
		if !ok {
			break
		}
		r = u.Unwrap()
	}
	name := "no runtime"
	if rt != nil {
		name = rt.Name()
	}
	return nil, fmt.Errorf("%w: %s", ErrNoVMM, name)
}
