// entry.c holds libcudapool's public C entry points. Each checks, in C, that the
// process was not forked since the library was loaded and clears the thread's last
// error, and only then crosses into Go (the cpgo_* functions). The check must be made
// before the crossing: in a forked child the Go runtime's other threads are gone, and
// entering Go can wait forever for them.
#include <pthread.h>
#include <stdio.h>
#include <string.h>
#include <unistd.h>

#include "cudapool.h"
#include "cp.h"
#include "_cgo_export.h"

static __thread char cp_err[1024];
static volatile int cp_forked;
static pid_t cp_load_pid;

static void cp_after_fork_child(void) { cp_forked = 1; }

__attribute__((constructor)) static void cp_load(void) {
	cp_load_pid = getpid();
	pthread_atfork(NULL, NULL, cp_after_fork_child);
}

void cp_set_error(const char *msg, size_t n) {
	if (n >= sizeof cp_err) n = sizeof cp_err - 1;
	memcpy(cp_err, msg, n);
	cp_err[n] = 0;
}

static int cp_fork_status(void) {
	snprintf(cp_err, sizeof cp_err,
	         "cudapool: process %d was forked from process %d after libcudapool was loaded, and the "
	         "library's Go runtime does not survive fork: start workers with spawn "
	         "(multiprocessing.set_start_method(\"spawn\")) or fork+exec",
	         (int)getpid(), (int)cp_load_pid);
	return CUDAPOOL_EFORK;
}

#define CP_CALL(call) \
	do { \
		if (cp_forked) return cp_fork_status(); \
		cp_err[0] = 0; \
		return (call); \
	} while (0)

const char *cudapool_last_error(void) { return cp_err; }

const char *cudapool_status_name(int status) {
	static const char *const names[] = {
		"CUDAPOOL_OK", "CUDAPOOL_EINVAL", "CUDAPOOL_EHANDLE", "CUDAPOOL_EPOINTER",
		"CUDAPOOL_ECLOSED", "CUDAPOOL_ENOMEM", "CUDAPOOL_ENOTFOUND", "CUDAPOOL_EEXIST",
		"CUDAPOOL_EBUSY", "CUDAPOOL_EGONE", "CUDAPOOL_EREFUSED", "CUDAPOOL_EVERSION",
		"CUDAPOOL_EPROTOCOL", "CUDAPOOL_ETIMEOUT", "CUDAPOOL_ERANGE", "CUDAPOOL_ENORUNTIME",
		"CUDAPOOL_ECUDA", "CUDAPOOL_EFORK", "CUDAPOOL_ENOTSUP", "CUDAPOOL_EINTERNAL",
		"CUDAPOOL_EIO", "CUDAPOOL_ENOSPACE", "CUDAPOOL_ESTALE",
	};
	if (status < 0 || status >= (int)(sizeof names / sizeof names[0])) return "CUDAPOOL_UNKNOWN";
	return names[status];
}

void cudapool_pool_options_default(cudapool_pool_options *o) {
	if (!o) return;
	memset(o, 0, sizeof *o);
	o->handle_type = CUDAPOOL_HANDLE_POSIX_FD;
}

int cudapool_protocol_version(int *version) { CP_CALL(cpgo_protocol_version(version)); }

int cudapool_init(const char *prefer, char *why, size_t why_len) {
	CP_CALL(cpgo_init((char *)prefer, why, why_len));
}

int cudapool_runtime_info(int *on_gpu, int *devices, char *name, size_t name_len) {
	CP_CALL(cpgo_runtime_info(on_gpu, devices, name, name_len));
}

int cudapool_stream_create(int device, void **stream) {
	CP_CALL(cpgo_stream_create(device, (uintptr_t *)stream));
}

int cudapool_stream_destroy(int device, void *stream) {
	CP_CALL(cpgo_stream_destroy(device, (uintptr_t)stream));
}

int cudapool_stream_synchronize(int device, void *stream) {
	CP_CALL(cpgo_stream_synchronize(device, (uintptr_t)stream));
}

int cudapool_stream_wait(int device, void *waiter, void *waited) {
	CP_CALL(cpgo_stream_wait(device, (uintptr_t)waiter, (uintptr_t)waited));
}

