// binding.h: the C half of binding_linux.go, included by its cgo preamble. It declares
// the few CUDA types the calls take and the trampolines that call the runtime through
// the function pointers dlsym found; Go calls only the cp_ functions.
#ifndef CUDAPOOL_CUDART_BINDING_H
#define CUDAPOOL_CUDART_BINDING_H

#include <dlfcn.h>
#include <limits.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <errno.h>
#include <unistd.h>

// No CUDA headers: the module builds where there is no toolkit. The few C types the
// calls take are declared here with the layouts CUDA documents, and checked by size.
// cudaError_t, CUresult and every CUDA enum are int-sized.
typedef int cp_err;
enum { cp_invalid_device = 101 }; // cudaErrorInvalidDevice, CUDA_ERROR_INVALID_DEVICE

typedef struct { int type; int id; } cp_location; // cudaMemLocation, CUmemLocation

typedef struct { // cudaMemPoolProps
	int allocType;
	int handleTypes;
	cp_location location;
	void *win32SecurityAttributes;
	size_t maxSize;
	unsigned short usage;
	unsigned char reserved[54];
} cp_pool_props;
_Static_assert(sizeof(cp_pool_props) == 88, "cudaMemPoolProps is 88 bytes");

typedef struct { cp_location location; int flags; } cp_access_desc; // cudaMemAccessDesc
_Static_assert(sizeof(cp_access_desc) == 12, "cudaMemAccessDesc is 12 bytes");

typedef struct { // CUmemAllocationProp
	int type;
	int requestedHandleTypes;
	cp_location location;
	void *win32HandleMetaData;
	struct {
		unsigned char compressionType;
		unsigned char gpuDirectRDMACapable;
		unsigned short usage;
		unsigned char reserved[4];
	} allocFlags;
} cp_alloc_prop;
_Static_assert(sizeof(cp_alloc_prop) == 32, "CUmemAllocationProp is 32 bytes");

typedef struct { unsigned x, y, z; } cp_dim3; // dim3

typedef struct { // cudaMemcpyAttributes
	int srcAccessOrder;
	cp_location srcLocHint, dstLocHint;
	unsigned flags;
} cp_memcpy_attrs;
_Static_assert(sizeof(cp_memcpy_attrs) == 24, "cudaMemcpyAttributes is 24 bytes");

// cudaMemPoolPtrExportData, cudaIpcEventHandle_t and cudaMemFabricHandle_t are each 64
// opaque bytes; CUuuid is 16.
typedef struct { unsigned char b[64]; } cp_blob64;
typedef struct { unsigned char b[16]; } cp_uuid;

// Each symbol: return type, name, parameters, and a newer versioned name to prefer
// where the library exports one (the driver API versions entry points with _v2).
#define CP_RUNTIME_SYMBOLS(X) \
	X(const char *, cudaGetErrorName, (cp_err), 0) \
	X(const char *, cudaGetErrorString, (cp_err), 0) \
	X(cp_err, cudaDriverGetVersion, (int *), 0) \
	X(cp_err, cudaRuntimeGetVersion, (int *), 0) \
	X(cp_err, cudaGetDeviceCount, (int *), 0) \
	X(cp_err, cudaGetDevice, (int *), 0) \
	X(cp_err, cudaSetDevice, (int), 0) \
	X(cp_err, cudaDeviceGetAttribute, (int *, int, int), 0) \
	X(cp_err, cudaDeviceGetPCIBusId, (char *, int, int), 0) \
	X(cp_err, cudaDeviceCanAccessPeer, (int *, int, int), 0) \
	X(cp_err, cudaMemGetInfo, (size_t *, size_t *), 0) \
	X(cp_err, cudaStreamCreateWithFlags, (void **, unsigned), 0) \
	X(cp_err, cudaStreamDestroy, (void *), 0) \
	X(cp_err, cudaStreamSynchronize, (void *), 0) \
	X(cp_err, cudaStreamQuery, (void *), 0) \
	X(cp_err, cudaStreamWaitEvent, (void *, void *, unsigned), 0) \
	X(cp_err, cudaLaunchHostFunc, (void *, void (*)(void *), void *), 0) \
	X(cp_err, cudaEventCreateWithFlags, (void **, unsigned), 0) \
	X(cp_err, cudaEventDestroy, (void *), 0) \
	X(cp_err, cudaEventRecord, (void *, void *), 0) \
	X(cp_err, cudaEventSynchronize, (void *), 0) \
	X(cp_err, cudaEventQuery, (void *), 0) \
	X(cp_err, cudaIpcGetEventHandle, (cp_blob64 *, void *), 0) \
	X(cp_err, cudaIpcOpenEventHandle, (void **, cp_blob64), 0) \
	X(cp_err, cudaMemPoolCreate, (void **, const cp_pool_props *), 0) \
	X(cp_err, cudaMemPoolDestroy, (void *), 0) \
	X(cp_err, cudaDeviceGetDefaultMemPool, (void **, int), 0) \
	X(cp_err, cudaMemPoolGetAttribute, (void *, int, void *), 0) \
	X(cp_err, cudaMemPoolSetAttribute, (void *, int, void *), 0) \
	X(cp_err, cudaMemPoolSetAccess, (void *, const cp_access_desc *, size_t), 0) \
	X(cp_err, cudaMemPoolGetAccess, (int *, void *, cp_location *), 0) \
	X(cp_err, cudaMemPoolTrimTo, (void *, size_t), 0) \
	X(cp_err, cudaMallocFromPoolAsync, (void **, size_t, void *, void *), 0) \
	X(cp_err, cudaFreeAsync, (void *, void *), 0) \
	X(cp_err, cudaMemPoolExportToShareableHandle, (void *, void *, int, unsigned), 0) \
	X(cp_err, cudaMemPoolImportFromShareableHandle, (void **, void *, int, unsigned), 0) \
	X(cp_err, cudaMemPoolExportPointer, (cp_blob64 *, void *), 0) \
	X(cp_err, cudaMemPoolImportPointer, (void **, void *, cp_blob64 *), 0) \
	X(cp_err, cudaMemcpyAsync, (void *, const void *, size_t, int, void *), 0) \
	X(cp_err, cudaMemsetAsync, (void *, int, size_t, void *), 0)

