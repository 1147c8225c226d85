//go:build cgo && linux

package cudart

/*
#cgo LDFLAGS: -ldl
#cgo noescape cp_memcpy_from_host
#cgo noescape cp_memcpy_to_host
#cgo noescape cp_mem_pool_set_access
#cgo noescape cp_open
#include <dlfcn.h>
#include <limits.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

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
	X(cp_err, cudaStreamWaitEvent, (void *, void *, unsigned), 0) \
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

#define CP_DRIVER_SYMBOLS(X) \
	X(cp_err, cuGetErrorName, (cp_err, const char **), 0) \
	X(cp_err, cuGetErrorString, (cp_err, const char **), 0) \
	X(cp_err, cuInit, (unsigned), 0) \
	X(cp_err, cuDeviceGet, (int *, int), 0) \
	X(cp_err, cuDeviceGetUuid, (cp_uuid *, int), "cuDeviceGetUuid_v2") \
	X(cp_err, cuMemGetAllocationGranularity, (size_t *, const cp_alloc_prop *, int), 0)

// cp_lib is the table of a loaded runtime and driver: every entry point, resolved once.
typedef struct {
#define CP_FIELD(ret, name, params, newer) ret(*name) params;
	CP_RUNTIME_SYMBOLS(CP_FIELD)
	CP_DRIVER_SYMBOLS(CP_FIELD)
#undef CP_FIELD
} cp_lib;

typedef struct { const char *name, *newer; size_t offset; } cp_symbol;
#define CP_ENTRY(ret, name, params, newer) {#name, newer, offsetof(cp_lib, name)},
static const cp_symbol cp_runtime_symbols[] = {CP_RUNTIME_SYMBOLS(CP_ENTRY){0}};
static const cp_symbol cp_driver_symbols[] = {CP_DRIVER_SYMBOLS(CP_ENTRY){0}};
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

#define CP_CU_INIT(r, lib) \
	if (((r).err = (lib)->cuInit(0)) != 0) { (r).at = cp_at_cu_init; return (r); }

static const char *cp_error_name(const cp_lib *l, cp_err e) { return l->cudaGetErrorName(e); }
static const char *cp_error_string(const cp_lib *l, cp_err e) { return l->cudaGetErrorString(e); }
static const char *cp_cu_error_name(const cp_lib *l, cp_err e) {
	const char *s = 0;
	return l->cuGetErrorName(e, &s) == 0 ? s : 0;
}
static const char *cp_cu_error_string(const cp_lib *l, cp_err e) {
	const char *s = 0;
	return l->cuGetErrorString(e, &s) == 0 ? s : 0;
}

static cp_res cp_driver_version(const cp_lib *l) {
	cp_res r = {0};
	int v = 0;
	r.err = l->cudaDriverGetVersion(&v);
	r.v = (uint64_t)v;
	return r;
}

static cp_res cp_runtime_version(const cp_lib *l) {
	cp_res r = {0};
	int v = 0;
	r.err = l->cudaRuntimeGetVersion(&v);
	r.v = (uint64_t)v;
	return r;
}

static cp_res cp_device_count(const cp_lib *l) {
	cp_res r = {0};
	int n = 0;
	r.err = l->cudaGetDeviceCount(&n);
	r.v = (uint64_t)n;
	return r;
}

static cp_res cp_device_attribute(const cp_lib *l, long long dev, int attr) {
	cp_res r = {0};
	CP_DEVICE_ARG(r, dev);
	int v = 0;
	r.err = l->cudaDeviceGetAttribute(&v, attr, (int)dev);
	r.v = (uint64_t)(int64_t)v;
	return r;
}

static cp_blob_res cp_device_uuid(const cp_lib *l, long long dev) {
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

static cp_blob_res cp_device_pci_bus_id(const cp_lib *l, long long dev) {
	cp_blob_res r = {0};
	CP_DEVICE_ARG(r, dev);
	r.err = l->cudaDeviceGetPCIBusId((char *)r.blob.b, (int)sizeof r.blob.b - 1, (int)dev);
	return r;
}

static cp_res cp_device_can_access_peer(const cp_lib *l, long long dev, long long peer) {
	cp_res r = {0};
	CP_DEVICE_ARG(r, dev);
	CP_DEVICE_ARG(r, peer);
	int can = 0;
	r.err = l->cudaDeviceCanAccessPeer(&can, (int)dev, (int)peer);
	r.v = (uint64_t)can;
	return r;
}

static cp_res cp_mem_get_info(const cp_lib *l, long long dev) {
	cp_res r = {0};
	CP_ON_DEVICE(r, l, dev);
	size_t free = 0, total = 0;
	r.err = l->cudaMemGetInfo(&free, &total);
	r.v = free;
	r.w = total;
	return r;
}

static cp_res cp_allocation_granularity(const cp_lib *l, long long dev, int handle_type, int recommended) {
	cp_res r = {0};
	CP_DEVICE_ARG(r, dev);
	CP_CU_INIT(r, l);
	cp_alloc_prop p;
	memset(&p, 0, sizeof p);
	p.type = 1; // CU_MEM_ALLOCATION_TYPE_PINNED
	p.requestedHandleTypes = handle_type;
	p.location.type = 1; // CU_MEM_LOCATION_TYPE_DEVICE
	p.location.id = (int)dev;
	size_t g = 0;
	r.err = l->cuMemGetAllocationGranularity(&g, &p, recommended ? 1 : 0);
	r.v = g;
	return r;
}

static cp_res cp_mem_pool_create(const cp_lib *l, int handle_types, int loc_type, int loc_id, unsigned long long max_size) {
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

static cp_res cp_device_default_mem_pool(const cp_lib *l, long long dev) {
	cp_res r = {0};
	CP_DEVICE_ARG(r, dev);
	void *p = 0;
	r.err = l->cudaDeviceGetDefaultMemPool(&p, (int)dev);
	r.v = (uintptr_t)p;
	return r;
}

// The pool attributes 1-3 are C ints and 4-8 are uint64: the driver reads and writes
// exactly that many bytes.
static cp_res cp_mem_pool_get_attribute(const cp_lib *l, long long dev, uintptr_t p, int attr, int is_int) {
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

static cp_res cp_mem_pool_set_attribute(const cp_lib *l, long long dev, uintptr_t p, int attr, int is_int, uint64_t value) {
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

static cp_res cp_mem_pool_get_access(const cp_lib *l, long long dev, uintptr_t p, int loc_type, int loc_id) {
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

static cp_blob_res cp_mem_pool_export(const cp_lib *l, long long dev, uintptr_t p, int handle_type) {
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
		type r = {0}; \
		CP_ON_DEVICE(r, l, dev); \
		void *out = 0; \
		r.err = call; \
		r.v = (uintptr_t)out; \
		return r; \
	}
#define CP_PTR(x) ((void *)(x))

enum { cp_memcpy_host_to_device = 1, cp_memcpy_device_to_host = 2, cp_memcpy_default = 4 };

CP_CALL(cp_res, cp_stream_create, (const cp_lib *l, long long dev, unsigned flags), l->cudaStreamCreateWithFlags(&out, flags))
CP_CALL(cp_res, cp_stream_destroy, (const cp_lib *l, long long dev, uintptr_t s), l->cudaStreamDestroy(CP_PTR(s)))
CP_CALL(cp_res, cp_stream_synchronize, (const cp_lib *l, long long dev, uintptr_t s), l->cudaStreamSynchronize(CP_PTR(s)))
CP_CALL(cp_res, cp_stream_wait_event, (const cp_lib *l, long long dev, uintptr_t s, uintptr_t e), l->cudaStreamWaitEvent(CP_PTR(s), CP_PTR(e), 0))
CP_CALL(cp_res, cp_event_create, (const cp_lib *l, long long dev, unsigned flags), l->cudaEventCreateWithFlags(&out, flags))
CP_CALL(cp_res, cp_event_destroy, (const cp_lib *l, long long dev, uintptr_t e), l->cudaEventDestroy(CP_PTR(e)))
CP_CALL(cp_res, cp_event_record, (const cp_lib *l, long long dev, uintptr_t e, uintptr_t s), l->cudaEventRecord(CP_PTR(e), CP_PTR(s)))
CP_CALL(cp_res, cp_event_synchronize, (const cp_lib *l, long long dev, uintptr_t e), l->cudaEventSynchronize(CP_PTR(e)))
CP_CALL(cp_res, cp_event_query, (const cp_lib *l, long long dev, uintptr_t e), l->cudaEventQuery(CP_PTR(e)))
CP_CALL(cp_blob_res, cp_ipc_get_event_handle, (const cp_lib *l, long long dev, uintptr_t e), l->cudaIpcGetEventHandle(&r.blob, CP_PTR(e)))
CP_CALL(cp_res, cp_ipc_open_event_handle, (const cp_lib *l, long long dev, cp_blob64 h), l->cudaIpcOpenEventHandle(&out, h))
CP_CALL(cp_res, cp_mem_pool_import, (const cp_lib *l, long long dev, int handle_type, int fd, cp_blob64 fabric),
	l->cudaMemPoolImportFromShareableHandle(&out, handle_type == cp_handle_posix_fd ? (void *)(intptr_t)fd : &fabric, handle_type, 0))
CP_CALL(cp_res, cp_mem_pool_destroy, (const cp_lib *l, long long dev, uintptr_t p), l->cudaMemPoolDestroy(CP_PTR(p)))
CP_CALL(cp_res, cp_mem_pool_set_access, (const cp_lib *l, long long dev, uintptr_t p, const cp_access_desc *d, size_t n), l->cudaMemPoolSetAccess(CP_PTR(p), d, n))
CP_CALL(cp_res, cp_mem_pool_trim_to, (const cp_lib *l, long long dev, uintptr_t p, uint64_t keep), l->cudaMemPoolTrimTo(CP_PTR(p), (size_t)keep))
CP_CALL(cp_res, cp_malloc_from_pool_async, (const cp_lib *l, long long dev, uint64_t size, uintptr_t p, uintptr_t s),
	l->cudaMallocFromPoolAsync(&out, (size_t)size, CP_PTR(p), CP_PTR(s)))
CP_CALL(cp_res, cp_free_async, (const cp_lib *l, long long dev, uintptr_t ptr, uintptr_t s), l->cudaFreeAsync(CP_PTR(ptr), CP_PTR(s)))
CP_CALL(cp_blob_res, cp_mem_pool_export_pointer, (const cp_lib *l, long long dev, uintptr_t ptr), l->cudaMemPoolExportPointer(&r.blob, CP_PTR(ptr)))
CP_CALL(cp_res, cp_mem_pool_import_pointer, (const cp_lib *l, long long dev, uintptr_t p, cp_blob64 data), l->cudaMemPoolImportPointer(&out, CP_PTR(p), &data))
CP_CALL(cp_res, cp_memcpy_from_host, (const cp_lib *l, long long dev, uintptr_t dst, const void *src, uint64_t n, uintptr_t s),
	l->cudaMemcpyAsync(CP_PTR(dst), src, (size_t)n, cp_memcpy_host_to_device, CP_PTR(s)))
CP_CALL(cp_res, cp_memcpy_to_host, (const cp_lib *l, long long dev, void *dst, uintptr_t src, uint64_t n, uintptr_t s),
	l->cudaMemcpyAsync(dst, CP_PTR(src), (size_t)n, cp_memcpy_device_to_host, CP_PTR(s)))
CP_CALL(cp_res, cp_memcpy_device, (const cp_lib *l, long long dev, uintptr_t dst, uintptr_t src, uint64_t n, uintptr_t s),
	l->cudaMemcpyAsync(CP_PTR(dst), CP_PTR(src), (size_t)n, cp_memcpy_default, CP_PTR(s)))
CP_CALL(cp_res, cp_memset, (const cp_lib *l, long long dev, uintptr_t dst, int value, uint64_t n, uintptr_t s),
	l->cudaMemsetAsync(CP_PTR(dst), value, (size_t)n, CP_PTR(s)))
*/
import "C"

