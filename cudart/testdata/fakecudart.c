// A fake libcudart for cudart's CPU tests: every function cudapool resolves, with
// small deterministic behaviour that lets a test see each argument arrive in its
// place. It reads its C structs by byte offset, not through declarations of its own,
// so that it checks the binding's layouts against CUDA's documented ones.
//
// Its rules, stricter than CUDA's where that exposes a binding bug:
//   - four devices; the current device is per thread, as in CUDA; device 3 is
//     poisoned (fake.h);
//   - a stream, event or pool must be used with its own device current, else
//     cudaErrorInvalidResourceHandle (400): a binding that set the device on one
//     thread and called on another fails here. cudaMallocFromPoolAsync, which CUDA
//     runs on its stream's device whatever device is current, follows CUDA's rule
//     instead, so that a binding may leave the current device alone for it;
//   - a thread has no context until cudaSetDevice, or until a call that needs one
//     makes the current device's (0 unless set) current, as CUDA does: the fake
//     counts those, so that a test sees a call that would have made the default
//     device's context on a thread working on another;
//   - device memory is host memory, so copies and sets really move bytes;
//   - a memset to the value CONTAIN (226) stands for a read of a dead peer's memory
//     over NVLink: it fails with cudaErrorContained, and from then on every call fails,
//     with 226 on that device and 46 (cudaErrorDevicesUnavailable) on the others, as
//     measured (FACTS 14).
// Compile with -DOMIT_<name> to leave out cudaFreeAsync, cudaMemPoolExportPointer or
// cudaStreamGetDevice.
#define _GNU_SOURCE
#include <stdint.h>
#include <sys/mman.h>
#include <unistd.h>

#include "fake.h"

enum {
	SUCCESS = 0,
	INVALID_VALUE = 1,
	OUT_OF_MEMORY = 2,
	INVALID_DEVICE = 101,
	INVALID_HANDLE = 400,
	NOT_READY = 600,
	DEVICES_UNAVAILABLE = 46,
	CONTAINED = 226,
};
enum { CONTAIN = 226 };

// contained is the device whose context a CONTAIN memset lost, -1 while none has.
static int contained = -1;
#define STICKY(d) \
	if (contained >= 0) return (d) == contained ? CONTAINED : DEVICES_UNAVAILABLE
enum { STREAM_MAGIC = 0x57AEA111, EVENT_MAGIC = 0xE7E27222, POOL_MAGIC = 0x9001F333 };

static __thread int cur;
static __thread int has_context;
// lazy[d] counts the contexts of device d made current by a call on a thread that
// had none; get_device_calls counts cudaGetDevice calls. cudaDeviceGetAttribute reads
// both (FAKE_ATTR_*, fake.h).
static unsigned long lazy[NDEV];
static unsigned long get_device_calls;
static pthread_mutex_t mu = PTHREAD_MUTEX_INITIALIZER;
static void unlock(int *unused) {
	(void)unused;
	pthread_mutex_unlock(&mu);
}
// LOCK holds the fake's one lock until the function returns.
#define LOCK() \
	pthread_mutex_lock(&mu); \
	__attribute__((cleanup(unlock))) int lock_guard_ = 0; \
	(void)lock_guard_

// NEED_CONTEXT makes the current device's context current on a thread that has
// none, as CUDA's runtime does on the first call that needs one. Call it locked.
#define NEED_CONTEXT() \
	if (!has_context) { \
		has_context = 1; \
		lazy[cur]++; \
	}

#define ON_CURRENT() \
	LOCK(); \
	NEED_CONTEXT(); \
	if (cur == POISONED) return poison(__func__); \
	STICKY(cur)

#define CHECK_DEVICE(d) \
	if ((d) < 0 || (d) >= NDEV) return INVALID_DEVICE; \
	if ((d) == POISONED) return poison(__func__); \
	STICKY(d)

typedef struct {
	unsigned magic;
	int dev;
	unsigned flags;
	unsigned long syncs;
} stream_t;

typedef struct {
	unsigned magic;
	int dev;
	unsigned flags;
	stream_t *recorded_on;
	unsigned long syncs_at_record;
	int synchronized;
} event_t;