// Entry points newer runtimes have and older ones lack: a library without one still
// loads, and the call fails with cudaErrorNotSupported (801).
#define CP_RUNTIME_OPTIONAL_SYMBOLS(X) \
	X(cp_err, cudaStreamGetDevice, (void *, int *), 0) /* CUDA 12.8 */ \
	X(cp_err, cudaHostRegister, (void *, size_t, unsigned), 0) \
	X(cp_err, cudaHostUnregister, (void *), 0) \
	X(cp_err, cudaHostGetDevicePointer, (void **, void *, unsigned), 0) \
	X(cp_err, cudaMallocAsync, (void **, size_t, void *), 0) \
	X(cp_err, cudaLaunchKernel, (const void *, cp_dim3, cp_dim3, void **, size_t, void *), 0) \
	X(cp_err, cudaLibraryLoadData, (void **, const void *, void *, void **, unsigned, void *, void **, unsigned), 0) /* CUDA 12.0 */ \
	X(cp_err, cudaLibraryGetKernel, (void **, void *, const char *), 0) \
	X(cp_err, cudaMemcpyBatchAsync, (void *const *, const void *const *, const size_t *, size_t, cp_memcpy_attrs *, size_t *, size_t, void *), 0) /* CUDA 13.0's signature; 12.8's differs */

#define CP_DRIVER_SYMBOLS(X) \
	X(cp_err, cuGetErrorName, (cp_err, const char **), 0) \
	X(cp_err, cuGetErrorString, (cp_err, const char **), 0) \
	X(cp_err, cuInit, (unsigned), 0) \
	X(cp_err, cuDeviceGet, (int *, int), 0) \
	X(cp_err, cuDeviceGetUuid, (cp_uuid *, int), "cuDeviceGetUuid_v2") \
	X(cp_err, cuMemGetAllocationGranularity, (size_t *, const cp_alloc_prop *, int), 0)

// The driver's virtual memory management (VMM) calls and the context query they need:
// a driver without one still loads, and the call fails with CUDA_ERROR_NOT_SUPPORTED.
// CUdeviceptr and CUmemGenericAllocationHandle are 64-bit integers.
#define CP_DRIVER_OPTIONAL_SYMBOLS(X) \
	X(cp_err, cuCtxGetCurrent, (void **), 0) \
	X(cp_err, cuMemCreate, (uint64_t *, size_t, const cp_alloc_prop *, unsigned long long), 0) \
	X(cp_err, cuMemRelease, (uint64_t), 0) \
	X(cp_err, cuMemExportToShareableHandle, (void *, uint64_t, int, unsigned long long), 0) \
	X(cp_err, cuMemImportFromShareableHandle, (uint64_t *, void *, int), 0) \
	X(cp_err, cuMemAddressReserve, (uint64_t *, size_t, size_t, uint64_t, unsigned long long), 0) \
	X(cp_err, cuMemAddressFree, (uint64_t, size_t), 0) \
	X(cp_err, cuMemMap, (uint64_t, size_t, size_t, uint64_t, unsigned long long), 0) \
	X(cp_err, cuMemUnmap, (uint64_t, size_t), 0) \
	X(cp_err, cuMemSetAccess, (uint64_t, size_t, const cp_access_desc *, size_t), 0) \
	X(cp_err, cuStreamWriteValue32, (void *, uint64_t, unsigned, unsigned), "cuStreamWriteValue32_v2") \
	X(cp_err, cuStreamWaitValue32, (void *, uint64_t, unsigned, unsigned), "cuStreamWaitValue32_v2")

// cp_lib is the table of a loaded runtime and driver: every entry point, resolved once.
typedef struct {
#define CP_FIELD(ret, name, params, newer) ret(*name) params;
	CP_RUNTIME_SYMBOLS(CP_FIELD)
	CP_RUNTIME_OPTIONAL_SYMBOLS(CP_FIELD)
	CP_DRIVER_SYMBOLS(CP_FIELD)
	CP_DRIVER_OPTIONAL_SYMBOLS(CP_FIELD)
#undef CP_FIELD
} cp_lib;

// Go holds the table as its address, an integer, and every trampoline takes it so:
// cgo checks each pointer argument of every call for Go memory, and this one is C's.
#define CP_LIB(addr) ((const cp_lib *)(addr))

typedef struct { const char *name, *newer; size_t offset; } cp_symbol;
#define CP_ENTRY(ret, name, params, newer) {#name, newer, offsetof(cp_lib, name)},
static const cp_symbol cp_runtime_symbols[] = {CP_RUNTIME_SYMBOLS(CP_ENTRY){0}};
static const cp_symbol cp_runtime_optional_symbols[] = {CP_RUNTIME_OPTIONAL_SYMBOLS(CP_ENTRY){0}};
static const cp_symbol cp_driver_symbols[] = {CP_DRIVER_SYMBOLS(CP_ENTRY){0}};
static const cp_symbol cp_driver_optional_symbols[] = {CP_DRIVER_OPTIONAL_SYMBOLS(CP_ENTRY){0}};
#undef CP_ENTRY