import (
	"bytes"
	"fmt"
	"math"
	"strings"
	"sync/atomic"
	"unsafe"
)

// AccessDesc slices are handed to cudaMemPoolSetAccess as they lie in Go memory, so
// their layout must be cudaMemAccessDesc's.
const (
	_ = uint(unsafe.Sizeof(AccessDesc{}) - C.sizeof_cp_access_desc)
	_ = uint(C.sizeof_cp_access_desc - unsafe.Sizeof(AccessDesc{}))
	_ = uint(unsafe.Offsetof(AccessDesc{}.Flags) - 8)
	_ = uint(8 - unsafe.Offsetof(AccessDesc{}.Flags))
)

// library is a Runtime backed by a loaded libcudart and libcuda.
type library struct {
	c    *C.cp_lib
	name string
	// contained is set once a call returned ErrContained: the driver fails every call
	// after it (FACTS 14), and each such error says the context is lost.
	contained atomic.Bool
}

func load(c *loadConfig) (Runtime, error) {
	lib := (*C.cp_lib)(C.calloc(1, C.sizeof_cp_lib))
	var tried []string
	var runtimeHandle unsafe.Pointer
	var runtimePath string
	for _, path := range c.runtimeCandidates() {
		h, why := open(lib, path, false)
		if h != nil {
			runtimeHandle, runtimePath = h, path
			break
		}
		tried = append(tried, path+": "+why)
	}
	// The driver is tried even when no runtime opened, so that the error names
	// everything that is missing at once.
	driverPath := c.driverCandidate()
	driverHandle, why := open(lib, driverPath, true)
	if driverHandle == nil {
		tried = append(tried, driverPath+": "+why)
	}
	if runtimeHandle == nil || driverHandle == nil {
		for _, h := range []unsafe.Pointer{runtimeHandle, driverHandle} {
			if h != nil {
				C.dlclose(h)
			}
		}
		C.free(unsafe.Pointer(lib))
		return nil, &LoadError{Tried: tried}
	}
	l := &library{c: lib}
	l.name = fmt.Sprintf("%s (runtime %s, driver %s)", runtimePath, l.versionString(l.RuntimeVersion), l.versionString(l.DriverVersion))
	return l, nil
}

