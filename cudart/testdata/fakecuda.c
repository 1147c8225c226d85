// A fake libcuda for cudart's CPU tests: the driver entry points cudapool resolves.
// Device handles are ordinal+100, so that a binding passing the ordinal where the
// handle belongs fails. cuDeviceGetUuid_v2 and cuDeviceGetUuid fill different bytes, so
// a test can tell which one the binding resolved. Compile with -DOMIT_<name> to leave
// out cuDeviceGetUuid_v2 or cuMemGetAllocationGranularity.
#include <stddef.h>

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