int cudapool_copy_to_device(int device, void *dst, const void *src, size_t n, void *stream) {
	CP_CALL(cpgo_copy_to_device(device, (uintptr_t)dst, (void *)src, n, (uintptr_t)stream));
}

int cudapool_copy_from_device(int device, void *dst, const void *src, size_t n, void *stream) {
	CP_CALL(cpgo_copy_from_device(device, dst, (uintptr_t)src, n, (uintptr_t)stream));
}

int cudapool_pool_create(int device, const cudapool_pool_options *opts, uint64_t *pool) {
	CP_CALL(cpgo_pool_create(device, (cudapool_pool_options *)opts, pool));
}

int cudapool_pool_stats_get(uint64_t pool, cudapool_pool_stats *stats) {
	CP_CALL(cpgo_pool_stats(pool, stats));
}

int cudapool_pool_close(uint64_t pool, int force, int64_t timeout_ms) {
	CP_CALL(cpgo_pool_close(pool, force, timeout_ms));
}

int cudapool_alloc(uint64_t pool, uint64_t size, void *stream, void **ptr) {
	CP_CALL(cpgo_alloc(pool, size, (uintptr_t)stream, (uintptr_t *)ptr));
}

int cudapool_free(void *ptr, void *stream) {
	CP_CALL(cpgo_free((uintptr_t)ptr, (uintptr_t)stream));
}

int cudapool_exporter_listen(const char *path, const char *name, int flags, uint64_t *exporter) {
	CP_CALL(cpgo_exporter_listen((char *)path, (char *)name, flags, exporter));
}

int cudapool_exporter_publish(uint64_t exporter, const char *name, const void *ptr, uint64_t size,
                              void *stream, const void *meta, size_t meta_len) {
	CP_CALL(cpgo_exporter_publish(exporter, (char *)name, (uintptr_t)ptr, size, (uintptr_t)stream,
	                              (void *)meta, meta_len));
}

int cudapool_exporter_unpublish(uint64_t exporter, const char *name) {
	CP_CALL(cpgo_exporter_unpublish(exporter, (char *)name));
}

int cudapool_exporter_push(uint64_t exporter, int pid, const char *name, int64_t timeout_ms) {
	CP_CALL(cpgo_exporter_push(exporter, pid, (char *)name, timeout_ms));
}

int cudapool_exporter_state(uint64_t exporter, char *buf, size_t cap, size_t *len) {
	CP_CALL(cpgo_exporter_state(exporter, buf, cap, len));
}

int cudapool_exporter_close(uint64_t exporter, int64_t timeout_ms) {
	CP_CALL(cpgo_exporter_close(exporter, timeout_ms));
}

int cudapool_query_state(const char *socket, int64_t timeout_ms, char *buf, size_t cap, size_t *len) {
	CP_CALL(cpgo_query_state((char *)socket, timeout_ms, buf, cap, len));
}

int cudapool_importer_dial(const char *path, int device, int64_t timeout_ms, uint64_t *importer) {
	CP_CALL(cpgo_importer_dial((char *)path, device, timeout_ms, importer));
}

int cudapool_importer_open(uint64_t importer, const char *name, void *stream, int64_t timeout_ms,
                           uint64_t *mapping) {
	CP_CALL(cpgo_importer_open(importer, (char *)name, (uintptr_t)stream, timeout_ms, mapping));
}

int cudapool_importer_close(uint64_t importer, int64_t timeout_ms) {
	CP_CALL(cpgo_importer_close(importer, timeout_ms));
}

int cudapool_mapping_info(uint64_t mapping, void **ptr, uint64_t *size, size_t *meta_len) {
	CP_CALL(cpgo_mapping_info(mapping, (uintptr_t *)ptr, size, meta_len));
}

int cudapool_mapping_meta(uint64_t mapping, void *buf, size_t cap, size_t *len) {
	CP_CALL(cpgo_mapping_meta(mapping, buf, cap, len));
}

int cudapool_mapping_release(uint64_t mapping, void *stream, int64_t timeout_ms) {
	CP_CALL(cpgo_mapping_release(mapping, (uintptr_t)stream, timeout_ms));
}