// open opens path into lib, returning its handle, or nil and why not.
func open(lib *C.cp_lib, path string, driver bool) (unsafe.Pointer, string) {
	cpath := C.CString(path)
	defer C.free(unsafe.Pointer(cpath))
	var msg [4096]byte
	isDriver := C.int(0)
	if driver {
		isDriver = 1
	}
	h := C.cp_open(lib, cpath, isDriver, (*C.char)(unsafe.Pointer(&msg[0])), C.size_t(len(msg)))
	if h == nil {
		return nil, cString(msg[:])
	}
	return h, ""
}

// cString is b up to its first NUL.
func cString(b []byte) string {
	if i := bytes.IndexByte(b, 0); i >= 0 {
		b = b[:i]
	}
	return string(b)
}

func (l *library) versionString(version func() (int, error)) string {
	v, err := version()
	if err != nil {
		return "unknown: " + err.Error()
	}
	return fmt.Sprint(v)
}

func (l *library) Name() string { return l.name }

// check turns a trampoline's status into nil or the error of op; it stays small so
// that the success path inlines.
func (l *library) check(op string, r C.cp_res) error {
	if r.err == 0 {
		return nil
	}
	return l.fail(op, r.err, r.at)
}

func (l *library) checkBlob(op string, r *C.cp_blob_res) error {
	if r.err == 0 {
		return nil
	}
	return l.fail(op, r.err, r.at)
}

