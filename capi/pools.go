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
	"unsafe"

	"github.com/cudapool/cudapool/cudart"
	"github.com/cudapool/cudapool/pool"
)

var pools = newTable[*pool.Pool](kindPool)

// poolOptions turns cudapool_pool_options into pool.New's options.
func poolOptions(o *C.cudapool_pool_options) ([]pool.Option, error) {
	if o == nil {
		return nil, nil
	}
	if err := options(unsafe.Pointer(o), C.sizeof_cudapool_pool_options, "pool options"); err != nil {
		return nil, err
	}
	var opts []pool.Option
	if o.name != nil {
		opts = append(opts, pool.WithName(C.GoString(o.name)))
	}
	switch ht := cudart.HandleType(o.handle_type); ht {
	case cudart.HandleTypeNone, cudart.HandleTypePosixFD, cudart.HandleTypeFabric:
		opts = append(opts, pool.WithHandleType(ht))
	default:
		return nil, invalid("handle_type %d: want CUDAPOOL_HANDLE_NONE (0), _POSIX_FD (1) or _FABRIC (8)", int(o.handle_type))
	}
	if o.max_size != 0 {
		opts = append(opts, pool.WithMaxSize(uint64(o.max_size)))
	}
	if o.has_release_threshold != 0 {
		opts = append(opts, pool.WithReleaseThreshold(uint64(o.release_threshold)))
	}
	if o.wait_for_memory != 0 {
		opts = append(opts, pool.WaitForMemory())
	}
	if o.cache_bytes != 0 {
		opts = append(opts, pool.WithCache(uint64(o.cache_bytes)))
	}
	switch n := int(o.peer_count); {
	case n < 0:
		return nil, invalid("peer_count %d is negative", n)
	case n > maxPeers:
		return nil, invalid("peer_count %d is over the %d devices a pool may name", n, maxPeers)
	case n > 0 && o.peer_devices == nil:
		return nil, invalid("peer_devices is NULL with peer_count %d", n)
	case n > 0:
		peers := make([]int, n)
		for i, d := range unsafe.Slice(o.peer_devices, n) {
			peers[i] = int(d)
		}
		opts = append(opts, pool.WithPeerAccess(peers...))
	}
	return opts, nil
}

// maxPeers bounds peer_count: more devices than any host has, so that a count no
// array holds is refused before the array is read.
const maxPeers = 1 << 10

//export cpgo_pool_create
func cpgo_pool_create(device C.int, o *C.cudapool_pool_options, out *C.uint64_t) (rc C.int) {
	defer recoverTo(&rc)
	if out == nil {
		return fail(invalid("pool is NULL"))
	}
	opts, err := poolOptions(o)
	if err != nil {
		return fail(err)
	}
	rt, err := runtimeNow()
	if err != nil {
		return fail(err)
	}
	p, err := pool.New(rt, int(device), opts...)
	if err != nil {
		return fail(err)
	}
	*out = C.uint64_t(pools.add(p))
	return statusOK
}

//export cpgo_pool_stats
func cpgo_pool_stats(h C.uint64_t, out *C.cudapool_pool_stats) (rc C.int) {
	defer recoverTo(&rc)
	if out == nil {
		return fail(invalid("stats is NULL"))
	}
	p, err := pools.get(uint64(h))
	if err != nil {
		return fail(err)
	}
	s, err := p.Stats()
	*out = C.cudapool_pool_stats{
		device: C.int(s.Device), handle_type: C.int(s.HandleType),
		max_size: C.uint64_t(s.MaxSize), granularity: C.uint64_t(s.Granularity),
		reserved_current: C.uint64_t(s.ReservedCurrent), reserved_high: C.uint64_t(s.ReservedHigh),
		used_current: C.uint64_t(s.UsedCurrent), used_high: C.uint64_t(s.UsedHigh),
		live_buffers: C.uint64_t(s.LiveBuffers), bytes_requested: C.uint64_t(s.BytesRequested),
		bytes_reserved: C.uint64_t(s.BytesReserved), shared_buffers: C.uint64_t(s.SharedBuffers),
		active_leases: C.uint64_t(s.ActiveLeases), deferred_frees: C.uint64_t(s.DeferredFrees),
		failed_frees: C.uint64_t(s.FailedFrees), cached_buffers: C.uint64_t(s.CachedBuffers),
		cached_bytes: C.uint64_t(s.CachedBytes),
	}
	return result(err)
}