// cp_open opens path and resolves its symbols (the driver's when driver is set) into
// lib. It returns the handle, or NULL with nothing left open and msg saying why: the
// loader's message, or every missing symbol. dlerror is per thread, so the open and
// the reading of its error happen here, in one call.
static void *cp_open(cp_lib *lib, const char *path, int driver, char *msg, size_t msglen) {
	const cp_symbol *syms = driver ? cp_driver_symbols : cp_runtime_symbols;
	msg[0] = 0;
	dlerror();
	void *h = dlopen(path, RTLD_NOW | RTLD_LOCAL);
	if (!h) {
		const char *e = dlerror();
		snprintf(msg, msglen, "%s", e ? e : "dlopen failed");
		return NULL;
	}
	size_t used = 0;
	for (const cp_symbol *s = syms; s->name; s++) {
		void *f = s->newer ? dlsym(h, s->newer) : NULL;
		if (!f) f = dlsym(h, s->name);
		if (f) {
			memcpy((char *)lib + s->offset, &f, sizeof f);
		} else if (used < msglen) {
			used += snprintf(msg + used, msglen - used, "%s%s", used ? ", " : "missing symbols: ", s->name);
		}
	}
	if (msg[0]) {
		dlclose(h);
		return NULL;
	}
	for (const cp_symbol *s = driver ? cp_driver_optional_symbols : cp_runtime_optional_symbols; s->name; s++) {
		void *f = s->newer ? dlsym(h, s->newer) : NULL;
		if (!f) f = dlsym(h, s->name); // NULL where the library predates it
		memcpy((char *)lib + s->offset, &f, sizeof f);
	}
	return h;
}

// Where a call failed, when not in the call the trampoline is named for.
enum { cp_at_call, cp_at_get_device, cp_at_set_device, cp_at_cu_init, cp_at_cu_device_get };

// Every trampoline returns its status, where it failed and its outputs by value, so
// that no Go memory is handed to C on the hot path and nothing is allocated.
typedef struct { cp_err err; int at; uint64_t v, w; } cp_res;
typedef struct { cp_err err; int at; int64_t v; cp_blob64 blob; } cp_blob_res;

// CP_DEVICE_ARG fails the trampoline when dev is no int, as no device has such an
// ordinal.
#define CP_DEVICE_ARG(r, dev) \
	if ((dev) < 0 || (dev) > INT_MAX) { (r).err = cp_invalid_device; return (r); }

// CP_ON_DEVICE makes dev the calling thread's current device, CUDA's current device
// being per thread. The trampoline then makes its call on this same thread: one cgo
// call per operation, with no LockOSThread.
#define CP_ON_DEVICE(r, lib, dev) \
	CP_DEVICE_ARG(r, dev) \
	{ \
		int cur_ = -1; \
		if (((r).err = (lib)->cudaGetDevice(&cur_)) != 0) { (r).at = cp_at_get_device; return (r); } \
		if (cur_ != (int)(dev) && ((r).err = (lib)->cudaSetDevice((int)(dev))) != 0) { (r).at = cp_at_set_device; return (r); } \
	}

// cp_thread_lib is the runtime in which the calling thread has a context current: set
// once a call through a trampoline succeeded on the thread, as each needs a context
// and either made its device current (cudaSetDevice makes the device's context) or
// had CUDA make one. Other code on the thread (torch's, in libcudapool) may make
// another device current after that, but never none, so the mark never goes stale.
// It is kept per runtime, not as a flag, because a process (a test) may load several.
static __thread const cp_lib *cp_thread_lib;

// cp_current_stream reports whether s is one of the streams that CUDA resolves
// through the current device: NULL (the legacy default), cudaStreamLegacy (0x1) and
// cudaStreamPerThread (0x2).
static inline int cp_current_stream(uintptr_t s) { return s <= 0x2; }

// CP_ON_STREAM_DEVICE is CP_ON_DEVICE for a call that CUDA runs on the device of its
// stream s whatever device is current: stream-ordered allocation ("cudaMallocAsync
// ignores the current device/context": the pool or the stream decides; seen on 2xH200,
// device 1's pool and stream with device 0 current). Once this thread has a context of
// this runtime, such a call on a created stream neither reads nor changes the current
// device: no cudaGetDevice, one C call. Without one, it sets dev as every call does,
// so that CUDA never makes the default device's context on a thread that works on
// another (it would take that device's memory); on a current-device stream too, as
// that stream is the current device's. Calls that take a device pointer keep the rule:
// the runtime checks the pointer against the current device (a copy into device 1's
// pool on device 1's stream, with device 0 current, failed with cudaErrorInvalidValue
// on 2xH200), and the free, record and wait are not shown safe on a GPU.
#define CP_ON_STREAM_DEVICE(r, lib, dev, s) \
	if (cp_thread_lib != (lib) || cp_current_stream(s)) { \
		CP_ON_DEVICE(r, lib, dev) \
	} else { \
		CP_DEVICE_ARG(r, dev) \
	}

#define CP_CU_INIT(r, lib) \
	if (((r).err = (lib)->cuInit(0)) != 0) { (r).at = cp_at_cu_init; return (r); }

static const char *cp_error_name(uintptr_t lib, cp_err e) { return CP_LIB(lib)->cudaGetErrorName(e); }
static const char *cp_error_string(uintptr_t lib, cp_err e) { return CP_LIB(lib)->cudaGetErrorString(e); }
static const char *cp_cu_error_name(uintptr_t lib, cp_err e) {
	const cp_lib *l = CP_LIB(lib);
	const char *s = 0;
	return l->cuGetErrorName(e, &s) == 0 ? s : 0;
}
static const char *cp_cu_error_string(uintptr_t lib, cp_err e) {
	const cp_lib *l = CP_LIB(lib);
	const char *s = 0;
	return l->cuGetErrorString(e, &s) == 0 ? s : 0;
}

