// Shared by the fake CUDA runtime and driver that cudart's CPU tests build with gcc.
// Device 3 of the fake's four is poisoned: every call that runs on it, or names it,
// fails with poison(its own name), so a test can tell which C function failed.
#ifndef CUDAPOOL_FAKE_H
#define CUDAPOOL_FAKE_H

#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

enum { NDEV = 4, POISONED = 3 };

// Attributes of the fake's own, read with cudaDeviceGetAttribute: how many contexts
// of the device calls made current on threads that had none, and how many
// cudaGetDevice calls the process made.
enum { FAKE_ATTR_LAZY_CONTEXTS = 90001, FAKE_ATTR_GET_DEVICE_CALLS = 90002 };

// poison is the error code of function fn on the poisoned device: 10000 plus its
// name's FNV-1a hash modulo 50000 (cudart's tests compute the same).
static inline int poison(const char *fn) {
	unsigned h = 2166136261u;
	for (; *fn; fn++) h = (h ^ (unsigned char)*fn) * 16777619u;
	return 10000 + (int)(h % 50000u);
}

// intern returns a string that lives for the process, as CUDA's error names do, so
// that the caller may read it after the call and from another thread.
static inline const char *intern(const char *prefix, int code) {
	static pthread_mutex_t mu = PTHREAD_MUTEX_INITIALIZER;
	static struct entry { struct entry *next; int code; const char *prefix; char s[64]; } *all;
	pthread_mutex_lock(&mu);
	struct entry *e = all;
	while (e && (e->code != code || e->prefix != prefix)) e = e->next;
	if (!e) {
		e = calloc(1, sizeof *e);
		e->code = code;
		e->prefix = prefix;
		snprintf(e->s, sizeof e->s, "%s%d", prefix, code);
		e->next = all;
		all = e;
	}
	pthread_mutex_unlock(&mu);
	return e->s;
}

static inline unsigned rd32(const void *base, size_t off) {
	unsigned v;
	memcpy(&v, (const char *)base + off, sizeof v);
	return v;
}

static inline unsigned long long rd64(const void *base, size_t off) {
	unsigned long long v;
	memcpy(&v, (const char *)base + off, sizeof v);
	return v;
}

static inline int all_zero(const void *base, size_t from, size_t to) {
	for (size_t i = from; i < to; i++)
		if (((const unsigned char *)base)[i]) return 0;
	return 1;
}

#endif