// fail is the error of op having returned code at step at of its trampoline.
func (l *library) fail(op string, code C.cp_err, at C.int) error {
	switch at {
	case C.cp_at_get_device:
		op = "cudaGetDevice (for " + op + ")"
	case C.cp_at_set_device:
		op = "cudaSetDevice (for " + op + ")"
	case C.cp_at_cu_init:
		op = "cuInit (for " + op + ")"
	case C.cp_at_cu_device_get:
		op = "cuDeviceGet (for " + op + ")"
	}
	e := NewError(op, Code(code))
	if e.Code == ErrContained {
		l.contained.Store(true)
	}
	e.ContextLost = l.contained.Load()
	var name, text *C.char
	if strings.HasPrefix(op, "cuda") {
		name, text = C.cp_error_name(l.c, code), C.cp_error_string(l.c, code)
	} else {
		// Driver calls return a CUresult, which the driver names; its values agree with
		// cudaError_t's for every Code cudapool names.
		name, text = C.cp_cu_error_name(l.c, code), C.cp_cu_error_string(l.c, code)
	}
	if name != nil {
		e.Name = C.GoString(name)
	}
	if text != nil {
		e.Text = C.GoString(text)
	}
	return e
}

// invalidArgument is the error for an argument cudapool refuses before calling CUDA.
func invalidArgument(op, why string) error {
	e := NewError(op, ErrInvalidValue)
	e.Text = why
	return e
}