// CP_INT_QUERY defines a query of the library as a whole (no device) that writes one
// int: its value travels in r.v.
#define CP_INT_QUERY(name, fn) \
	static cp_res name(uintptr_t lib) { \
		cp_res r = {0}; \
		int v = 0; \
		r.err = CP_LIB(lib)->fn(&v); \
		r.v = (uint64_t)v; \
		return r; \
	}

CP_INT_QUERY(cp_driver_version, cudaDriverGetVersion)
CP_INT_QUERY(cp_runtime_version, cudaRuntimeGetVersion)
CP_INT_QUERY(cp_device_count, cudaGetDeviceCount)

static cp_res cp_device_attribute(uintptr_t lib, long long dev, int attr) {
	const cp_lib *l = CP_LIB(lib);
	cp_res r = {0};
	CP_DEVICE_ARG(r, dev);
	int v = 0;
	r.err = l->cudaDeviceGetAttribute(&v, attr, (int)dev);
	r.v = (uint64_t)(int64_t)v;
	return r;
}

static cp_blob_res cp_device_uuid(uintptr_t lib, long long dev) {
	const cp_lib *l = CP_LIB(lib);
	cp_blob_res r = {0};
	CP_DEVICE_ARG(r, dev);
	CP_CU_INIT(r, l);
	int d = 0;
	if ((r.err = l->cuDeviceGet(&d, (int)dev)) != 0) {
		r.at = cp_at_cu_device_get;
		return r;
	}
	cp_uuid u = {{0}};
	r.err = l->cuDeviceGetUuid(&u, d);
	memcpy(r.blob.b, u.b, sizeof u.b);
	return r;
}

static cp_blob_res cp_device_pci_bus_id(uintptr_t lib, long long dev) {
	const cp_lib *l = CP_LIB(lib);
	cp_blob_res r = {0};
	CP_DEVICE_ARG(r, dev);
	r.err = l->cudaDeviceGetPCIBusId((char *)r.blob.b, (int)sizeof r.blob.b - 1, (int)dev);
	return r;
}

static cp_res cp_device_can_access_peer(uintptr_t lib, long long dev, long long peer) {
	const cp_lib *l = CP_LIB(lib);
	cp_res r = {0};
	CP_DEVICE_ARG(r, dev);
	CP_DEVICE_ARG(r, peer);
	int can = 0;
	r.err = l->cudaDeviceCanAccessPeer(&can, (int)dev, (int)peer);
	r.v = (uint64_t)can;
	return r;
}

static cp_res cp_mem_get_info(uintptr_t lib, long long dev) {
	const cp_lib *l = CP_LIB(lib);
	cp_res r = {0};
	CP_ON_DEVICE(r, l, dev);
	size_t free = 0, total = 0;
	r.err = l->cudaMemGetInfo(&free, &total);
	r.v = free;
	r.w = total;
	return r;
}

// cp_vmm_prop is the CUmemAllocationProp (of cuMemCreate and the granularity) of pinned memory on dev shareable as
// handle_type.
static cp_alloc_prop cp_vmm_prop(long long dev, int handle_type) {
	cp_alloc_prop p;
	memset(&p, 0, sizeof p);
	p.type = 1; // CU_MEM_ALLOCATION_TYPE_PINNED
	p.requestedHandleTypes = handle_type;
	p.location.type = 1; // CU_MEM_LOCATION_TYPE_DEVICE
	p.location.id = (int)dev;
	return p;
}

static cp_res cp_allocation_granularity(uintptr_t lib, long long dev, int handle_type, int recommended) {
	const cp_lib *l = CP_LIB(lib);
	cp_res r = {0};
	CP_DEVICE_ARG(r, dev);
	CP_CU_INIT(r, l);
	cp_alloc_prop p = cp_vmm_prop(dev, handle_type);
	size_t g = 0;
	r.err = l->cuMemGetAllocationGranularity(&g, &p, recommended ? 1 : 0);
	r.v = g;
	return r;
}

static cp_res cp_mem_pool_create(uintptr_t lib, int handle_types, int loc_type, int loc_id, unsigned long long max_size) {
	const cp_lib *l = CP_LIB(lib);
	cp_res r = {0};
	if (loc_type == 1) { // a device pool: create it with its device current
		CP_ON_DEVICE(r, l, loc_id);
	}
	cp_pool_props p;
	memset(&p, 0, sizeof p);
	p.allocType = 1; // cudaMemAllocationTypePinned
	p.handleTypes = handle_types;
	p.location.type = loc_type;
	p.location.id = (int)loc_id;
	p.maxSize = (size_t)max_size;
	void *pool = 0;
	r.err = l->cudaMemPoolCreate(&pool, &p);
	r.v = (uintptr_t)pool;
	return r;
}

static cp_res cp_device_default_mem_pool(uintptr_t lib, long long dev) {
	const cp_lib *l = CP_LIB(lib);
	cp_res r = {0};
	CP_DEVICE_ARG(r, dev);
	void *p = 0;
	r.err = l->cudaDeviceGetDefaultMemPool(&p, (int)dev);
	r.v = (uintptr_t)p;
	return r;
}