// The PyTorch entry points keep PyTorch's signatures: no status, NULL for a failed
// allocation (PyTorch raises), and the message in cudapool_last_error. They do not
// clear the last error: that would cost every allocation a store for nothing.
void *cudapool_torch_malloc(ssize_t size, int device, void *stream) {
	if (cp_forked) {
		cp_fork_status();
		return NULL;
	}
	return (void *)cpgo_torch_malloc(size, device, (uintptr_t)stream);
}

void cudapool_torch_free(void *ptr, ssize_t size, int device, void *stream) {
	if (cp_forked) {
		cp_fork_status();
		return;
	}
	cpgo_torch_free((uintptr_t)ptr, size, device, (uintptr_t)stream);
}

int cudapool_torch_configure(const cudapool_pool_options *opts) {
	CP_CALL(cpgo_torch_configure((cudapool_pool_options *)opts));
}

int cudapool_torch_pool(int device, uint64_t *pool) {
	CP_CALL(cpgo_torch_pool(device, pool));
}

// KV pages: the replica handle travels by value as a struct; Go takes its 64 bits.
int cudapool_kv_dial(const char *dir, int device, const char *ns, size_t ns_len, int flags,
                     int64_t timeout_ms, cudapool_kv_replica *out) {
	CP_CALL(cpgo_kv_dial((char *)dir, device, (char *)ns, ns_len, flags, timeout_ms, out ? &out->h : NULL));
}

int cudapool_kv_geometry_get(cudapool_kv_replica r, cudapool_kv_geometry *out) {
	CP_CALL(cpgo_kv_geometry(r.h, out));
}

int cudapool_kv_slab(cudapool_kv_replica r, void **base, uint64_t *bytes) {
	CP_CALL(cpgo_kv_slab(r.h, (uintptr_t *)base, bytes));
}

int cudapool_kv_hashes(cudapool_kv_replica r, const int32_t *tokens, size_t n_tokens, uint8_t *hashes_out,
                       size_t cap_hashes, size_t *n_hashes) {
	CP_CALL(cpgo_kv_hashes(r.h, (int32_t *)tokens, n_tokens, hashes_out, cap_hashes, n_hashes));
}

int cudapool_kv_alloc(cudapool_kv_replica r, uint32_t n, int64_t timeout_ms, uint64_t *lease,
                      uint32_t *pages) {
	CP_CALL(cpgo_kv_alloc(r.h, n, timeout_ms, lease, pages));
}

int cudapool_kv_seal(cudapool_kv_replica r, uint64_t lease, const uint8_t *hashes, size_t n, void *stream,
                     int wait, int64_t timeout_ms, uint32_t *visible, uint32_t *duplicates) {
	CP_CALL(cpgo_kv_seal(r.h, lease, (uint8_t *)hashes, n, (uintptr_t)stream, wait, timeout_ms, visible,
	                     duplicates));
}

int cudapool_kv_match(cudapool_kv_replica r, const uint8_t *hashes, size_t n, void *stream, int64_t timeout_ms,
                      uint64_t *lease, uint32_t *pages, size_t *n_pages) {
	CP_CALL(cpgo_kv_match(r.h, (uint8_t *)hashes, n, (uintptr_t)stream, timeout_ms, lease, pages, n_pages));
}

int cudapool_kv_release(cudapool_kv_replica r, const uint64_t *leases, size_t n, void *stream,
                        int64_t timeout_ms) {
	CP_CALL(cpgo_kv_release(r.h, (uint64_t *)leases, n, (uintptr_t)stream, timeout_ms));
}

int cudapool_kv_done_fd(cudapool_kv_replica r, int *fd) { CP_CALL(cpgo_kv_done_fd(r.h, fd)); }

int cudapool_kv_alive(cudapool_kv_replica r, int *alive) { CP_CALL(cpgo_kv_alive(r.h, alive)); }

int cudapool_kv_error(cudapool_kv_replica r, char *buf, size_t cap, size_t *len) {
	CP_CALL(cpgo_kv_error(r.h, buf, cap, len));
}

int cudapool_kv_stats(cudapool_kv_replica r, int64_t timeout_ms, char *buf, size_t cap, size_t *len) {
	CP_CALL(cpgo_kv_stats(r.h, timeout_ms, buf, cap, len));
}

int cudapool_kv_close(cudapool_kv_replica r, int64_t timeout_ms) { CP_CALL(cpgo_kv_close(r.h, timeout_ms)); }