func (l *library) DriverVersion() (int, error) {
	r := C.cp_driver_version(l.c)
	if err := l.check("cudaDriverGetVersion", r); err != nil {
		return 0, err
	}
	return int(r.v), nil
}

func (l *library) RuntimeVersion() (int, error) {
	r := C.cp_runtime_version(l.c)
	if err := l.check("cudaRuntimeGetVersion", r); err != nil {
		return 0, err
	}
	return int(r.v), nil
}

func (l *library) DeviceCount() (int, error) {
	r := C.cp_device_count(l.c)
	if err := l.check("cudaGetDeviceCount", r); err != nil {
		return 0, err
	}
	return int(r.v), nil
}

func (l *library) DeviceAttribute(dev int, attr DeviceAttr) (int, error) {
	r := C.cp_device_attribute(l.c, C.longlong(dev), C.int(attr))
	if err := l.check("cudaDeviceGetAttribute", r); err != nil {
		return 0, err
	}
	return int(int64(r.v)), nil
}

func (l *library) DeviceUUID(dev int) (UUID, error) {
	r := C.cp_device_uuid(l.c, C.longlong(dev))
	if err := l.checkBlob("cuDeviceGetUuid", &r); err != nil {
		return UUID{}, err
	}
	b := bytes64(&r.blob)
	return UUID(b[:16]), nil
}

func (l *library) DevicePCIBusID(dev int) (string, error) {
	r := C.cp_device_pci_bus_id(l.c, C.longlong(dev))
	if err := l.checkBlob("cudaDeviceGetPCIBusId", &r); err != nil {
		return "", err
	}
	b := bytes64(&r.blob)
	return cString(b[:]), nil
}

func (l *library) DeviceCanAccessPeer(dev, peer int) (bool, error) {
	r := C.cp_device_can_access_peer(l.c, C.longlong(dev), C.longlong(peer))
	if err := l.check("cudaDeviceCanAccessPeer", r); err != nil {
		return false, err
	}
	return r.v != 0, nil
}

func (l *library) MemGetInfo(dev int) (free, total uint64, err error) {
	r := C.cp_mem_get_info(l.c, C.longlong(dev))
	if err := l.check("cudaMemGetInfo", r); err != nil {
		return 0, 0, err
	}
	return uint64(r.v), uint64(r.w), nil
}

func (l *library) AllocationGranularity(dev int, ht HandleType, recommended bool) (uint64, error) {
	rec := C.int(0)
	if recommended {
		rec = 1
	}
	r := C.cp_allocation_granularity(l.c, C.longlong(dev), C.int(ht), rec)
	if err := l.check("cuMemGetAllocationGranularity", r); err != nil {
		return 0, err
	}
	return uint64(r.v), nil
}

