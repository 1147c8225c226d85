package main

/*
#include "cp.h"
*/
import "C"

import (
	"context"
	"errors"
	"fmt"
	"math"
	"runtime/debug"
	"strings"
	"time"
	"unsafe"

	"github.com/cudapool/cudapool/cudart"
	rtchoice "github.com/cudapool/cudapool/cudart/choose"
	"github.com/cudapool/cudapool/export"
	"github.com/cudapool/cudapool/export/consumer"
	"github.com/cudapool/cudapool/export/discover"
	"github.com/cudapool/cudapool/export/producer"
	"github.com/cudapool/cudapool/kv"
	"github.com/cudapool/cudapool/pool"
	"github.com/cudapool/cudapool/vmm"
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
	// Those of the sentinels that no older code stood for.
	statusStreamDevice = 21
	statusDuplicate    = 22
	statusTooMany      = 23
	statusLost         = 24
	statusExporter     = 25
	statusAbandoned    = 26
	statusStale        = 27
	statusBadDir       = 28
	// The KV page pool's.
	statusNoSpace = 29
)

// The conditions the C layer itself finds, each with its status.
var (
	errInvalid    = errors.New("cudapool: invalid argument")
	errHandle     = errors.New("cudapool: invalid handle")
	errPointer    = errors.New("cudapool: not a pointer of a cudapool pool")
	errRange      = errors.New("cudapool: output buffer too small")
	errRuntimeSet = errors.New("cudapool: another runtime was chosen already")
	errNotSup     = errors.New("cudapool: not supported")
)