typedef struct pool {
	unsigned magic;
	int dev;
	int handle_types;
	int exported;
	unsigned long long max_size;
	int attr_int[4];
	unsigned long long attr_u64[9];
	int access[NDEV];
	struct pool *origin; // the exported pool this one imports, or NULL
} pool_t;

typedef struct alloc {
	struct alloc *next;
	unsigned char *p;
	size_t size;
	pool_t *pool;
	int imports;
} alloc_t;

static stream_t legacy[NDEV];
static pool_t defaults[NDEV];
static alloc_t *allocs;

static const char *const error_name_prefix = "fakeErrorName";
static const char *const error_text_prefix = "fake error text ";

const char *cudaGetErrorName(int e) { return intern(error_name_prefix, e); }
const char *cudaGetErrorString(int e) { return intern(error_text_prefix, e); }

int cudaDriverGetVersion(int *v) {
	*v = 13010;
	return SUCCESS;
}

int cudaRuntimeGetVersion(int *v) {
	*v = 13000;
	return SUCCESS;
}

int cudaGetDeviceCount(int *n) {
	*n = NDEV;
	return SUCCESS;
}

int cudaGetDevice(int *d) {
	__atomic_fetch_add(&get_device_calls, 1, __ATOMIC_RELAXED);
	*d = cur;
	return SUCCESS;
}

// cudaSetDevice makes the device's context current, as CUDA 12 and later do.
int cudaSetDevice(int d) {
	if (d < 0 || d >= NDEV) return INVALID_DEVICE;
	cur = d;
	has_context = 1;
	return SUCCESS;
}

int cudaDeviceGetAttribute(int *v, int attr, int dev) {
	LOCK();
	CHECK_DEVICE(dev);
	switch (attr) {
	case FAKE_ATTR_LAZY_CONTEXTS:
		*v = (int)lazy[dev];
		break;
	case FAKE_ATTR_GET_DEVICE_CALLS:
		*v = (int)__atomic_load_n(&get_device_calls, __ATOMIC_RELAXED);
		break;
	default:
		*v = dev * 1000 + attr;
	}
	return SUCCESS;
}

int cudaDeviceGetPCIBusId(char *buf, int len, int dev) {
	CHECK_DEVICE(dev);
	if (len < 13) return INVALID_VALUE;
	snprintf(buf, (size_t)len, "0000:%02x:00.0", 0x10 + dev);
	return SUCCESS;
}

int cudaDeviceCanAccessPeer(int *can, int dev, int peer) {
	CHECK_DEVICE(dev);
	CHECK_DEVICE(peer);
	*can = dev < peer; // asymmetric, so that swapped arguments show
	return SUCCESS;
}

int cudaMemGetInfo(size_t *free, size_t *total) {
	ON_CURRENT();
	*free = ((size_t)cur + 1) << 33;
	*total = ((size_t)cur + 1) << 34;
	return SUCCESS;
}

// as_stream is s, or the current device's legacy stream for NULL, when it may be
// used now.
static stream_t *as_stream(void *s) {
	if (!s) {
		legacy[cur].magic = STREAM_MAGIC;
		legacy[cur].dev = cur;
	}
	stream_t *st = s ? s : &legacy[cur];
	return st->magic == STREAM_MAGIC && st->dev == cur ? st : NULL;
}

// ON_STREAM resolves s for a call that CUDA runs on its stream's device: a created
// stream of any device, or the current device's legacy stream for NULL,
// cudaStreamLegacy and cudaStreamPerThread. It declares st, NULL if s is no stream,
// and fails the call as ON_CURRENT does on the poisoned or a lost device.
#define ON_STREAM(s) \
	LOCK(); \
	NEED_CONTEXT(); \
	stream_t *st = (uintptr_t)(s) <= 2 ? as_stream(NULL) : (s); \
	if (st->magic != STREAM_MAGIC) st = NULL; \
	if ((st ? st->dev : cur) == POISONED) return poison(__func__); \
	STICKY(st ? st->dev : cur)

static event_t *as_event(void *e) {
	event_t *ev = e;
	return ev && ev->magic == EVENT_MAGIC && ev->dev == cur ? ev : NULL;
}

