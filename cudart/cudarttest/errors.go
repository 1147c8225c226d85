package cudarttest

import (
	"errors"
	"fmt"

	"github.com/cudapool/cudapool/cudart"
)

// ErrViolation is wrapped by every error that reports a Violation: the call broke a
// rule that the real driver leaves undefined (or silently accepts), so on a GPU it
// would have corrupted data instead of failing.
var ErrViolation = errors.New("cudarttest: violation")

// ErrClosed means the Device was closed: like a process that has exited, it answers
// no more calls. Such errors also wrap cudart.ErrDevicesUnavailable, so code that
// only inspects CUDA codes sees a failure too.
var ErrClosed = errors.New("cudarttest: device closed")

// ErrCapacity means a fixed-size table of the software device is full (allocations
// per pool, importers per allocation, IPC events per device). The real driver has no
// such limit; the error also wraps cudart.ErrOutOfMemory.
var ErrCapacity = errors.New("cudarttest: software device table full")

// ErrAddressOverlap means an imported pool's device addresses overlap a pool this
// Device already maps. Addresses are random per process, so this practically never
// happens; the error also wraps cudart.ErrOutOfMemory.
var ErrAddressOverlap = errors.New("cudarttest: imported pool overlaps mapped addresses")

// ViolationKind says which undefined-behaviour rule a call broke.
type ViolationKind int

const (
	// ViolationExporterFreedWhileImported: the exporting Device freed an allocation
	// that a live importer still held.
	ViolationExporterFreedWhileImported ViolationKind = iota + 1
	// ViolationUseAfterRelease: access or free of memory after its release: a freed
	// allocation, an import already unmapped (by its own free or a double import's),
	// an import of a stale record, an imported event its owner destroyed, a stream
	// named after its destruction.
	ViolationUseAfterRelease
	// ViolationUnorderedRead: memory that another Device wrote (or allocated) was
	// read on a stream not ordered after that write by an event: typically an import
	// used before its ready event.
	ViolationUnorderedRead
	// ViolationUnorderedWrite: the same for a write: memory another Device wrote or
	// allocated was overwritten on a stream not ordered after that write.
	ViolationUnorderedWrite
	// ViolationAccessDenied: a device accessed a pool (own or imported) that this
	// process never granted it with MemPoolSetAccess (or granted read-only, for a
	// write).
	ViolationAccessDenied
	// ViolationUnorderedFree: memory was freed on a stream not ordered after another
	// stream's access to it, so the free may run (and the memory be reused) before
	// that access.
	ViolationUnorderedFree
)

func (k ViolationKind) String() string {
	switch k {
	case ViolationExporterFreedWhileImported:
		return "exporter freed while imported"
	case ViolationUseAfterRelease:
		return "use after release"
	case ViolationUnorderedRead:
		return "unordered read"
	case ViolationUnorderedWrite:
		return "unordered write"
	case ViolationAccessDenied:
		return "access denied"
	case ViolationUnorderedFree:
		return "unordered free"
	}
	return fmt.Sprintf("ViolationKind(%d)", int(k))
}

// Violation is one broken rule, as recorded by the Device that saw it.
type Violation struct {
	Kind   ViolationKind
	Op     string // the CUDA call that broke the rule
	Detail string
	Seed   uint64 // the seed of the Device that saw it (see SeedEnv)
}

func (v Violation) Error() string {
	return fmt.Sprintf("cudarttest: %s in %s: %s (seed %d)", v.Kind, v.Op, v.Detail, v.Seed)
}

// Is makes every Violation match ErrViolation.
func (v Violation) Is(target error) bool { return target == ErrViolation }

// callError is what a call that saw violations returns: the violations, and the CUDA
// error the real driver would have returned too, if it would have failed.
type callError struct {
	violations []Violation
	cuda       *cudart.Error // nil where the real driver would have succeeded
}

func (e *callError) Error() string {
	s := ""
	for i, v := range e.violations {
		if i > 0 {
			s += "; "
		}
		s += v.Error()
	}
	if e.cuda != nil {
		s += " (" + e.cuda.Error() + ")"
	}
	return s
}

func (e *callError) Unwrap() []error {
	errs := make([]error, 0, len(e.violations)+1)
	for _, v := range e.violations {
		errs = append(errs, v)
	}
	if e.cuda != nil {
		errs = append(errs, e.cuda)
	}
	return errs
}

// detailError is a CUDA failure with the software device's reason attached, and its
// own sentinel where the failure is the software device's rather than the driver's.
type detailError struct {
	cuda     *cudart.Error
	sentinel error // nil where the real driver would fail the same way
	detail   string
}

func (e *detailError) Error() string {
	if e.sentinel != nil {
		return fmt.Sprintf("%v: %s (%v)", e.sentinel, e.detail, e.cuda)
	}
	return fmt.Sprintf("%v: %s", e.cuda, e.detail)
}

func (e *detailError) Unwrap() []error {
	if e.sentinel == nil {
		return []error{e.cuda}
	}
	return []error{e.sentinel, e.cuda}
}

func fail(op string, code cudart.Code) error { return cudart.NewError(op, code) }

// invalid is ErrInvalidValue with the reason.
func invalid(op, why string) error {
	return &detailError{cuda: cudart.NewError(op, cudart.ErrInvalidValue), detail: why}
}

func errClosed(op string) error {
	return &detailError{cudart.NewError(op, cudart.ErrDevicesUnavailable), ErrClosed, "the device was closed"}
}

func errCapacity(op, detail string) error {
	return &detailError{cudart.NewError(op, cudart.ErrOutOfMemory), ErrCapacity, detail}
}

// errLost is the error of every call once the context is lost: cudaErrorContained on
// the device where it was lost, cudaErrorDevicesUnavailable on the others (FACTS 14).
// d.mu is held.
func (d *Device) errLost(op string, dev int) error {
	code := cudart.ErrDevicesUnavailable
	if dev == d.lostOn {
		code = cudart.ErrContained
	}
	e := cudart.NewError(op, code)
	e.ContextLost = true
	return &detailError{cuda: e, detail: fmt.Sprintf("the context was lost on device %d by a read of a dead process's memory", d.lostOn)}
}