func (l *library) StreamCreate(dev int, flags StreamFlags) (Stream, error) {
	r := C.cp_stream_create(l.c, C.longlong(dev), C.uint(flags))
	if err := l.check("cudaStreamCreateWithFlags", r); err != nil {
		return 0, err
	}
	return Stream(r.v), nil
}

func (l *library) StreamDestroy(dev int, s Stream) error {
	return l.check("cudaStreamDestroy", C.cp_stream_destroy(l.c, C.longlong(dev), C.uintptr_t(s)))
}

func (l *library) StreamSynchronize(dev int, s Stream) error {
	return l.check("cudaStreamSynchronize", C.cp_stream_synchronize(l.c, C.longlong(dev), C.uintptr_t(s)))
}

func (l *library) StreamWaitEvent(dev int, s Stream, e Event) error {
	return l.check("cudaStreamWaitEvent", C.cp_stream_wait_event(l.c, C.longlong(dev), C.uintptr_t(s), C.uintptr_t(e)))
}

func (l *library) EventCreate(dev int, flags EventFlags) (Event, error) {
	r := C.cp_event_create(l.c, C.longlong(dev), C.uint(flags))
	if err := l.check("cudaEventCreateWithFlags", r); err != nil {
		return 0, err
	}
	return Event(r.v), nil
}

func (l *library) EventDestroy(dev int, e Event) error {
	return l.check("cudaEventDestroy", C.cp_event_destroy(l.c, C.longlong(dev), C.uintptr_t(e)))
}

func (l *library) EventRecord(dev int, e Event, s Stream) error {
	return l.check("cudaEventRecord", C.cp_event_record(l.c, C.longlong(dev), C.uintptr_t(e), C.uintptr_t(s)))
}

func (l *library) EventSynchronize(dev int, e Event) error {
	return l.check("cudaEventSynchronize", C.cp_event_synchronize(l.c, C.longlong(dev), C.uintptr_t(e)))
}

func (l *library) EventQuery(dev int, e Event) (bool, error) {
	r := C.cp_event_query(l.c, C.longlong(dev), C.uintptr_t(e))
	if Code(r.err) == ErrNotReady && r.at == C.cp_at_call {
		return false, nil
	}
	if err := l.check("cudaEventQuery", r); err != nil {
		return false, err
	}
	return true, nil
}

func (l *library) IpcGetEventHandle(dev int, e Event) (IpcEventHandle, error) {
	r := C.cp_ipc_get_event_handle(l.c, C.longlong(dev), C.uintptr_t(e))
	if err := l.checkBlob("cudaIpcGetEventHandle", &r); err != nil {
		return IpcEventHandle{}, err
	}
	return bytes64(&r.blob), nil
}

func (l *library) IpcOpenEventHandle(dev int, h IpcEventHandle) (Event, error) {
	r := C.cp_ipc_open_event_handle(l.c, C.longlong(dev), blob(h))
	if err := l.check("cudaIpcOpenEventHandle", r); err != nil {
		return 0, err
	}
	return Event(r.v), nil
}

// blob is 64 bytes as the C struct that carries them by value, so that no Go pointer
// reaches C and nothing escapes to the heap.
func blob(b [64]byte) C.cp_blob64 { return *(*C.cp_blob64)(unsafe.Pointer(&b)) }

// bytes64 is the 64 bytes of a C blob.
func bytes64(b *C.cp_blob64) [64]byte { return *(*[64]byte)(unsafe.Pointer(b)) }

func (l *library) MemPoolCreate(props PoolProps) (MemPool, error) {
	r := C.cp_mem_pool_create(l.c, C.int(props.HandleTypes), C.int(props.Location.Type), C.int(props.Location.ID), C.ulonglong(props.MaxSize))
	if err := l.check("cudaMemPoolCreate", r); err != nil {
		return 0, err
	}
	return MemPool(r.v), nil
}