static pool_t *as_pool(void *p) {
	pool_t *pool = p;
	return pool && pool->magic == POOL_MAGIC && pool->dev == cur ? pool : NULL;
}

// find is the allocation holding [p, p+n), or NULL.
static alloc_t *find(const void *p, size_t n) {
	for (alloc_t *a = allocs; a; a = a->next)
		if ((const unsigned char *)p >= a->p && (const unsigned char *)p + n <= a->p + a->size) return a;
	return NULL;
}

int cudaStreamCreateWithFlags(void **s, unsigned flags) {
	ON_CURRENT();
	if (flags & ~1u) return INVALID_VALUE;
	stream_t *st = calloc(1, sizeof *st);
	*st = (stream_t){STREAM_MAGIC, cur, flags, 0};
	*s = st;
	return SUCCESS;
}

int cudaStreamDestroy(void *s) {
	ON_CURRENT();
	stream_t *st = as_stream(s);
	if (!st || st == &legacy[cur]) return INVALID_HANDLE;
	st->magic = 0; // kept, never freed, so that a stale handle fails cleanly
	return SUCCESS;
}

int cudaStreamSynchronize(void *s) {
	ON_CURRENT();
	stream_t *st = as_stream(s);
	if (!st) return INVALID_HANDLE;
	st->syncs++;
	return SUCCESS;
}

// The fake's work completes as it is queued: a stream has nothing pending.
int cudaStreamQuery(void *s) {
	ON_CURRENT();
	if (!as_stream(s)) return INVALID_HANDLE;
	return SUCCESS;
}

int cudaStreamWaitEvent(void *s, void *e, unsigned flags) {
	ON_CURRENT();
	if (flags) return INVALID_VALUE;
	if (!as_stream(s) || !as_event(e)) return INVALID_HANDLE;
	return SUCCESS;
}

// The fake's work completes as it is queued: the host function runs before the call
// returns, on the caller's thread, with the argument it was given.
int cudaLaunchHostFunc(void *s, void (*fn)(void *), void *arg) {
	ON_CURRENT();
	if (!as_stream(s)) return INVALID_HANDLE;
	if (!fn) return INVALID_VALUE;
	fn(arg);
	return SUCCESS;
}

#ifndef OMIT_cudaStreamGetDevice
// cudaStreamGetDevice, unlike the other stream calls, may name a stream of any device.
int cudaStreamGetDevice(void *s, int *device) {
	ON_CURRENT();
	if ((uintptr_t)s <= 2) { // NULL, cudaStreamLegacy, cudaStreamPerThread
		*device = cur;
		return SUCCESS;
	}
	stream_t *st = s;
	if (st->magic != STREAM_MAGIC) return INVALID_HANDLE;
	*device = st->dev;
	return SUCCESS;
}
#endif

int cudaEventCreateWithFlags(void **e, unsigned flags) {
	ON_CURRENT();
	if (flags & ~7u) return INVALID_VALUE;
	event_t *ev = calloc(1, sizeof *ev);
	ev->magic = EVENT_MAGIC;
	ev->dev = cur;
	ev->flags = flags;
	*e = ev;
	return SUCCESS;
}

int cudaEventDestroy(void *e) {
	ON_CURRENT();
	event_t *ev = as_event(e);
	if (!ev) return INVALID_HANDLE;
	ev->magic = 0;
	return SUCCESS;
}

int cudaEventRecord(void *e, void *s) {
	ON_CURRENT();
	event_t *ev = as_event(e);
	stream_t *st = as_stream(s);
	if (!ev || !st) return INVALID_HANDLE;
	ev->recorded_on = st;
	ev->syncs_at_record = st->syncs;
	ev->synchronized = 0;
	return SUCCESS;
}

int cudaEventSynchronize(void *e) {
	ON_CURRENT();
	event_t *ev = as_event(e);
	if (!ev) return INVALID_HANDLE;
	ev->synchronized = 1;
	return SUCCESS;
}

