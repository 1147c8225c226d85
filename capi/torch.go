package main

/*
#include "cp.h"
*/
import "C"

import (
	"context"
	"fmt"
	"os"
	"strconv"
	"sync"
	"sync/atomic"

	"github.com/cudapool/cudapool/cudart"
	"github.com/cudapool/cudapool/pool"
)

// The PyTorch allocator: torch.cuda.memory.CUDAPluggableAllocator calls
// cudapool_torch_malloc and cudapool_torch_free for every allocation (with
// change_current_allocator) or for every segment of a torch.cuda.MemPool. Each device
// gets one pool, made at its first allocation. The hot path is an atomic load of the
// device's pool, pool.Alloc or Free, and one shard of the buffer table.

// Environment variables that configure the pools when cudapool_torch_configure was
// not called.
const (
	TorchMaxSizeEnv    = "CUDAPOOL_TORCH_MAX_SIZE"
	TorchHandleTypeEnv = "CUDAPOOL_TORCH_HANDLE_TYPE"
	TorchCacheEnv      = "CUDAPOOL_TORCH_CACHE"
)

// maxTorchDevices bounds the device ordinals the allocator serves.
const maxTorchDevices = 64

var torch struct {
	pools [maxTorchDevices]atomic.Pointer[pool.Pool]
	mu    sync.Mutex // serialises making pools and configuring
	opts  []pool.Option
	set   bool // opts came from cudapool_torch_configure
	made  map[*pool.Pool]uint64
}

func isTorchPool(p *pool.Pool) bool {
	torch.mu.Lock()
	defer torch.mu.Unlock()
	_, ok := torch.made[p]
	return ok
}

// torchPool returns device's pool, making it the first time.
func torchPool(device int) (*pool.Pool, error) {
	if device < 0 || device >= maxTorchDevices {
		return nil, invalid("device %d (the allocator serves devices 0 to %d)", device, maxTorchDevices-1)
	}
	if p := torch.pools[device].Load(); p != nil {
		return p, nil
	}
	torch.mu.Lock()
	defer torch.mu.Unlock()
	if p := torch.pools[device].Load(); p != nil {
		return p, nil
	}
	opts := torch.opts
	if !torch.set {
		syncEnv()
		var err error
		if opts, err = torchEnvOptions(); err != nil {
			return nil, err
		}
	}
	rt, err := runtimeNow()
	if err != nil {
		return nil, err
	}
	opts = append([]pool.Option{pool.WithName(fmt.Sprintf("torch-%d", device))}, opts...)
	p, err := pool.New(rt, device, opts...)
	if err != nil {
		return nil, err
	}
	if torch.made == nil {
		torch.made = make(map[*pool.Pool]uint64)
	}
	torch.made[p] = pools.add(p)
	torch.pools[device].Store(p)
	return p, nil
}

func torchEnvOptions() ([]pool.Option, error) {
	var opts []pool.Option
	for _, e := range []struct {
		name   string
		option func(uint64) pool.Option
	}{{TorchMaxSizeEnv, pool.WithMaxSize}, {TorchCacheEnv, pool.WithCache}} {
		v := os.Getenv(e.name)
		if v == "" {
			continue
		}
		n, err := strconv.ParseUint(v, 10, 64)
		if err != nil {
			return nil, invalid("$%s=%q is not a byte count", e.name, v)
		}
		opts = append(opts, e.option(n))
	}
	switch v := os.Getenv(TorchHandleTypeEnv); v {
	case "", "posix-fd":
	case "none":
		opts = append(opts, pool.WithHandleType(cudart.HandleTypeNone))
	case "fabric":
		opts = append(opts, pool.WithHandleType(cudart.HandleTypeFabric))
	default:
		return nil, invalid("$%s=%q: want posix-fd, none or fabric", TorchHandleTypeEnv, v)
	}
	return opts, nil
}

//export cpgo_torch_malloc
func cpgo_torch_malloc(size C.ssize_t, device C.int, s C.uintptr_t) (ptr C.uintptr_t) {
	defer recoverToNull(&ptr)
	if size <= 0 {
		// PyTorch asks for no memory for an empty tensor: NULL, as from cudaMalloc.
		if size < 0 {
			fail(invalid("size %d is negative", int64(size)))
		}
		return 0
	}
	p, err := torchPool(int(device))
	if err != nil {
		fail(err)
		return 0
	}
	if err := checkAlloc(p, uint64(size)); err != nil {
		fail(err)
		return 0
	}
	b, err := p.Alloc(context.Background(), uint64(size), cudart.Stream(s))
	if err != nil {
		fail(err)
		return 0
	}
	buffers.put(b)
	return C.uintptr_t(b.Ptr())
}

//export cpgo_torch_free
func cpgo_torch_free(ptr C.uintptr_t, size C.ssize_t, device C.int, s C.uintptr_t) {
	defer recoverToNull(nil)
	if ptr == 0 {
		return // the empty tensor's NULL
	}
	if err := free(uintptr(ptr), cudart.Stream(s)); err != nil {
		fail(err)
	}
}

//export cpgo_torch_configure
func cpgo_torch_configure(o *C.cudapool_pool_options) (rc C.int) {
	defer recoverTo(&rc)
	if o == nil {
		return fail(invalid("options is NULL"))
	}
	opts, err := poolOptions(o)
	if err != nil {
		return fail(err)
	}
	if o.wait_for_memory != 0 {
		return fail(invalid("wait_for_memory: the PyTorch allocator cannot wait (its malloc takes no timeout), and torch frees its cache and retries on a failed one"))
	}
	torch.mu.Lock()
	defer torch.mu.Unlock()
	torch.opts, torch.set = opts, true
	return statusOK
}

//export cpgo_torch_pool
func cpgo_torch_pool(device C.int, out *C.uint64_t) (rc C.int) {
	defer recoverTo(&rc)
	if out == nil {
		return fail(invalid("pool is NULL"))
	}
	p, err := torchPool(int(device))
	if err != nil {
		return fail(err)
	}
	torch.mu.Lock()
	*out = C.uint64_t(torch.made[p])
	torch.mu.Unlock()
	return statusOK
}