func (l *library) MemPoolDestroy(dev int, p MemPool) error {
	return l.check("cudaMemPoolDestroy", C.cp_mem_pool_destroy(l.c, C.longlong(dev), C.uintptr_t(p)))
}

func (l *library) DeviceGetDefaultMemPool(dev int) (MemPool, error) {
	r := C.cp_device_default_mem_pool(l.c, C.longlong(dev))
	if err := l.check("cudaDeviceGetDefaultMemPool", r); err != nil {
		return 0, err
	}
	return MemPool(r.v), nil
}

// poolAttrArg checks attr and value before they reach C, where an unknown attribute
// would have no known size.
func poolAttrArg(op string, attr PoolAttr, value uint64) (isInt C.int, err error) {
	switch {
	case attr < PoolReuseFollowEventDependencies || attr > PoolUsedMemHigh:
		return 0, invalidArgument(op, fmt.Sprintf("unknown pool attribute %d", attr))
	case attr.IsBool() && value > math.MaxInt32:
		return 0, invalidArgument(op, fmt.Sprintf("pool attribute %d is an int; %d does not fit", attr, value))
	case attr.IsBool():
		return 1, nil
	}
	return 0, nil
}

func (l *library) MemPoolGetAttribute(dev int, p MemPool, attr PoolAttr) (uint64, error) {
	const op = "cudaMemPoolGetAttribute"
	isInt, err := poolAttrArg(op, attr, 0)
	if err != nil {
		return 0, err
	}
	r := C.cp_mem_pool_get_attribute(l.c, C.longlong(dev), C.uintptr_t(p), C.int(attr), isInt)
	if err := l.check(op, r); err != nil {
		return 0, err
	}
	return uint64(r.v), nil
}

func (l *library) MemPoolSetAttribute(dev int, p MemPool, attr PoolAttr, value uint64) error {
	const op = "cudaMemPoolSetAttribute"
	isInt, err := poolAttrArg(op, attr, value)
	if err != nil {
		return err
	}
	return l.check(op, C.cp_mem_pool_set_attribute(l.c, C.longlong(dev), C.uintptr_t(p), C.int(attr), isInt, C.uint64_t(value)))
}

func (l *library) MemPoolSetAccess(dev int, p MemPool, descs []AccessDesc) error {
	d := (*C.cp_access_desc)(unsafe.Pointer(unsafe.SliceData(descs)))
	return l.check("cudaMemPoolSetAccess", C.cp_mem_pool_set_access(l.c, C.longlong(dev), C.uintptr_t(p), d, C.size_t(len(descs))))
}

func (l *library) MemPoolGetAccess(dev int, p MemPool, loc Location) (AccessFlags, error) {
	r := C.cp_mem_pool_get_access(l.c, C.longlong(dev), C.uintptr_t(p), C.int(loc.Type), C.int(loc.ID))
	if err := l.check("cudaMemPoolGetAccess", r); err != nil {
		return 0, err
	}
	return AccessFlags(r.v), nil
}

func (l *library) MemPoolTrimTo(dev int, p MemPool, minBytesToKeep uint64) error {
	return l.check("cudaMemPoolTrimTo", C.cp_mem_pool_trim_to(l.c, C.longlong(dev), C.uintptr_t(p), C.uint64_t(minBytesToKeep)))
}

func (l *library) MallocFromPoolAsync(dev int, size uint64, p MemPool, s Stream) (DevicePtr, error) {
	r := C.cp_malloc_from_pool_async(l.c, C.longlong(dev), C.uint64_t(size), C.uintptr_t(p), C.uintptr_t(s))
	if err := l.check("cudaMallocFromPoolAsync", r); err != nil {
		return 0, err
	}
	return DevicePtr(r.v), nil
}

func (l *library) FreeAsync(dev int, ptr DevicePtr, s Stream) error {
	return l.check("cudaFreeAsync", C.cp_free_async(l.c, C.longlong(dev), C.uintptr_t(ptr), C.uintptr_t(s)))
}