// An event is pending from its record until its stream or itself is synchronized.
int cudaEventQuery(void *e) {
	ON_CURRENT();
	event_t *ev = as_event(e);
	if (!ev) return INVALID_HANDLE;
	if (ev->recorded_on && !ev->synchronized && ev->recorded_on->syncs == ev->syncs_at_record) return NOT_READY;
	return SUCCESS;
}

// Handles and export data: the object's address in the first 8 bytes, then a fixed
// pattern the fake checks on the way back in.
static void seal(unsigned char *b, const void *obj, unsigned char pattern) {
	memcpy(b, &obj, sizeof obj);
	for (int i = 8; i < 64; i++) b[i] = (unsigned char)(pattern ^ i);
}

// unseal is the object sealed in b, or NULL when the pattern from byte from on is off.
static void *unseal(const unsigned char *b, unsigned char pattern, int from) {
	for (int i = from; i < 64; i++)
		if (b[i] != (unsigned char)(pattern ^ i)) return NULL;
	void *obj;
	memcpy(&obj, b, sizeof obj);
	return obj;
}

enum { EVENT_PATTERN = 0x3c, FABRIC_PATTERN = 0xf0, POINTER_PATTERN = 0xa5 };

int cudaIpcGetEventHandle(void *h, void *e) {
	ON_CURRENT();
	event_t *ev = as_event(e);
	if (!ev) return INVALID_HANDLE;
	if ((ev->flags & 6u) != 6u) return INVALID_VALUE; // needs interprocess | disable timing
	seal(h, ev, EVENT_PATTERN);
	return SUCCESS;
}

typedef struct { unsigned char b[64]; } handle64;

int cudaIpcOpenEventHandle(void **e, handle64 h) {
	ON_CURRENT();
	event_t *origin = unseal(h.b, EVENT_PATTERN, 8);
	if (!origin || origin->magic != EVENT_MAGIC) return INVALID_VALUE;
	event_t *ev = calloc(1, sizeof *ev);
	ev->magic = EVENT_MAGIC;
	ev->dev = cur;
	ev->flags = origin->flags;
	*e = ev;
	return SUCCESS;
}

// cudaMemPoolProps: allocType@0 handleTypes@4 location.type@8 location.id@12
// win32SecurityAttributes@16 maxSize@24 usage@32 reserved@34..88.
int cudaMemPoolCreate(void **out, const void *props) {
	LOCK();
	int id = (int)rd32(props, 12);
	CHECK_DEVICE(id);
	if (rd32(props, 0) != 1 || rd32(props, 8) != 1 || rd64(props, 16) != 0 || !all_zero(props, 32, 88))
		return INVALID_VALUE;
	int handle_types = (int)rd32(props, 4);
	if (handle_types & ~0x9) return INVALID_VALUE;
	pool_t *p = calloc(1, sizeof *p);
	p->magic = POOL_MAGIC;
	p->dev = id;
	p->handle_types = handle_types;
	p->max_size = rd64(props, 24);
	p->attr_int[1] = p->attr_int[2] = p->attr_int[3] = 1;
	p->attr_u64[4] = 0x123456789abcULL; // beyond 32 bits, to catch truncation
	*out = p;
	return SUCCESS;
}

int cudaMemPoolDestroy(void *p) {
	ON_CURRENT();
	pool_t *pool = as_pool(p);
	if (!pool || pool == &defaults[cur]) return INVALID_HANDLE;
	pool->magic = 0;
	return SUCCESS;
}

int cudaDeviceGetDefaultMemPool(void **p, int dev) {
	LOCK();
	CHECK_DEVICE(dev);
	defaults[dev].magic = POOL_MAGIC;
	defaults[dev].dev = dev;
	*p = &defaults[dev];
	return SUCCESS;
}

int cudaMemPoolGetAttribute(void *p, int attr, void *v) {
	ON_CURRENT();
	pool_t *pool = as_pool(p);
	if (!pool) return INVALID_HANDLE;
	if (attr >= 1 && attr <= 3)
		memcpy(v, &pool->attr_int[attr], sizeof(int));
	else if (attr >= 4 && attr <= 8)
		memcpy(v, &pool->attr_u64[attr], sizeof(unsigned long long));
	else
		return INVALID_VALUE;
	return SUCCESS;
}

