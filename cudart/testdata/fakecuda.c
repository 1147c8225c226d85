// A fake libcuda for cudart's CPU tests: the driver entry points cudapool resolves.
// Device handles are ordinal+100, so that a binding passing the ordinal where the
// handle belongs fails. cuDeviceGetUuid_v2 and cuDeviceGetUuid fill different bytes, so
// a test can tell which one the binding resolved. Compile with -DOMIT_<name> to leave
// out cuDeviceGetUuid_v2 or cuMemGetAllocationGranularity.
#include <stddef.h>
#include <stdint.h>

#include "fake.h"

enum { SUCCESS = 0, INVALID_VALUE = 1, NOT_INITIALIZED = 3, INVALID_DEVICE = 101 };

static int initialized;

int cuGetErrorName(int e, const char **s) {
	*s = intern("FAKE_CU_NAME_", e);
	return SUCCESS;
}

int cuGetErrorString(int e, const char **s) {
	*s = intern("fake driver text ", e);
	return SUCCESS;
}

int cuInit(unsigned flags) {
	if (flags) return INVALID_VALUE;
	__atomic_store_n(&initialized, 1, __ATOMIC_SEQ_CST);
	return SUCCESS;
}

#define CHECK_INIT() \
	if (!__atomic_load_n(&initialized, __ATOMIC_SEQ_CST)) return NOT_INITIALIZED

int cuDeviceGet(int *d, int ordinal) {
	CHECK_INIT();
	if (ordinal < 0 || ordinal >= NDEV) return INVALID_DEVICE;
	*d = 100 + ordinal;
	return SUCCESS;
}

static int uuid(unsigned char *u, int d, unsigned char base, const char *fn) {
	CHECK_INIT();
	if (d < 100 || d >= 100 + NDEV) return INVALID_DEVICE;
	if (d == 100 + POISONED) return poison(fn);
	for (int i = 0; i < 16; i++) u[i] = (unsigned char)(base + 16 * (d - 100) + i);
	return SUCCESS;
}

#ifndef OMIT_cuDeviceGetUuid_v2
int cuDeviceGetUuid_v2(unsigned char *u, int d) { return uuid(u, d, 0x80, __func__); }
#endif

int cuDeviceGetUuid(unsigned char *u, int d) { return uuid(u, d, 0x00, __func__); }

#ifndef OMIT_cuMemGetAllocationGranularity
// CUmemAllocationProp: type@0 requestedHandleTypes@4 location.type@8 location.id@12
// win32HandleMetaData@16 allocFlags@24..32. The answer encodes the handle types, the
// device and the option: (option+1) * 2 MiB + handleTypes * 4096 + id * 16.
int cuMemGetAllocationGranularity(size_t *g, const void *prop, int option) {
	CHECK_INIT();
	int id = (int)rd32(prop, 12);
	if (rd32(prop, 0) != 1 || rd32(prop, 8) != 1 || rd64(prop, 16) != 0 || !all_zero(prop, 24, 32) ||
	    (option != 0 && option != 1))
		return INVALID_VALUE;
	if (id < 0 || id >= NDEV) return INVALID_DEVICE;
	if (id == POISONED) return poison(__func__);
	*g = ((size_t)option + 1) * (2u << 20) + (size_t)rd32(prop, 4) * 4096 + (size_t)id * 16;
	return SUCCESS;
}
#endif

// The VMM calls. The fake keeps no state: each call answers from its arguments, so a
// test can tell that every argument arrived in its place. An argument equal to BAD
// fails the call with 1000 + its position (1 for the first); an output is the sum of
// the inputs' values (plus the position of the handle type), and a FABRIC handle's
// bytes are the handle's value plus their index. cuCtxGetCurrent always answers a
// context: the fake driver does not see the fake runtime's.
enum { BAD = 0xbad };
typedef unsigned long long u64;

#define ARG(k, v) \
	if ((u64)(v) == BAD) return 1000 + (k)

int cuCtxGetCurrent(void **ctx) {
	*ctx = (void *)0x1;
	return SUCCESS;
}

int cuMemCreate(u64 *h, size_t size, const void *prop, u64 flags) {
	CHECK_INIT();
	ARG(2, size);
	if (rd32(prop, 0) != 1 || rd32(prop, 8) != 1 || flags != 0) return INVALID_VALUE;
	int id = (int)rd32(prop, 12);
	if (id < 0 || id >= NDEV) return INVALID_DEVICE;
	*h = (u64)size + rd32(prop, 4) * 16 + (u64)id;
	return SUCCESS;
}

int cuMemRelease(u64 h) {
	ARG(1, h);
	return SUCCESS;
}

int cuMemExportToShareableHandle(void *out, u64 h, int type, u64 flags) {
	ARG(2, h);
	if (flags != 0) return INVALID_VALUE;
	if (type == 1) {
		*(int *)out = (int)(h + 1);
		return SUCCESS;
	}
	if (type != 8) return INVALID_VALUE;
	for (int i = 0; i < 64; i++) ((unsigned char *)out)[i] = (unsigned char)(h + i);
	return SUCCESS;
}

int cuMemImportFromShareableHandle(u64 *h, void *os, int type) {
	if (type == 1) {
		ARG(2, (uintptr_t)os);
		*h = (u64)(uintptr_t)os + 1;
		return SUCCESS;
	}
	if (type != 8) return INVALID_VALUE;
	*h = ((const unsigned char *)os)[0] + ((const unsigned char *)os)[63] + 8;
	return SUCCESS;
}

int cuMemAddressReserve(u64 *p, size_t size, size_t align, u64 addr, u64 flags) {
	ARG(2, size);
	ARG(3, align);
	if (addr != 0 || flags != 0) return INVALID_VALUE;
	*p = (u64)size + align;
	return SUCCESS;
}

int cuMemAddressFree(u64 p, size_t size) {
	ARG(1, p);
	ARG(2, size);
	return SUCCESS;
}

int cuMemMap(u64 p, size_t size, size_t off, u64 h, u64 flags) {
	ARG(1, p);
	ARG(2, size);
	ARG(3, off);
	ARG(4, h);
	return flags ? INVALID_VALUE : SUCCESS;
}

int cuMemUnmap(u64 p, size_t size) {
	ARG(1, p);
	ARG(2, size);
	return SUCCESS;
}

// CUmemAccessDesc: location.type@0 location.id@4 flags@8, 12 bytes each.
int cuMemSetAccess(u64 p, size_t size, const void *desc, size_t n) {
	ARG(1, p);
	ARG(2, size);
	for (size_t i = 0; i < n; i++) {
		const char *d = (const char *)desc + 12 * i;
		if (rd32(d, 0) != 1 || rd32(d, 4) >= NDEV) return INVALID_DEVICE;
		ARG(3, rd32(d, 8));
	}
	return n ? SUCCESS : INVALID_VALUE;
}

// The stream memory operations: a bad stream, address, value or flags fails with
// 1000 + its position.
int cuStreamWriteValue32_v2(void *s, u64 p, unsigned v, unsigned flags) {
	ARG(1, (uintptr_t)s);
	ARG(2, p);
	ARG(3, v);
	return flags ? INVALID_VALUE : SUCCESS;
}

int cuStreamWaitValue32_v2(void *s, u64 p, unsigned v, unsigned flags) {
	ARG(1, (uintptr_t)s);
	ARG(2, p);
	ARG(3, v);
	ARG(4, flags + BAD - 3); // WaitNor (3) is the last condition
	return flags > 3 ? INVALID_VALUE : SUCCESS;
}