// The pool attributes 1-3 are C ints and 4-8 are uint64: the driver reads and writes
// exactly that many bytes.
static cp_res cp_mem_pool_get_attribute(uintptr_t lib, long long dev, uintptr_t p, int attr, int is_int) {
	const cp_lib *l = CP_LIB(lib);
	cp_res r = {0};
	CP_ON_DEVICE(r, l, dev);
	if (is_int) {
		int v = 0;
		r.err = l->cudaMemPoolGetAttribute((void *)p, attr, &v);
		r.v = (uint64_t)(unsigned)v;
	} else {
		uint64_t v = 0;
		r.err = l->cudaMemPoolGetAttribute((void *)p, attr, &v);
		r.v = v;
	}
	return r;
}

static cp_res cp_mem_pool_set_attribute(uintptr_t lib, long long dev, uintptr_t p, int attr, int is_int, uint64_t value) {
	const cp_lib *l = CP_LIB(lib);
	cp_res r = {0};
	CP_ON_DEVICE(r, l, dev);
	if (is_int) {
		int v = (int)value;
		r.err = l->cudaMemPoolSetAttribute((void *)p, attr, &v);
	} else {
		uint64_t v = value;
		r.err = l->cudaMemPoolSetAttribute((void *)p, attr, &v);
	}
	return r;
}

static cp_res cp_mem_pool_get_access(uintptr_t lib, long long dev, uintptr_t p, int loc_type, int loc_id) {
	const cp_lib *l = CP_LIB(lib);
	cp_res r = {0};
	CP_ON_DEVICE(r, l, dev);
	cp_location loc = {loc_type, loc_id};
	int flags = 0;
	r.err = l->cudaMemPoolGetAccess(&flags, (void *)p, &loc);
	r.v = (uint64_t)(unsigned)flags;
	return r;
}

// A POSIX fd handle is exported through an int* and imported as the fd's value cast
// to a pointer; a fabric handle travels as its 64 bytes both ways.
enum { cp_handle_posix_fd = 0x1, cp_handle_fabric = 0x8 };

static cp_blob_res cp_mem_pool_export(uintptr_t lib, long long dev, uintptr_t p, int handle_type) {
	const cp_lib *l = CP_LIB(lib);
	cp_blob_res r = {0};
	CP_ON_DEVICE(r, l, dev);
	if (handle_type == cp_handle_posix_fd) {
		int fd = -1;
		r.err = l->cudaMemPoolExportToShareableHandle(&fd, (void *)p, handle_type, 0);
		r.v = fd;
	} else {
		r.err = l->cudaMemPoolExportToShareableHandle(&r.blob, (void *)p, handle_type, 0);
		r.v = -1;
	}
	return r;
}

// CP_CALL defines trampoline name(params) returning type, which makes dev current and
// then makes call; a call that yields a handle or pointer writes it to out.
#define CP_CALL(type, name, params, call) \
	static type name params { \
		const cp_lib *l = CP_LIB(lib); \
		type r = {0}; \
		CP_ON_DEVICE(r, l, dev); \
		void *out = 0; \
		if ((r.err = call) == 0) cp_thread_lib = l; \
		r.v = (uintptr_t)out; \
		return r; \
	}

// CP_STREAM_CALL is CP_CALL for a call that runs on the device of its stream s (see
// CP_ON_STREAM_DEVICE): cudaMallocFromPoolAsync.
#define CP_STREAM_CALL(name, params, s, call) \
	static cp_res name params { \
		const cp_lib *l = CP_LIB(lib); \
		cp_res r = {0}; \
		CP_ON_STREAM_DEVICE(r, l, dev, s); \
		void *out = 0; \
		if ((r.err = call) == 0) cp_thread_lib = l; \
		r.v = (uintptr_t)out; \
		return r; \
	}
#define CP_PTR(x) ((void *)(x))

enum { cp_memcpy_host_to_device = 1, cp_memcpy_device_to_host = 2, cp_memcpy_default = 4 };

CP_CALL(cp_res, cp_stream_create, (uintptr_t lib, long long dev, unsigned flags), l->cudaStreamCreateWithFlags(&out, flags))
CP_CALL(cp_res, cp_stream_destroy, (uintptr_t lib, long long dev, uintptr_t s), l->cudaStreamDestroy(CP_PTR(s)))
CP_CALL(cp_res, cp_stream_synchronize, (uintptr_t lib, long long dev, uintptr_t s), l->cudaStreamSynchronize(CP_PTR(s)))
CP_CALL(cp_res, cp_stream_query, (uintptr_t lib, long long dev, uintptr_t s), l->cudaStreamQuery(CP_PTR(s)))
CP_CALL(cp_res, cp_stream_wait_event, (uintptr_t lib, long long dev, uintptr_t s, uintptr_t e), l->cudaStreamWaitEvent(CP_PTR(s), CP_PTR(e), 0))

// cp_notify is the host function StreamNotify queues: it adds 1 to the eventfd its
// argument names. A host function must make no CUDA call, and this one calls no Go
// either: it runs on the driver's own thread.
static void cp_notify(void *arg) {
	uint64_t one = 1;
	ssize_t n;
	do n = write((int)(intptr_t)arg, &one, sizeof one);
	while (n < 0 && errno == EINTR);
}

CP_CALL(cp_res, cp_stream_notify, (uintptr_t lib, long long dev, uintptr_t s, int fd),
	l->cudaLaunchHostFunc(CP_PTR(s), cp_notify, (void *)(intptr_t)fd))
enum { cp_not_supported = 801 }; // cudaErrorNotSupported

static cp_res cp_stream_get_device(uintptr_t lib, long long dev, uintptr_t s) {
	const cp_lib *l = CP_LIB(lib);
	cp_res r = {0};
	CP_ON_DEVICE(r, l, dev);
	if (!l->cudaStreamGetDevice) {
		r.err = cp_not_supported;
		return r;
	}
	int d = -1;
	r.err = l->cudaStreamGetDevice(CP_PTR(s), &d);
	r.v = (uint64_t)(int64_t)d;
	return r;
}