// Attributes 5 and 7 are read-only; 6 and 8, the high-water marks, may only be set to
// 0, which resets them to the current value.
int cudaMemPoolSetAttribute(void *p, int attr, void *v) {
	ON_CURRENT();
	pool_t *pool = as_pool(p);
	if (!pool) return INVALID_HANDLE;
	if (attr >= 1 && attr <= 3) {
		memcpy(&pool->attr_int[attr], v, sizeof(int));
		return SUCCESS;
	}
	unsigned long long x;
	memcpy(&x, v, sizeof x);
	switch (attr) {
	case 4:
		pool->attr_u64[4] = x;
		return SUCCESS;
	case 6:
	case 8:
		if (x) return INVALID_VALUE;
		pool->attr_u64[attr] = pool->attr_u64[attr - 1];
		return SUCCESS;
	}
	return INVALID_VALUE;
}

// cudaMemAccessDesc: location.type@0 location.id@4 flags@8, 12 bytes each.
int cudaMemPoolSetAccess(void *p, const void *descs, size_t n) {
	ON_CURRENT();
	pool_t *pool = as_pool(p);
	if (!pool) return INVALID_HANDLE;
	for (size_t i = 0; i < n; i++) {
		const char *d = (const char *)descs + 12 * i;
		int id = (int)rd32(d, 4), flags = (int)rd32(d, 8);
		if (rd32(d, 0) != 1 || id < 0 || id >= NDEV) return INVALID_VALUE;
		if (flags != 1 && flags != 3) return INVALID_DEVICE; // as CUDA answers "none"
	}
	for (size_t i = 0; i < n; i++) {
		const char *d = (const char *)descs + 12 * i;
		pool->access[rd32(d, 4)] = (int)rd32(d, 8);
	}
	return SUCCESS;
}

int cudaMemPoolGetAccess(int *flags, void *p, const void *loc) {
	ON_CURRENT();
	pool_t *pool = as_pool(p);
	if (!pool) return INVALID_HANDLE;
	int id = (int)rd32(loc, 4);
	if (rd32(loc, 0) != 1 || id < 0 || id >= NDEV) return INVALID_VALUE;
	*flags = id == pool->dev ? 3 : pool->access[id];
	return SUCCESS;
}

int cudaMemPoolTrimTo(void *p, size_t keep) {
	ON_CURRENT();
	pool_t *pool = as_pool(p);
	if (!pool) return INVALID_HANDLE;
	unsigned long long used = pool->attr_u64[7], reserved = pool->attr_u64[5];
	if (reserved > keep) reserved = keep;
	pool->attr_u64[5] = reserved < used ? used : reserved;
	return SUCCESS;
}

// The pool may be of another device than the stream.
int cudaMallocFromPoolAsync(void **out, size_t size, void *p, void *s) {
	ON_STREAM(s);
	pool_t *pool = p;
	if (!pool || pool->magic != POOL_MAGIC || !st) return INVALID_HANDLE;
	if (pool->origin || size == 0) return INVALID_VALUE; // imported pools cannot allocate
	unsigned long long *u = pool->attr_u64;
	if (pool->max_size && u[7] + size > pool->max_size) return OUT_OF_MEMORY;
	alloc_t *a = calloc(1, sizeof *a);
	a->p = calloc(1, size);
	a->size = size;
	a->pool = pool;
	a->next = allocs;
	allocs = a;
	u[7] += size;
	if (u[7] > u[8]) u[8] = u[7];
	if (u[7] > u[5]) u[5] = u[7];
	if (u[5] > u[6]) u[6] = u[5];
	*out = a->p;
	return SUCCESS;
}

#ifndef OMIT_cudaFreeAsync
// Freeing an imported pointer drops one import; freeing the original frees it.
int cudaFreeAsync(void *ptr, void *s) {
	ON_CURRENT();
	if (!as_stream(s)) return INVALID_HANDLE;
	for (alloc_t **pa = &allocs; *pa; pa = &(*pa)->next) {
		alloc_t *a = *pa;
		if (a->p != ptr) continue;
		if (a->imports > 0) {
			a->imports--;
			return SUCCESS;
		}
		*pa = a->next;
		a->pool->attr_u64[7] -= a->size;
		free(a->p);
		free(a);
		return SUCCESS;
	}
	return INVALID_VALUE;
}
#endif

