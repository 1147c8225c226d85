package cudart

import (
	"errors"
	"fmt"
	"strings"
)

// Code is a cudaError_t. A Code is itself an error, so the exported sentinels below
// can be matched with errors.Is against any error a Runtime returns.
type Code int32

// The CUDA error codes cudapool meets. Their values are cudaError_t's.
const (
	ErrInvalidValue          Code = 1
	ErrOutOfMemory           Code = 2
	ErrInitialization        Code = 3
	ErrInsufficientDriver    Code = 35
	ErrDevicesUnavailable    Code = 46
	ErrContained             Code = 226
	ErrNoDevice              Code = 100
	ErrInvalidDevice         Code = 101
	ErrInvalidResourceHandle Code = 400
	ErrNotReady              Code = 600
	ErrIllegalAddress        Code = 700
	ErrHostAlreadyRegistered Code = 712
	ErrHostNotRegistered     Code = 713
	ErrNotPermitted          Code = 800
	ErrNotSupported          Code = 801
	ErrUnknown               Code = 999
)

var codeNames = map[Code][2]string{
	0:                        {"cudaSuccess", "no error"},
	ErrInvalidValue:          {"cudaErrorInvalidValue", "invalid argument"},
	ErrOutOfMemory:           {"cudaErrorMemoryAllocation", "out of memory"},
	ErrInitialization:        {"cudaErrorInitializationError", "initialization error"},
	ErrInsufficientDriver:    {"cudaErrorInsufficientDriver", "CUDA driver version is insufficient for CUDA runtime version"},
	ErrDevicesUnavailable:    {"cudaErrorDevicesUnavailable", "CUDA-capable device(s) is/are busy or unavailable"},
	ErrContained:             {"cudaErrorContained", "Invalid access of peer GPU memory over nvlink or a hardware error"},
	ErrNoDevice:              {"cudaErrorNoDevice", "no CUDA-capable device is detected"},
	ErrInvalidDevice:         {"cudaErrorInvalidDevice", "invalid device ordinal"},
	ErrInvalidResourceHandle: {"cudaErrorInvalidResourceHandle", "invalid resource handle"},
	ErrNotReady:              {"cudaErrorNotReady", "device not ready"},
	ErrIllegalAddress:        {"cudaErrorIllegalAddress", "an illegal memory access was encountered"},
	ErrHostAlreadyRegistered: {"cudaErrorHostMemoryAlreadyRegistered", "part or all of the requested memory range is already mapped"},
	ErrHostNotRegistered:     {"cudaErrorHostMemoryNotRegistered", "pointer does not correspond to a registered memory region"},
	ErrNotPermitted:          {"cudaErrorNotPermitted", "operation not permitted"},
	ErrNotSupported:          {"cudaErrorNotSupported", "operation not supported"},
	ErrUnknown:               {"cudaErrorUnknown", "unknown error"},
}

// Name is the CUDA name of the code, e.g. "cudaErrorInvalidValue".
func (c Code) Name() string {
	if n, ok := codeNames[c]; ok {
		return n[0]
	}
	return fmt.Sprintf("cudaError(%d)", int32(c))
}

// Text is CUDA's description of the code, e.g. "invalid argument".
func (c Code) Text() string {
	if n, ok := codeNames[c]; ok {
		return n[1]
	}
	return "unrecognized error code"
}

func (c Code) Error() string { return c.Name() + ": " + c.Text() }

// Error is a failed Runtime call: which call, and the code it returned. Name and Text
// come from the runtime that failed (cudaGetErrorName / cudaGetErrorString) where it
// could say, else from cudapool's table.
type Error struct {
	Op   string // the CUDA call, e.g. "cudaMallocFromPoolAsync"
	Code Code
	Name string
	Text string
	// ContextLost is set on every error the runtime returns once a call of this
	// process failed with ErrContained: the failure is sticky (FACTS 14), whatever code
	// the later calls return (ErrDevicesUnavailable on another device, for one).
	ContextLost bool
}

// NewError is the error for call op returning code, named from cudapool's table.
func NewError(op string, code Code) *Error {
	return &Error{Op: op, Code: code, Name: code.Name(), Text: code.Text()}
}

func (e *Error) Error() string {
	s := fmt.Sprintf("%s: %s (%d): %s", e.Op, e.Name, int32(e.Code), e.Text)
	if e.lost() {
		s += " (" + ErrContextLost.Error() + ")"
	}
	return s
}

func (e *Error) lost() bool { return e.ContextLost || e.Code == ErrContained }

// Unwrap returns the Code, so errors.Is(err, cudart.ErrInvalidValue) works, and
// ErrContextLost too for an error of a process whose context is lost.
func (e *Error) Unwrap() []error {
	if e.lost() {
		return []error{e.Code, ErrContextLost}
	}
	return []error{e.Code}
}

// ErrContextLost means this process's CUDA context is lost: a call failed with
// ErrContained (a peer GPU's memory became unreachable, typically because the
// process that owned it died while this one read it from another GPU, FACTS 14, or
// a hardware error), and the driver fails every later call of the process. Nothing
// short of a new process recovers: save what host state you need and restart. Every
// *Error with code ErrContained, and every error the runtime returns after one,
// wraps it.
var ErrContextLost = errors.New("cudart: this process's CUDA context is lost; every CUDA call will fail: restart the process")

// ErrNoRuntime means no usable CUDA runtime could be loaded: no library, a library
// without a symbol cudapool needs, or a build without cgo.
var ErrNoRuntime = errors.New("cudart: no usable CUDA runtime")

// ErrNoVMM means a Runtime has no virtual memory management binding (VMMOf): it
// can share memory through pools only.
var ErrNoVMM = errors.New("cudart: the runtime has no virtual memory management (VMM) binding")

// LoadError says why Load found no usable runtime. It wraps ErrNoRuntime.
type LoadError struct {
	// Tried lists each library tried with why it failed, in order.
	Tried []string
}

func (e *LoadError) Error() string {
	return "cudart: no usable CUDA runtime; tried " + strings.Join(e.Tried, "; ")
}

func (e *LoadError) Unwrap() error { return ErrNoRuntime }