func (l *library) MemPoolExportToShareableHandle(dev int, p MemPool, ht HandleType) (ShareableHandle, error) {
	const op = "cudaMemPoolExportToShareableHandle"
	if ht != HandleTypePosixFD && ht != HandleTypeFabric {
		return ShareableHandle{}, invalidArgument(op, "cannot export a pool as handle type "+ht.String())
	}
	r := C.cp_mem_pool_export(l.c, C.longlong(dev), C.uintptr_t(p), C.int(ht))
	if err := l.checkBlob(op, &r); err != nil {
		return ShareableHandle{}, err
	}
	h := ShareableHandle{Type: ht, FD: int(r.v)}
	if ht == HandleTypeFabric {
		h.Fabric = bytes64(&r.blob)
	}
	return h, nil
}

func (l *library) MemPoolImportFromShareableHandle(dev int, h ShareableHandle) (MemPool, error) {
	const op = "cudaMemPoolImportFromShareableHandle"
	switch {
	case h.Type != HandleTypePosixFD && h.Type != HandleTypeFabric:
		return 0, invalidArgument(op, "cannot import a pool from handle type "+h.Type.String())
	case h.Type == HandleTypePosixFD && (h.FD < 0 || h.FD > math.MaxInt32):
		return 0, invalidArgument(op, fmt.Sprintf("%d is not a file descriptor", h.FD))
	}
	r := C.cp_mem_pool_import(l.c, C.longlong(dev), C.int(h.Type), C.int(h.FD), blob(h.Fabric))
	if err := l.check(op, r); err != nil {
		return 0, err
	}
	return MemPool(r.v), nil
}

func (l *library) MemPoolExportPointer(dev int, ptr DevicePtr) (PtrExportData, error) {
	r := C.cp_mem_pool_export_pointer(l.c, C.longlong(dev), C.uintptr_t(ptr))
	if err := l.checkBlob("cudaMemPoolExportPointer", &r); err != nil {
		return PtrExportData{}, err
	}
	return bytes64(&r.blob), nil
}

func (l *library) MemPoolImportPointer(dev int, p MemPool, data PtrExportData) (DevicePtr, error) {
	r := C.cp_mem_pool_import_pointer(l.c, C.longlong(dev), C.uintptr_t(p), blob(data))
	if err := l.check("cudaMemPoolImportPointer", r); err != nil {
		return 0, err
	}
	return DevicePtr(r.v), nil
}

func (l *library) MemcpyHtoDAsync(dev int, dst DevicePtr, src []byte, s Stream) error {
	r := C.cp_memcpy_from_host(l.c, C.longlong(dev), C.uintptr_t(dst), unsafe.Pointer(unsafe.SliceData(src)), C.uint64_t(len(src)), C.uintptr_t(s))
	return l.check("cudaMemcpyAsync", r)
}

func (l *library) MemcpyDtoHAsync(dev int, dst []byte, src DevicePtr, s Stream) error {
	r := C.cp_memcpy_to_host(l.c, C.longlong(dev), unsafe.Pointer(unsafe.SliceData(dst)), C.uintptr_t(src), C.uint64_t(len(dst)), C.uintptr_t(s))
	return l.check("cudaMemcpyAsync", r)
}

func (l *library) MemcpyDtoDAsync(dev int, dst, src DevicePtr, n uint64, s Stream) error {
	r := C.cp_memcpy_device(l.c, C.longlong(dev), C.uintptr_t(dst), C.uintptr_t(src), C.uint64_t(n), C.uintptr_t(s))
	return l.check("cudaMemcpyAsync", r)
}

func (l *library) MemsetAsync(dev int, dst DevicePtr, value byte, n uint64, s Stream) error {
	r := C.cp_memset(l.c, C.longlong(dev), C.uintptr_t(dst), C.int(value), C.uint64_t(n), C.uintptr_t(s))
	return l.check("cudaMemsetAsync", r)
}