// A POSIX fd handle is a memfd holding the pool's address; a fabric handle is sealed.
int cudaMemPoolExportToShareableHandle(void *h, void *p, int type, unsigned flags) {
	ON_CURRENT();
	pool_t *pool = as_pool(p);
	if (!pool) return INVALID_HANDLE;
	if (flags || pool->origin || !(pool->handle_types & type)) return INVALID_VALUE;
	if (type == 1) {
		int fd = memfd_create("fakepool", MFD_CLOEXEC);
		if (fd < 0 || write(fd, &pool, sizeof pool) != sizeof pool) return INVALID_VALUE;
		memcpy(h, &fd, sizeof fd);
	} else if (type == 8) {
		seal(h, pool, FABRIC_PATTERN);
	} else {
		return INVALID_VALUE;
	}
	pool->exported = 1;
	return SUCCESS;
}

int cudaMemPoolImportFromShareableHandle(void **out, void *h, int type, unsigned flags) {
	ON_CURRENT();
	if (flags) return INVALID_VALUE;
	pool_t *origin = NULL;
	if (type == 1) {
		if (pread((int)(intptr_t)h, &origin, sizeof origin, 0) != sizeof origin) return INVALID_VALUE;
	} else if (type == 8) {
		origin = unseal(h, FABRIC_PATTERN, 8);
	}
	if (!origin || origin->magic != POOL_MAGIC || !origin->exported || !(origin->handle_types & type))
		return INVALID_VALUE;
	pool_t *pool = calloc(1, sizeof *pool);
	pool->magic = POOL_MAGIC;
	pool->dev = cur;
	pool->origin = origin;
	*out = pool;
	return SUCCESS;
}

#ifndef OMIT_cudaMemPoolExportPointer
// Export data: the address, then the size at 8 and the pool at 16, then the pattern.
int cudaMemPoolExportPointer(void *data, void *ptr) {
	ON_CURRENT();
	alloc_t *a = find(ptr, 1);
	if (!a || a->p != ptr || !a->pool->exported) return INVALID_VALUE; // the pool first
	unsigned char *b = data;
	seal(b, ptr, POINTER_PATTERN);
	memcpy(b + 8, &a->size, sizeof a->size);
	memcpy(b + 16, &a->pool, sizeof a->pool);
	return SUCCESS;
}
#endif

int cudaMemPoolImportPointer(void **out, void *p, const void *data) {
	ON_CURRENT();
	pool_t *pool = as_pool(p);
	if (!pool) return INVALID_HANDLE;
	void *ptr = unseal(data, POINTER_PATTERN, 24);
	alloc_t *a = ptr ? find(ptr, 1) : NULL;
	if (!pool->origin || !a || a->p != ptr || a->pool != pool->origin || rd64(data, 8) != a->size ||
	    rd64(data, 16) != (uintptr_t)a->pool)
		return INVALID_VALUE;
	a->imports++;
	*out = ptr; // the exporter's address, as CUDA gives
	return SUCCESS;
}

// kind: 1 host to device, 2 device to host, 4 default (the binding uses it only
// between device addresses).
int cudaMemcpyAsync(void *dst, const void *src, size_t n, int kind, void *s) {
	ON_CURRENT();
	if (!as_stream(s)) return INVALID_HANDLE;
	int dst_dev = find(dst, n) != NULL, src_dev = find(src, n) != NULL;
	int ok = (kind == 1 && dst_dev && !src_dev) || (kind == 2 && !dst_dev && src_dev) ||
		 (kind == 4 && dst_dev && src_dev);
	if (!ok) return INVALID_VALUE;
	memmove(dst, src, n);
	return SUCCESS;
}

int cudaMemsetAsync(void *dst, int value, size_t n, void *s) {
	ON_CURRENT();
	if (!as_stream(s)) return INVALID_HANDLE;
	if (!find(dst, n)) return INVALID_VALUE;
	if (value == CONTAIN) {
		contained = cur;
		return CONTAINED;
	}
	memset(dst, value, n);
	return SUCCESS;
}
