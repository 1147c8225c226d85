package main

/*
#include "cp.h"
*/
import "C"

import (
	"context"
	"errors"
	"fmt"
	"runtime/debug"
	"unsafe"

	"github.com/cudapool/cudapool/consumer"
	"github.com/cudapool/cudapool/cudart"
	rtchoice "github.com/cudapool/cudapool/cudart/choose"
	"github.com/cudapool/cudapool/pool"
	"github.com/cudapool/cudapool/producer"
)

// The status codes of cudapool.h.
const (
	statusOK        = 0
	statusInval     = 1
	statusHandle    = 2
	statusPointer   = 3
	statusClosed    = 4
	statusNoMem     = 5
	statusNotFound  = 6
	statusExist     = 7
	statusBusy      = 8
	statusGone      = 9
	statusRefused   = 10
	statusVersion   = 11
	statusProtocol  = 12
	statusTimeout   = 13
	statusRange     = 14
	statusNoRuntime = 15
	statusCUDA      = 16
	statusNotSup    = 18
	statusInternal  = 19
	statusIO        = 20
)

// The conditions the C layer itself finds, each with its status.
var (
	errInvalid    = errors.New("cudapool: invalid argument")
	errHandle     = errors.New("cudapool: invalid handle")
	errPointer    = errors.New("cudapool: not a pointer of a cudapool pool")
	errRange      = errors.New("cudapool: output buffer too small")
	errRuntimeSet = errors.New("cudapool: another runtime was chosen already")
)

// statuses maps each condition an error can wrap to its status, first match wins.
var statuses = []struct {
	err    error
	status int
}{
	{errInvalid, statusInval},
	{errHandle, statusHandle},
	{errPointer, statusPointer},
	{errRange, statusRange},
	{errRuntimeSet, statusNoRuntime},
	{context.DeadlineExceeded, statusTimeout},
	{pool.ErrZeroSize, statusInval},
	{pool.ErrInvalidOption, statusInval},
	{consumer.ErrBadName, statusInval},
	{producer.ErrBadRange, statusInval},
	{producer.ErrMetaTooLong, statusInval},
	{pool.ErrForeignBuffer, statusPointer},
	{pool.ErrFreed, statusPointer},
	{consumer.ErrReleased, statusHandle},
	{pool.ErrBusy, statusBusy},
	{pool.ErrClosed, statusClosed},
	{consumer.ErrClosed, statusClosed},
	{cudart.ErrOutOfMemory, statusNoMem},
	{consumer.ErrUnknownName, statusNotFound},
	{producer.ErrNameInUse, statusExist},
	{producer.ErrAddressInUse, statusExist},
	{consumer.ErrExporterGone, statusGone},
	{consumer.ErrBufferGone, statusGone},
	{producer.ErrNoPeer, statusNotFound},
	{consumer.ErrRefused, statusRefused},
	{consumer.ErrVersionMismatch, statusVersion},
	{consumer.ErrProtocol, statusProtocol},
	{pool.ErrUnsupportedHandleType, statusNotSup},
	{consumer.ErrHandleType, statusNotSup},
	{producer.ErrIMEXRequired, statusNotSup},
	{cudart.ErrNoRuntime, statusNoRuntime},
	{rtchoice.ErrNoSoftwareDevice, statusNoRuntime},
}

// statusOf is the status for err: the first condition it wraps, else a CUDA failure,
// else a failure of the system.
func statusOf(err error) int {
	if err == nil {
		return statusOK
	}
	for _, s := range statuses {
		if errors.Is(err, s.err) {
			return s.status
		}
	}
	var code cudart.Code
	if errors.As(err, &code) {
		return statusCUDA
	}
	return statusIO
}

// fail records err as this thread's last error and returns its status.
func fail(err error) C.int {
	setError(err.Error())
	return C.int(statusOf(err))
}

// result is fail for an error, and statusOK for nil.
func result(err error) C.int {
	if err == nil {
		return statusOK
	}
	return fail(err)
}

func setError(msg string) {
	if msg == "" {
		return
	}
	C.cp_set_error((*C.char)(unsafe.Pointer(unsafe.StringData(msg))), C.size_t(len(msg)))
}

// recoverTo turns a panic in an entry point into statusInternal with the stack in the
// message: no input may crash the host process. Defer it directly.
func recoverTo(rc *C.int) {
	if r := recover(); r != nil {
		*rc = C.int(statusInternal)
		setPanic(r)
	}
}

// recoverToNull is recoverTo for the entry points that return a pointer (if ptr is
// not nil) or nothing.
func recoverToNull(ptr *C.uintptr_t) {
	if r := recover(); r != nil {
		if ptr != nil {
			*ptr = 0
		}
		setPanic(r)
	}
}

func setPanic(r any) {
	setError(fmt.Sprintf("cudapool: internal error (please report): %v\n%s", r, debug.Stack()))
}

// invalid is an errInvalid error saying what is wrong.
func invalid(format string, args ...any) error {
	return fmt.Errorf("%w: "+format, append([]any{errInvalid}, args...)...)
}

// ctxFor is the context for a call bounded by timeoutMs (0: no bound).
func ctxFor(timeoutMs C.int64_t) (context.Context, context.CancelFunc, error) {
	switch {
	case timeoutMs < 0:
		return nil, nil, invalid("timeout_ms %d is negative (0 means no bound)", int64(timeoutMs))
	case timeoutMs == 0:
		ctx, cancel := context.WithCancel(context.Background())
		return ctx, cancel, nil
	}
	ctx, cancel := context.WithTimeout(context.Background(), msDuration(int64(timeoutMs)))
	return ctx, cancel, nil
}

// nameAndContext reads a C string argument called what and makes the context for
// timeoutMs: what most blocking entry points check first. The caller calls cancel
// when err is nil.
func nameAndContext(s *C.char, what string, timeoutMs C.int64_t) (string, context.Context, context.CancelFunc, error) {
	name, err := goString(s, what)
	if err != nil {
		return "", nil, nil, err
	}
	ctx, cancel, err := ctxFor(timeoutMs)
	return name, ctx, cancel, err
}

// goString reads a C string argument; NULL is an error naming what.
func goString(s *C.char, what string) (string, error) {
	if s == nil {
		return "", invalid("%s is NULL", what)
	}
	return C.GoString(s), nil
}

// writeOut copies data to a caller's buffer of cap bytes and stores its length in
// *n; text gets a terminating NUL too (not counted). A short buffer fails with
// errRange, nothing copied, *n the length needed.
func writeOut(buf unsafe.Pointer, cap C.size_t, n *C.size_t, data []byte, text bool) error {
	if n == nil {
		return invalid("len is NULL")
	}
	*n = C.size_t(len(data))
	need := len(data)
	if text {
		need++
	}
	if need == 0 {
		return nil
	}
	if buf == nil || int(cap) < need {
		return fmt.Errorf("%w: %d bytes needed, %d given", errRange, need, int(cap))
	}
	out := unsafe.Slice((*byte)(buf), need)
	copy(out, data)
	if text {
		out[len(data)] = 0
	}
	return nil
}

// writeText copies s into buf (cut to fit, NUL-terminated) when buf is not NULL.
func writeText(buf *C.char, cap C.size_t, s string) {
	if buf == nil || cap == 0 {
		return
	}
	out := unsafe.Slice((*byte)(unsafe.Pointer(buf)), int(cap))
	n := copy(out[:len(out)-1], s)
	out[n] = 0
}