CP_CALL(cp_res, cp_event_create, (uintptr_t lib, long long dev, unsigned flags), l->cudaEventCreateWithFlags(&out, flags))
CP_CALL(cp_res, cp_event_destroy, (uintptr_t lib, long long dev, uintptr_t e), l->cudaEventDestroy(CP_PTR(e)))
CP_CALL(cp_res, cp_event_record, (uintptr_t lib, long long dev, uintptr_t e, uintptr_t s), l->cudaEventRecord(CP_PTR(e), CP_PTR(s)))
CP_CALL(cp_res, cp_event_synchronize, (uintptr_t lib, long long dev, uintptr_t e), l->cudaEventSynchronize(CP_PTR(e)))
CP_CALL(cp_res, cp_event_query, (uintptr_t lib, long long dev, uintptr_t e), l->cudaEventQuery(CP_PTR(e)))
CP_CALL(cp_blob_res, cp_ipc_get_event_handle, (uintptr_t lib, long long dev, uintptr_t e), l->cudaIpcGetEventHandle(&r.blob, CP_PTR(e)))
CP_CALL(cp_res, cp_ipc_open_event_handle, (uintptr_t lib, long long dev, cp_blob64 h), l->cudaIpcOpenEventHandle(&out, h))
CP_CALL(cp_res, cp_mem_pool_import, (uintptr_t lib, long long dev, int handle_type, int fd, cp_blob64 fabric),
	l->cudaMemPoolImportFromShareableHandle(&out, handle_type == cp_handle_posix_fd ? (void *)(intptr_t)fd : &fabric, handle_type, 0))
CP_CALL(cp_res, cp_mem_pool_destroy, (uintptr_t lib, long long dev, uintptr_t p), l->cudaMemPoolDestroy(CP_PTR(p)))
CP_CALL(cp_res, cp_mem_pool_set_access, (uintptr_t lib, long long dev, uintptr_t p, const cp_access_desc *d, size_t n), l->cudaMemPoolSetAccess(CP_PTR(p), d, n))
CP_CALL(cp_res, cp_mem_pool_trim_to, (uintptr_t lib, long long dev, uintptr_t p, uint64_t keep), l->cudaMemPoolTrimTo(CP_PTR(p), (size_t)keep))
CP_STREAM_CALL(cp_malloc_from_pool_async, (uintptr_t lib, long long dev, uint64_t size, uintptr_t p, uintptr_t s), s,
	l->cudaMallocFromPoolAsync(&out, (size_t)size, CP_PTR(p), CP_PTR(s)))
CP_CALL(cp_res, cp_free_async, (uintptr_t lib, long long dev, uintptr_t ptr, uintptr_t s), l->cudaFreeAsync(CP_PTR(ptr), CP_PTR(s)))
CP_CALL(cp_blob_res, cp_mem_pool_export_pointer, (uintptr_t lib, long long dev, uintptr_t ptr), l->cudaMemPoolExportPointer(&r.blob, CP_PTR(ptr)))
CP_CALL(cp_res, cp_mem_pool_import_pointer, (uintptr_t lib, long long dev, uintptr_t p, cp_blob64 data), l->cudaMemPoolImportPointer(&out, CP_PTR(p), &data))
CP_CALL(cp_res, cp_memcpy_from_host, (uintptr_t lib, long long dev, uintptr_t dst, const void *src, uint64_t n, uintptr_t s),
	l->cudaMemcpyAsync(CP_PTR(dst), src, (size_t)n, cp_memcpy_host_to_device, CP_PTR(s)))
CP_CALL(cp_res, cp_memcpy_to_host, (uintptr_t lib, long long dev, void *dst, uintptr_t src, uint64_t n, uintptr_t s),
	l->cudaMemcpyAsync(dst, CP_PTR(src), (size_t)n, cp_memcpy_device_to_host, CP_PTR(s)))
CP_CALL(cp_res, cp_memcpy_device, (uintptr_t lib, long long dev, uintptr_t dst, uintptr_t src, uint64_t n, uintptr_t s),
	l->cudaMemcpyAsync(CP_PTR(dst), CP_PTR(src), (size_t)n, cp_memcpy_default, CP_PTR(s)))
CP_CALL(cp_res, cp_memset, (uintptr_t lib, long long dev, uintptr_t dst, int value, uint64_t n, uintptr_t s),
	l->cudaMemsetAsync(CP_PTR(dst), value, (size_t)n, CP_PTR(s)))

// The host tier: registered host memory and batch copies (cudart.MemcpyBatchAsync).

// CP_OPTIONAL fails the trampoline with cudaErrorNotSupported where the runtime lacks
// the entry point fn.
#define CP_OPTIONAL(r, lib, fn) \
	if (!(lib)->fn) { (r).err = cp_not_supported; return (r); }

static cp_res cp_host_register(uintptr_t lib, long long dev, uintptr_t p, uint64_t n, unsigned flags) {
	const cp_lib *l = CP_LIB(lib);
	cp_res r = {0};
	CP_OPTIONAL(r, l, cudaHostRegister);
	CP_ON_DEVICE(r, l, dev);
	r.err = l->cudaHostRegister(CP_PTR(p), (size_t)n, flags);
	return r;
}

static cp_res cp_host_unregister(uintptr_t lib, long long dev, uintptr_t p) {
	const cp_lib *l = CP_LIB(lib);
	cp_res r = {0};
	CP_OPTIONAL(r, l, cudaHostUnregister);
	CP_ON_DEVICE(r, l, dev);
	r.err = l->cudaHostUnregister(CP_PTR(p));
	return r;
}