//export cpgo_pool_close
func cpgo_pool_close(h C.uint64_t, force C.int, timeoutMs C.int64_t) (rc C.int) {
	defer recoverTo(&rc)
	ctx, cancel, err := ctxFor(timeoutMs)
	if err != nil {
		return fail(err)
	}
	defer cancel()
	p, err := pools.get(uint64(h))
	if err != nil {
		return fail(err)
	}
	if isTorchPool(p) {
		return fail(fmt.Errorf("%w: pool %q serves the PyTorch allocator, which frees into it until the process exits", errInvalid, p.Name()))
	}
	var opts []pool.CloseOption
	if force != 0 {
		opts = append(opts, pool.Force())
	}
	_, err = p.Close(ctx, opts...)
	if errors.Is(err, pool.ErrBusy) || errors.Is(err, context.DeadlineExceeded) {
		return fail(err) // nothing changed, or Close may be called again to finish
	}
	_, _ = pools.remove(uint64(h)) // a concurrent close may have removed it
	buffers.forgetPool(p)
	return result(err)
}

//export cpgo_alloc
func cpgo_alloc(h C.uint64_t, size C.uint64_t, s C.uintptr_t, timeoutMs C.int64_t, out *C.uintptr_t) (rc C.int) {
	defer recoverTo(&rc)
	if out == nil {
		return fail(invalid("ptr is NULL"))
	}
	ctx, cancel, err := ctxFor(timeoutMs)
	if err != nil {
		return fail(err)
	}
	defer cancel()
	p, err := pools.get(uint64(h))
	if err != nil {
		return fail(err)
	}
	if err := checkAlloc(p, uint64(size)); err != nil {
		return fail(err)
	}
	b, err := p.Alloc(ctx, uint64(size), cudart.Stream(s))
	if err != nil {
		return fail(err)
	}
	buffers.put(b)
	*out = C.uintptr_t(b.Ptr())
	return statusOK
}

// checkAlloc refuses, before the pool sees it, a size that cannot be rounded to p's
// granularity, and one larger than p's bound, which would wait for a free for good on a
// pool with wait_for_memory.
func checkAlloc(p *pool.Pool, size uint64) error {
	g := p.Granularity()
	if g > 1 && size > math.MaxUint64-(g-1) {
		return invalid("size %d cannot be rounded up to the pool's granularity (%d bytes)", size, g)
	}
	rounded := size
	if g > 1 {
		rounded = (size + g - 1) / g * g
	}
	if m := p.MaxSize(); m != 0 && rounded > m {
		return fmt.Errorf("pool %q: %w: %d bytes (%d rounded) can never fit its max_size of %d", p.Name(), cudart.ErrOutOfMemory, size, rounded, m)
	}
	return nil
}

//export cpgo_free
func cpgo_free(ptr C.uintptr_t, s C.uintptr_t) (rc C.int) {
	defer recoverTo(&rc)
	return result(free(uintptr(ptr), cudart.Stream(s)))
}

// free frees the buffer that starts at ptr after the work queued on s.
func free(ptr uintptr, s cudart.Stream) error {
	if ptr == 0 {
		return invalid("ptr is NULL")
	}
	b, ok := buffers.take(ptr)
	if !ok {
		return fmt.Errorf("%w: %#x (never allocated by cudapool, freed already, or inside a buffer rather than at its start)", errPointer, ptr)
	}
	if err := b.Free(s); err != nil {
		if !errors.Is(err, pool.ErrFreed) && !errors.Is(err, pool.ErrClosed) {
			buffers.putBack(b)
		}
		return err
	}
	return nil
}
