package main

/*
#include <stdint.h>
*/
import "C"

import (
	"context"
	"errors"
	"unsafe"

	"github.com/cudapool/cudapool/kv"
)

// kvDialReconnect is CUDAPOOL_KV_RECONNECT: replica.WithReconnect.
const kvDialReconnect = 2

// keepsLeasesWhenGone says whether a lease whose seal or release failed because the
// owner is gone is still held: with CUDAPOOL_KV_RECONNECT it is, to be re-declared to
// the restarted owner.
func (k *kvReplica) keepsLeasesWhenGone(err error) bool {
	return k.reconnect && errors.Is(err, kv.ErrOwnerGone)
}

//export cpgo_kv_reattaches
func cpgo_kv_reattaches(h C.uint64_t, n *C.uint64_t) (rc C.int) {
	defer recoverTo(&rc)
	if n == nil {
		return fail(invalid("n is NULL"))
	}
	k, err := kvGet(h)
	if err != nil {
		return fail(err)
	}
	*n = C.uint64_t(k.r.Reattaches())
	return statusOK
}

//export cpgo_kv_wait_attached
func cpgo_kv_wait_attached(h C.uint64_t, timeoutMs C.int64_t) (rc C.int) {
	defer recoverTo(&rc)
	ctx, cancel, err := ctxFor(timeoutMs)
	if err != nil {
		return fail(err)
	}
	defer cancel()
	k, err := kvGet(h)
	if err != nil {
		return fail(err)
	}
	if noWait(ctx) { // CUDAPOOL_NO_WAIT: attached now, or CUDAPOOL_ETIMEOUT
		var now context.CancelFunc
		ctx, now = context.WithTimeout(ctx, 0)
		defer now()
	}
	return result(k.r.WaitAttached(ctx))
}

//export cpgo_kv_lease_lost
func cpgo_kv_lease_lost(h C.uint64_t, lease C.uint64_t, buf *C.char, capacity C.size_t, n *C.size_t) (rc C.int) {
	defer recoverTo(&rc)
	if n == nil {
		return fail(invalid("len is NULL"))
	}
	k, err := kvGet(h)
	if err != nil {
		return fail(err)
	}
	l, err := k.held(uint64(lease))
	if err != nil {
		return fail(err)
	}
	why := ""
	if err := l.Lost(); err != nil {
		why = err.Error()
	}
	return result(writeOut(unsafe.Pointer(buf), capacity, n, []byte(why), true))
}
