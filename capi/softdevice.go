//go:build cgo && cudapool_softdevice

package main

// Built with -tags cudapool_softdevice, libcudapool links the software device in, for
// its test mode: cudapool_init("test"), and "auto" where there is no GPU, run on it.
// Without the tag the library offers the GPU only.
//
// This build alone also has two test-only entry points (cudapool.h declares them under
// CUDAPOOL_SOFTDEVICE_TESTING): cudapool_test_stall_stream holds a stream of the
// software device, so that work queued on it does not run, and cudapool_test_resume
// lets it run again. They are what Go tests get from cudarttest.Device.Stall, for C
// and Python tests: a test can see that a call queued its work on the stream it was
// given. They are no API for anything else.

/*
#include <stdint.h>
*/
import "C"

import (
	"sync"

	"github.com/cudapool/cudapool/cudart"
	_ "github.com/cudapool/cudapool/cudart/choose/softdevice"
	"github.com/cudapool/cudapool/cudart/cudarttest"
)

var stalls struct {
	sync.Mutex
	next    uint64
	resumes map[uint64]func()
}

// cudapool_test_stall_stream holds stream s of device dev of the software device until
// cudapool_test_resume(*token): work queued on it after this call does not run. It
// fails with CUDAPOOL_EINVAL where the library does not run on the software device.
//
//export cudapool_test_stall_stream
func cudapool_test_stall_stream(dev C.int, s C.uintptr_t, token *C.uint64_t) (rc C.int) {
	defer recoverTo(&rc)
	if token == nil {
		return fail(invalid("token is NULL"))
	}
	rt, err := runtimeNow()
	if err != nil {
		return fail(err)
	}
	d, ok := rt.(*cudarttest.Device)
	if !ok {
		return fail(invalid("the library does not run on the software device: nothing to stall"))
	}
	resume, err := d.Stall(int(dev), cudart.Stream(s))
	if err != nil {
		return fail(err)
	}
	stalls.Lock()
	defer stalls.Unlock()
	if stalls.resumes == nil {
		stalls.resumes = map[uint64]func(){}
	}
	stalls.next++
	stalls.resumes[stalls.next] = resume
	*token = C.uint64_t(stalls.next)
	return statusOK
}

// cudapool_test_resume lets the stream held under token run again.
//
//export cudapool_test_resume
func cudapool_test_resume(token C.uint64_t) (rc C.int) {
	defer recoverTo(&rc)
	stalls.Lock()
	resume, ok := stalls.resumes[uint64(token)]
	delete(stalls.resumes, uint64(token))
	stalls.Unlock()
	if !ok {
		return fail(invalid("no stall %d", uint64(token)))
	}
	resume()
	return statusOK
}

func init() { softDeviceLinked = true }
