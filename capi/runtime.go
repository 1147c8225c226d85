package main

/*
#include "cp.h"
*/
import "C"

import (
	"errors"
	"fmt"
	"os"
	"strings"
	"sync"
	"sync/atomic"
	"time"
	"unsafe"

	"github.com/cudapool/cudapool/cudart"
	rtchoice "github.com/cudapool/cudapool/cudart/choose"
)

// RuntimeEnv names the runtime preference used when no cudapool_init came first.
const RuntimeEnv = "CUDAPOOL_RUNTIME"

// chosen is the process's runtime, picked once.
type chosen struct {
	rt     cudart.Runtime
	prefer string
	onGPU  bool
	why    string
}

var (
	current  atomic.Pointer[chosen]
	chooseMu sync.Mutex
)

// choose picks the runtime for prefer ("" means the GPU), once per process. A later
// call with the same preference returns the first choice; with another it fails. The
// software device is used only when asked for ("test", or "auto" without a GPU): a
// library that fell back unasked would hide a broken CUDA install from its caller.
func choose(prefer string) (*chosen, error) {
	if prefer == "" {
		prefer = rtchoice.GPU
	}
	chooseMu.Lock()
	defer chooseMu.Unlock()
	syncEnv()
	if c := current.Load(); c != nil {
		if c.prefer != prefer {
			return nil, fmt.Errorf("%w: %q (%s), not %q", errRuntimeSet, c.prefer, c.why, prefer)
		}
		return c, nil
	}
	picked, err := rtchoice.Runtime(prefer)
	rt, onGPU, why := picked.Runtime, picked.OnGPU, picked.Why
	if err != nil {
		return nil, chooseFailed(prefer, err)
	}
	c := &chosen{rt: rt, prefer: prefer, onGPU: onGPU, why: why}
	current.Store(c)
	return c, nil
}

// softDeviceLinked says whether this library was built with the software device
// (softdevice.go, -tags cudapool_softdevice).
var softDeviceLinked bool

// rebuildAdvice is how a C or Python caller gets a library with the software device.
const rebuildAdvice = "rebuild libcudapool with the software device: go build -buildmode=c-shared -tags cudapool_softdevice -o bin/libcudapool.so ./capi"

// adviceError is an error whose message is written for the library's callers, C and
// Python programs, while errors.Is still sees what it wraps.
type adviceError struct {
	msg string
	err error
}

func (e *adviceError) Error() string { return e.msg }
func (e *adviceError) Unwrap() error { return e.err }

// chooseFailed is the error of choosing the runtime prefer, which failed with err,
// saying what a C or Python caller can do: choose's own words tell a Go program to
// import a package, which they cannot.
func chooseFailed(prefer string, err error) error {
	msg := fmt.Sprintf("cudapool: choosing the runtime %q: %v", prefer, err)
	if errors.Is(err, rtchoice.ErrNoSoftwareDevice) {
		msg = strings.ReplaceAll(msg, rtchoice.ErrNoSoftwareDevice.Error(), "no software device is in this libcudapool ("+rebuildAdvice+")")
	} else if prefer == rtchoice.GPU && errors.Is(err, cudart.ErrNoRuntime) {
		msg += `; to run on cudapool's software device instead, call cudapool_init("auto") (Python: cudapool.init("auto")) or set ` + RuntimeEnv + `=auto, in every process, before the first call`
		if !softDeviceLinked {
			msg += ", and " + rebuildAdvice
		}
	}
	return &adviceError{msg: msg, err: err}
}

// runtimeNow is the process's runtime, chosen from $CUDAPOOL_RUNTIME (the GPU if unset)
// if none is yet.
func runtimeNow() (cudart.Runtime, error) {
	if c := current.Load(); c != nil {
		return c.rt, nil
	}
	// The variable as the process has it now, not as it started: a Python program
	// sets it in os.environ before its first call, which need not be cudapool.init.
	syncEnv()
	c, err := choose(os.Getenv(RuntimeEnv))
	if err != nil {
		return nil, err
	}
	return c.rt, nil
}

func msDuration(ms int64) time.Duration { return time.Duration(ms) * time.Millisecond }

// syncEnv brings the variables cudapool reads (CUDAPOOL_*, and XDG_RUNTIME_DIR and
// TMPDIR for the announce directory) up to date from the process's environment. The Go
// runtime of a shared library copies the environment the process started with, so a
// variable a Python program set before its first call would go unseen. Called where
// such a variable is read; never on the allocation path.
func syncEnv() {
	now := map[string]string{}
	for p := C.environ; p != nil && *p != nil; p = (**C.char)(unsafe.Add(unsafe.Pointer(p), unsafe.Sizeof(*p))) {
		if k, v, ok := strings.Cut(C.GoString(*p), "="); ok && readsEnv(k) {
			now[k] = v
		}
	}
	for _, kv := range os.Environ() {
		if k, _, _ := strings.Cut(kv, "="); readsEnv(k) {
			if _, ok := now[k]; !ok {
				_ = os.Unsetenv(k) // names from the environment itself: a failure keeps the old value
			}
		}
	}
	for k, v := range now {
		if old, ok := os.LookupEnv(k); !ok || old != v {
			_ = os.Setenv(k, v) // names from the environment itself: a failure keeps the old value
		}
	}
}