static cp_res cp_host_device_pointer(uintptr_t lib, long long dev, uintptr_t p) {
	const cp_lib *l = CP_LIB(lib);
	cp_res r = {0};
	CP_OPTIONAL(r, l, cudaHostGetDevicePointer);
	CP_ON_DEVICE(r, l, dev);
	void *out = 0;
	r.err = l->cudaHostGetDevicePointer(&out, CP_PTR(p), 0);
	r.v = (uintptr_t)out;
	return r;
}

// cp_piece is cudart.CopyPiece, and the batch copy kernel's struct (kernels/batchcopy.cu).
typedef struct { uint64_t dst, src, size; } cp_piece;

// cp_load_batch_kernel loads the PTX (NUL-terminated) and finds the batch copy kernel
// in it; r.v is the library, r.w the kernel. It needs dev current, as any call.
static cp_res cp_load_batch_kernel(uintptr_t lib, long long dev, const char *ptx) {
	const cp_lib *l = CP_LIB(lib);
	cp_res r = {0};
	CP_OPTIONAL(r, l, cudaLibraryLoadData);
	CP_OPTIONAL(r, l, cudaLibraryGetKernel);
	CP_OPTIONAL(r, l, cudaLaunchKernel);
	CP_OPTIONAL(r, l, cudaMallocAsync);
	CP_ON_DEVICE(r, l, dev);
	void *library = 0, *kernel = 0;
	if ((r.err = l->cudaLibraryLoadData(&library, ptx, 0, 0, 0, 0, 0, 0)) != 0) return r;
	r.err = l->cudaLibraryGetKernel(&kernel, library, "cudapool_batch_copy");
	r.v = (uintptr_t)library;
	r.w = (uintptr_t)kernel;
	return r;
}

// cp_batch_kernel copies n pieces with one launch of kernel on s: the pieces go to a
// stream-ordered device allocation (copied from pageable memory, which the runtime
// stages before it returns), the kernel reads them there, and the allocation is freed
// behind it on s. blocks is the grid.
static cp_res cp_batch_kernel(uintptr_t lib, long long dev, uintptr_t kernel, const cp_piece *pieces, uint64_t n, unsigned blocks, uintptr_t s) {
	const cp_lib *l = CP_LIB(lib);
	cp_res r = {0};
	CP_ON_DEVICE(r, l, dev);
	void *d = 0;
	size_t bytes = (size_t)n * sizeof *pieces;
	if ((r.err = l->cudaMallocAsync(&d, bytes, CP_PTR(s))) != 0) return r;
	if ((r.err = l->cudaMemcpyAsync(d, pieces, bytes, cp_memcpy_host_to_device, CP_PTR(s))) == 0) {
		unsigned long long count = n;
		void *args[] = {&d, &count};
		cp_dim3 grid = {blocks, 1, 1}, block = {256, 1, 1};
		r.err = l->cudaLaunchKernel(CP_PTR(kernel), grid, block, args, 0, CP_PTR(s));
	}
	cp_err f = l->cudaFreeAsync(d, CP_PTR(s));
	if (r.err == 0) r.err = f;
	return r;
}

// cp_batch_memcpy copies n pieces with cudaMemcpyBatchAsync, in calls of at most 4,096
// (FACTS 21: faster than one call of all of them), each ordered on s.
static cp_res cp_batch_memcpy(uintptr_t lib, long long dev, const cp_piece *pieces, uint64_t n, uintptr_t s) {
	const cp_lib *l = CP_LIB(lib);
	cp_res r = {0};
	CP_OPTIONAL(r, l, cudaMemcpyBatchAsync);
	CP_ON_DEVICE(r, l, dev);
	enum { chunk = 4096 };
	void **dsts = malloc(chunk * sizeof *dsts);
	const void **srcs = malloc(chunk * sizeof *srcs);
	size_t *sizes = malloc(chunk * sizeof *sizes);
	if (!dsts || !srcs || !sizes) {
		free(dsts), free(srcs), free(sizes);
		r.err = 2; // cudaErrorMemoryAllocation
		return r;
	}
	cp_memcpy_attrs attrs = {1 /* cudaMemcpySrcAccessOrderStream */, {0, 0}, {0, 0}, 0};
	size_t idx = 0;
	for (uint64_t at = 0; at < n; at += chunk) {
		size_t k = n - at < chunk ? (size_t)(n - at) : chunk;
		for (size_t i = 0; i < k; i++) {
			dsts[i] = CP_PTR(pieces[at + i].dst);
			srcs[i] = CP_PTR(pieces[at + i].src);
			sizes[i] = (size_t)pieces[at + i].size;
		}
		if ((r.err = l->cudaMemcpyBatchAsync(dsts, srcs, sizes, k, &attrs, &idx, 1, CP_PTR(s))) != 0) break;
	}
	free(dsts), free(srcs), free(sizes);
	return r;
}

// cp_batch_pieces copies n pieces with one cudaMemcpyAsync each.
static cp_res cp_batch_pieces(uintptr_t lib, long long dev, const cp_piece *pieces, uint64_t n, uintptr_t s) {
	const cp_lib *l = CP_LIB(lib);
	cp_res r = {0};
	CP_ON_DEVICE(r, l, dev);
	for (uint64_t i = 0; i < n; i++) {
		if ((r.err = l->cudaMemcpyAsync(CP_PTR(pieces[i].dst), CP_PTR(pieces[i].src), (size_t)pieces[i].size, cp_memcpy_default, CP_PTR(s))) != 0) return r;
	}
	return r;
}