// statuses maps each condition an error can wrap to its status, first match wins:
// every sentinel of cudart, choose, pool, producer, consumer and discover is here, so that none comes out as
// statusIO, which is for the system's own failures. A sentinel that wraps another
// (ErrMappingLost wraps ErrExporterGone) and an error that wraps two (ErrAbandoned
// with the context's) come before what they wrap.
var statuses = []struct {
	err    error
	status int
}{
	{errInvalid, statusInval},
	{errHandle, statusHandle},
	{errPointer, statusPointer},
	{errRange, statusRange},
	{errRuntimeSet, statusNoRuntime},
	{errNotSup, statusNotSup},
	{consumer.ErrOwnExporter, statusNotSup},
	{producer.ErrAbandoned, statusAbandoned},
	{context.DeadlineExceeded, statusTimeout},
	{pool.ErrZeroSize, statusInval},
	{pool.ErrInvalidOption, statusInval},
	{export.ErrBadName, statusInval},
	{export.ErrBadRange, statusInval},
	{producer.ErrMetaTooLong, statusInval},
	{producer.ErrSocketPath, statusInval},
	{rtchoice.ErrUnknownPreference, statusInval},
	{pool.ErrForeignBuffer, statusPointer},
	{pool.ErrFreed, statusPointer},
	{consumer.ErrReleased, statusHandle},
	{pool.ErrBusy, statusBusy},
	{pool.ErrClosed, statusClosed},
	{export.ErrClosed, statusClosed},
	{cudart.ErrOutOfMemory, statusNoMem},
	{export.ErrUnknownName, statusNotFound}, // also export.ErrBufferGone: a freed buffer's name is unknown
	{producer.ErrNoPeer, statusNotFound},
	{producer.ErrNameInUse, statusExist},
	{producer.ErrAddressInUse, statusExist},
	{export.ErrNotSocket, statusExist},
	{consumer.ErrMappingLost, statusLost},
	{export.ErrExporterGone, statusGone},
	{export.ErrRefused, statusRefused},
	{export.ErrVersionMismatch, statusVersion},
	{export.ErrProtocol, statusProtocol},
	{export.ErrBadRequest, statusProtocol},
	{pool.ErrUnsupportedHandleType, statusNotSup},
	{pool.ErrNotShareable, statusNotSup},
	{pool.ErrNoPeerAccess, statusNotSup},
	{export.ErrHandleType, statusNotSup},
	{export.ErrIMEXRequired, statusNotSup},
	{export.ErrNoLeases, statusNotSup},
	{consumer.ErrStreamDevice, statusStreamDevice},
	{consumer.ErrDuplicateImporter, statusDuplicate},
	{export.ErrTooManyGrants, statusTooMany},
	{export.ErrExporter, statusExporter},
	{export.ErrStaleLease, statusStale},
	{pool.ErrLeaseEnded, statusStale},
	{pool.ErrNotLeased, statusStale},
	{discover.ErrBadDir, statusBadDir},
	{pool.ErrMisaligned, statusCUDA},
	{pool.ErrFreeFailed, statusCUDA},
	{cudart.ErrContextLost, statusCUDA},
	{cudart.ErrNoRuntime, statusNoRuntime},
	{rtchoice.ErrNoSoftwareDevice, statusNoRuntime},
	{kv.ErrNoSpace, statusNoSpace},
	{kv.ErrStaleLease, statusStale},
	{kv.ErrLeaseLost, statusStale}, // the restarted owner does not hold it
	{kv.ErrOwnerGone, statusGone},
	{kv.ErrClosed, statusClosed},
	{kv.ErrGeometry, statusInval},
	{kv.ErrTooLarge, statusInval},
	{kv.ErrRefused, statusRefused},
	{kv.ErrLimit, statusTooMany},
	{vmm.ErrGranularity, statusInval},
	{vmm.ErrFull, statusInval},
	{vmm.ErrNotMapped, statusInval},
	{vmm.ErrClosed, statusClosed},
	{vmm.ErrFabricNotPermitted, statusNotSup}, // it wraps cudart.ErrNotPermitted, a CUDA code
	{vmm.ErrImported, statusNotSup},
	{cudart.ErrNoVMM, statusNotSup},
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

// noWaitKey marks the context of a CUDAPOOL_NO_WAIT call (noWait).
type noWaitKey struct{}

// noWaitBound bounds a CUDAPOOL_NO_WAIT call: it waits for nothing to change, but a
// live exporter's or owner's answer takes a round trip.
const noWaitBound = time.Second

// noWait says whether ctx is a CUDAPOOL_NO_WAIT call's: its wait flags are off.
func noWait(ctx context.Context) bool { return ctx.Value(noWaitKey{}) != nil }

// ctxFor is the context for a call bounded by timeoutMs: 0 is no bound, and
// CUDAPOOL_NO_WAIT (Python's timeout=0) the noWaitBound of a call marked noWait.
func ctxFor(timeoutMs C.int64_t) (context.Context, context.CancelFunc, error) {
	switch {
	case timeoutMs == C.CUDAPOOL_NO_WAIT:
		ctx, cancel := context.WithTimeout(context.WithValue(context.Background(), noWaitKey{}, true), noWaitBound)
		return ctx, cancel, nil
	case timeoutMs < 0:
		return nil, nil, invalid("timeout_ms %d is negative (0 means no bound, CUDAPOOL_NO_WAIT (-1) no wait)", int64(timeoutMs))
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
	if buf == nil || uint64(cap) < uint64(need) {
		return fmt.Errorf("%w: %d bytes needed, %d given", errRange, need, uint64(cap))
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
	n := uint64(len(s))
	if n > uint64(cap)-1 {
		n = uint64(cap) - 1
	}
	out := unsafe.Slice((*byte)(unsafe.Pointer(buf)), int(n)+1)
	copy(out, s[:n])
	out[n] = 0
}

// maxLen bounds the lengths the library takes from C: a Go slice holds at most
// math.MaxInt bytes, and no caller's buffer or copy comes near it.
const maxLen = math.MaxInt32

// checkLen fails for a length (called what) of n bytes that no caller's memory can
// hold, such as SIZE_MAX: a negative int, were it converted.
func checkLen(n C.size_t, what string) error {
	if uint64(n) > maxLen {
		return invalid("%s of %d bytes is larger than the %d the library takes", what, uint64(n), maxLen)
	}
	return nil
}

// options checks the size field that starts every options struct of cudapool.h, at p,
// against the known bytes of the struct this library was built with. It fails for a
// size of 0 (a struct not filled by its _default function) or below known (no older
// version exists), and for a larger struct of a newer header unless the fields this
// library does not know are zero, which keeps their defaults.
func options(p unsafe.Pointer, known uintptr, what string) error {
	size := *(*C.size_t)(p)
	switch {
	case size == 0:
		return invalid("%s have size 0: fill them with cudapool_%s_default", what, strings.ReplaceAll(what, " ", "_"))
	case uint64(size) < uint64(known):
		return invalid("%s of %d bytes are smaller than this library's (%d): fill them with cudapool_%s_default", what, uint64(size), known, strings.ReplaceAll(what, " ", "_"))
	case uint64(size) > 1<<16:
		return invalid("%s of %d bytes: size is not set", what, uint64(size))
	}
	for i, b := range unsafe.Slice((*byte)(unsafe.Add(p, known)), uintptr(size)-known) {
		if b != 0 {
			return fmt.Errorf("%w: %s from a newer cudapool.h set a field at byte %d that this library (%d.%d) does not know",
				errNotSup, what, known+uintptr(i), C.CUDAPOOL_VERSION_MAJOR, C.CUDAPOOL_VERSION_MINOR)
		}
	}
	return nil
}