func readsEnv(name string) bool {
	return strings.HasPrefix(name, "CUDAPOOL_") || name == "XDG_RUNTIME_DIR" || name == "TMPDIR"
}

//export cpgo_init
func cpgo_init(prefer *C.char, why *C.char, whyLen C.size_t) (rc C.int) {
	defer recoverTo(&rc)
	var p string
	if prefer != nil {
		p = C.GoString(prefer)
	} else {
		syncEnv()
		p = os.Getenv(RuntimeEnv)
	}
	c, err := choose(p)
	if err != nil {
		return fail(err)
	}
	writeText(why, whyLen, c.why)
	return statusOK
}

//export cpgo_runtime_info
func cpgo_runtime_info(onGPU *C.int, devices *C.int, name *C.char, nameLen C.size_t) (rc C.int) {
	defer recoverTo(&rc)
	if _, err := runtimeNow(); err != nil {
		return fail(err)
	}
	c := current.Load()
	if onGPU != nil {
		*onGPU = 0
		if c.onGPU {
			*onGPU = 1
		}
	}
	if devices != nil {
		n, err := c.rt.DeviceCount()
		if err != nil {
			return fail(err)
		}
		*devices = C.int(n)
	}
	writeText(name, nameLen, c.rt.Name())
	return statusOK
}

//export cpgo_stream_create
func cpgo_stream_create(device C.int, out *C.uintptr_t) (rc C.int) {
	defer recoverTo(&rc)
	if out == nil {
		return fail(invalid("stream is NULL"))
	}
	rt, err := runtimeNow()
	if err != nil {
		return fail(err)
	}
	s, err := rt.StreamCreate(int(device), cudart.StreamNonBlocking)
	if err != nil {
		return fail(err)
	}
	*out = C.uintptr_t(s)
	return statusOK
}

//export cpgo_stream_destroy
func cpgo_stream_destroy(device C.int, s C.uintptr_t) (rc C.int) {
	defer recoverTo(&rc)
	return result(destroyStream(int(device), cudart.Stream(s)))
}

// destroyStream destroys stream s of device dev (cudapool_stream_destroy) once every
// replica C holds has taken its last record of s (forgetStream).
func destroyStream(dev int, s cudart.Stream) error {
	rt, err := runtimeNow()
	if err != nil {
		return err
	}
	if s == 0 {
		return invalid("the legacy default stream (NULL) cannot be destroyed")
	}
	forgetStream(s)
	return rt.StreamDestroy(dev, s)
}

//export cpgo_stream_synchronize
func cpgo_stream_synchronize(device C.int, s C.uintptr_t) (rc C.int) {
	defer recoverTo(&rc)
	rt, err := runtimeNow()
	if err != nil {
		return fail(err)
	}
	return result(rt.StreamSynchronize(int(device), cudart.Stream(s)))
}

//export cpgo_stream_wait
func cpgo_stream_wait(device C.int, waiter, waited C.uintptr_t) (rc C.int) {
	defer recoverTo(&rc)
	rt, err := runtimeNow()
	if err != nil {
		return fail(err)
	}
	return result(streamWait(rt, int(device), cudart.Stream(waiter), cudart.Stream(waited)))
}

// streamWait orders waiter after waited through an event made for the purpose: the
// wait captures the event's work when it is queued, so the event can go at once.
func streamWait(rt cudart.Runtime, dev int, waiter, waited cudart.Stream) error {
	if waiter == waited {
		return nil
	}
	ev, err := rt.EventCreate(dev, cudart.EventDisableTiming)
	if err != nil {
		return err
	}
	err = rt.EventRecord(dev, ev, waited)
	if err == nil {
		err = rt.StreamWaitEvent(dev, waiter, ev)
	}
	return errors.Join(err, rt.EventDestroy(dev, ev))
}

//export cpgo_copy_to_device
func cpgo_copy_to_device(device C.int, dst C.uintptr_t, src unsafe.Pointer, n C.size_t, s C.uintptr_t) (rc C.int) {
	defer recoverTo(&rc)
	if err := checkCopy(uintptr(dst), src, n); err != nil {
		return fail(err)
	}
	rt, err := runtimeNow()
	if err != nil {
		return fail(err)
	}
	return result(rt.MemcpyHtoDAsync(int(device), cudart.DevicePtr(dst), unsafe.Slice((*byte)(src), int(n)), cudart.Stream(s)))
}

//export cpgo_copy_from_device
func cpgo_copy_from_device(device C.int, dst unsafe.Pointer, src C.uintptr_t, n C.size_t, s C.uintptr_t) (rc C.int) {
	defer recoverTo(&rc)
	if err := checkCopy(uintptr(src), dst, n); err != nil {
		return fail(err)
	}
	rt, err := runtimeNow()
	if err != nil {
		return fail(err)
	}
	return result(rt.MemcpyDtoHAsync(int(device), unsafe.Slice((*byte)(dst), int(n)), cudart.DevicePtr(src), cudart.Stream(s)))
}

func checkCopy(dev uintptr, host unsafe.Pointer, n C.size_t) error {
	switch {
	case dev == 0:
		return invalid("device pointer is NULL")
	case host == nil:
		return invalid("host pointer is NULL")
	case n == 0:
		return invalid("size is 0")
	}
	return checkLen(n, "a copy")
}