// The VMM route (cudart.VMM): the driver's calls, each with dev's primary context
// current on the calling thread.

// CP_ON_CONTEXT is CP_ON_DEVICE for a driver call, which needs a current context
// where a runtime call makes its own: where CP_ON_DEVICE found dev current already
// but the thread has no context yet (a fresh thread reports device 0 without one),
// cudaSetDevice makes dev's primary context current, as it does from CUDA 12 on.
// The driver and the runtime then share that context: the runtime uses the primary
// one. cuInit, which the runtime has called, costs nothing more.
#define CP_ON_CONTEXT(r, lib, dev) \
	CP_OPTIONAL(r, lib, cuCtxGetCurrent) \
	CP_ON_DEVICE(r, lib, dev) \
	CP_CU_INIT(r, lib) \
	{ \
		void *ctx_ = 0; \
		if ((lib)->cuCtxGetCurrent(&ctx_) != 0 || !ctx_) { \
			if (((r).err = (lib)->cudaSetDevice((int)(dev))) != 0) { (r).at = cp_at_set_device; return (r); } \
		} \
	}

// CP_VMM_CALL defines trampoline name(params), which makes dev's context current and
// makes call, which may write a 64-bit result to out (r.v).
#define CP_VMM_CALL(name, params, fn, call) \
	static cp_res name params { \
		const cp_lib *l = CP_LIB(lib); \
		cp_res r = {0}; \
		CP_OPTIONAL(r, l, fn); \
		CP_ON_CONTEXT(r, l, dev); \
		uint64_t out = 0; \
		r.err = call; \
		r.v = out; \
		return r; \
	}

static cp_res cp_mem_create(uintptr_t lib, long long dev, uint64_t size, int handle_type) {
	const cp_lib *l = CP_LIB(lib);
	cp_res r = {0};
	CP_OPTIONAL(r, l, cuMemCreate);
	CP_ON_CONTEXT(r, l, dev);
	cp_alloc_prop p = cp_vmm_prop(dev, handle_type);
	uint64_t h = 0;
	r.err = l->cuMemCreate(&h, (size_t)size, &p, 0);
	r.v = h;
	return r;
}

CP_VMM_CALL(cp_mem_release, (uintptr_t lib, long long dev, uint64_t h), cuMemRelease, l->cuMemRelease(h))

static cp_blob_res cp_mem_export(uintptr_t lib, long long dev, uint64_t h, int handle_type) {
	const cp_lib *l = CP_LIB(lib);
	cp_blob_res r = {0};
	CP_OPTIONAL(r, l, cuMemExportToShareableHandle);
	CP_ON_CONTEXT(r, l, dev);
	if (handle_type == cp_handle_posix_fd) {
		int fd = -1;
		r.err = l->cuMemExportToShareableHandle(&fd, h, handle_type, 0);
		r.v = fd;
	} else {
		r.err = l->cuMemExportToShareableHandle(&r.blob, h, handle_type, 0);
		r.v = -1;
	}
	return r;
}

CP_VMM_CALL(cp_mem_import, (uintptr_t lib, long long dev, int handle_type, int fd, cp_blob64 fabric), cuMemImportFromShareableHandle,
	l->cuMemImportFromShareableHandle(&out, handle_type == cp_handle_posix_fd ? (void *)(intptr_t)fd : (void *)&fabric, handle_type))
CP_VMM_CALL(cp_mem_address_reserve, (uintptr_t lib, long long dev, uint64_t size, uint64_t alignment), cuMemAddressReserve,
	l->cuMemAddressReserve(&out, (size_t)size, (size_t)alignment, 0, 0))
CP_VMM_CALL(cp_mem_address_free, (uintptr_t lib, long long dev, uint64_t ptr, uint64_t size), cuMemAddressFree,
	l->cuMemAddressFree(ptr, (size_t)size))
CP_VMM_CALL(cp_mem_map, (uintptr_t lib, long long dev, uint64_t ptr, uint64_t size, uint64_t offset, uint64_t h), cuMemMap,
	l->cuMemMap(ptr, (size_t)size, (size_t)offset, h, 0))
CP_VMM_CALL(cp_mem_unmap, (uintptr_t lib, long long dev, uint64_t ptr, uint64_t size), cuMemUnmap,
	l->cuMemUnmap(ptr, (size_t)size))
CP_VMM_CALL(cp_mem_set_access, (uintptr_t lib, long long dev, uint64_t ptr, uint64_t size, const cp_access_desc *d, size_t n), cuMemSetAccess,
	l->cuMemSetAccess(ptr, (size_t)size, d, n))

// Stream memory operations (FACTS 27, 28): a 32-bit word written, or waited for, in
// stream order. The runtime's streams are the driver's.
CP_VMM_CALL(cp_stream_write_value32, (uintptr_t lib, long long dev, uint64_t ptr, unsigned v, uintptr_t s), cuStreamWriteValue32,
	l->cuStreamWriteValue32(CP_PTR(s), ptr, v, 0))
CP_VMM_CALL(cp_stream_wait_value32, (uintptr_t lib, long long dev, uint64_t ptr, unsigned v, unsigned cond, uintptr_t s), cuStreamWaitValue32,
	l->cuStreamWaitValue32(CP_PTR(s), ptr, v, cond))

// cp_current_device is the calling thread's current device, for tests of the rule
// above.
static cp_res cp_current_device(uintptr_t lib) {
	const cp_lib *l = CP_LIB(lib);
	cp_res r = {0};
	int d = -1;
	r.err = l->cudaGetDevice(&d);
	r.v = (uint64_t)(int64_t)d;
	return r;
}

#endif // CUDAPOOL_CUDART_BINDING_H
