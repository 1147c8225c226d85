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
		"CUDAPOOL_EIO", "CUDAPOOL_ESTREAMDEVICE", "CUDAPOOL_EDUPLICATE", "CUDAPOOL_ETOOMANY",
		"CUDAPOOL_ELOST", "CUDAPOOL_EEXPORTER", "CUDAPOOL_EABANDONED", "CUDAPOOL_ESTALE",
		"CUDAPOOL_EBADDIR", "CUDAPOOL_ENOSPACE",
	};
	if (status < 0 || status >= (int)(sizeof names / sizeof names[0])) return "CUDAPOOL_UNKNOWN";
	return names[status];
}

int cudapool_version(int *major, int *minor) {
	if (major) *major = CUDAPOOL_VERSION_MAJOR;
	if (minor) *minor = CUDAPOOL_VERSION_MINOR;
	cp_err[0] = 0;
	return CUDAPOOL_OK;
}

// cp_options_init zeroes the size bytes at o and sets its size field, failing if size
// cannot hold the first version of the struct (min bytes). It is the common half of
// every *_options_init.
static int cp_options_init(void *o, size_t size, size_t min, const char *what) {
	if (cp_forked) return cp_fork_status();
	cp_err[0] = 0;
	if (!o) {
		snprintf(cp_err, sizeof cp_err, "cudapool: invalid argument: %s is NULL", what);
		return CUDAPOOL_EINVAL;
	}
	if (size < min) {
		snprintf(cp_err, sizeof cp_err,
		         "cudapool: invalid argument: %s of %zu bytes is smaller than its first version (%zu)", what,
		         size, min);
		return CUDAPOOL_EINVAL;
	}
	memset(o, 0, size);
	*(size_t *)o = size;
	return CUDAPOOL_OK;
}

int cudapool_pool_options_init(cudapool_pool_options *o, size_t size) {
	int rc = cp_options_init(o, size, sizeof *o, "pool options");
	if (rc == CUDAPOOL_OK) o->handle_type = CUDAPOOL_HANDLE_POSIX_FD;
	return rc;
}

int cudapool_listen_options_init(cudapool_listen_options *o, size_t size) {
	return cp_options_init(o, size, sizeof *o, "listen options");
}

int cudapool_dial_options_init(cudapool_dial_options *o, size_t size) {
	return cp_options_init(o, size, sizeof *o, "dial options");
}

int cudapool_open_options_init(cudapool_open_options *o, size_t size) {
	return cp_options_init(o, size, sizeof *o, "open options");
}

// cp_log is the log sink cudapool_set_log set: a function of the caller's, or stderr.
static cudapool_log_fn cp_log_fn;
static void *cp_log_arg;
static pthread_mutex_t cp_log_mu = PTHREAD_MUTEX_INITIALIZER;

void cp_log(int level, const char *msg) {
	pthread_mutex_lock(&cp_log_mu);
	if (cp_log_fn) {
		cp_log_fn(level, msg, cp_log_arg);
	} else {
		fprintf(stderr, "%s\n", msg);
	}
	pthread_mutex_unlock(&cp_log_mu);
}

int cudapool_set_log(int level, cudapool_log_fn fn, void *arg) {
	if (cp_forked) return cp_fork_status();
	cp_err[0] = 0;
	if ((level < CUDAPOOL_LOG_DEBUG || level > CUDAPOOL_LOG_ERROR) && level != CUDAPOOL_LOG_OFF) {
		snprintf(cp_err, sizeof cp_err,
		         "cudapool: invalid argument: log level %d: want CUDAPOOL_LOG_DEBUG (-4) to "
		         "CUDAPOOL_LOG_ERROR (8), or CUDAPOOL_LOG_OFF (127)",
		         level);
		return CUDAPOOL_EINVAL;
	}
	pthread_mutex_lock(&cp_log_mu);
	cp_log_fn = fn;
	cp_log_arg = arg;
	pthread_mutex_unlock(&cp_log_mu);
	return cpgo_set_log_level(level);
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

// OUT is the address of the handle an out-parameter points to, NULL for NULL.
#define OUT(p) ((p) ? &(p)->h : NULL)

int cudapool_pool_create(int device, const cudapool_pool_options *opts, cudapool_pool *pool) {
	CP_CALL(cpgo_pool_create(device, (cudapool_pool_options *)opts, OUT(pool)));
}

int cudapool_pool_stats_get(cudapool_pool pool, cudapool_pool_stats *stats) {
	CP_CALL(cpgo_pool_stats(pool.h, stats));
}

int cudapool_pool_close(cudapool_pool pool, int force, int64_t timeout_ms) {
	CP_CALL(cpgo_pool_close(pool.h, force, timeout_ms));
}

int cudapool_alloc(cudapool_pool pool, uint64_t size, void *stream, int64_t timeout_ms, void **ptr) {
	CP_CALL(cpgo_alloc(pool.h, size, (uintptr_t)stream, timeout_ms, (uintptr_t *)ptr));
}

int cudapool_free(void *ptr, void *stream) {
	CP_CALL(cpgo_free((uintptr_t)ptr, (uintptr_t)stream));
}

int cudapool_exporter_listen(const char *path, const cudapool_listen_options *opts,
                             cudapool_exporter *exporter) {
	CP_CALL(cpgo_exporter_listen((char *)path, (cudapool_listen_options *)opts, OUT(exporter)));
}

int cudapool_exporter_publish(cudapool_exporter exporter, const char *name, const void *ptr,
                              uint64_t size, void *stream, const void *meta, size_t meta_len) {
	CP_CALL(cpgo_exporter_publish(exporter.h, (char *)name, (uintptr_t)ptr, size, (uintptr_t)stream,
	                              (void *)meta, meta_len));
}

int cudapool_exporter_publish_all(cudapool_exporter exporter, const cudapool_publish_entry *entries,
                                  size_t n, void *stream) {
	CP_CALL(cpgo_exporter_publish_all(exporter.h, (cudapool_publish_entry *)entries, n, (uintptr_t)stream));
}

int cudapool_exporter_unpublish(cudapool_exporter exporter, const char *name) {
	CP_CALL(cpgo_exporter_unpublish(exporter.h, (char *)name));
}

int cudapool_exporter_push(cudapool_exporter exporter, int pid, const char *name, int64_t timeout_ms) {
	CP_CALL(cpgo_exporter_push(exporter.h, pid, (char *)name, timeout_ms));
}

int cudapool_exporter_state(cudapool_exporter exporter, char *buf, size_t cap, size_t *len) {
	CP_CALL(cpgo_exporter_state(exporter.h, buf, cap, len));
}

int cudapool_exporter_close(cudapool_exporter exporter, int64_t timeout_ms) {
	CP_CALL(cpgo_exporter_close(exporter.h, timeout_ms));
}

int cudapool_query_state(const char *socket, int64_t timeout_ms, char *buf, size_t cap, size_t *len) {
	CP_CALL(cpgo_query_state((char *)socket, timeout_ms, buf, cap, len));
}

int cudapool_importer_dial(const char *path, int device, const cudapool_dial_options *opts,
                           int64_t timeout_ms, cudapool_importer *importer) {
	CP_CALL(cpgo_importer_dial((char *)path, device, (cudapool_dial_options *)opts, timeout_ms, OUT(importer)));
}

int cudapool_importer_open(cudapool_importer importer, const char *name, void *stream,
                           const cudapool_open_options *opts, int64_t timeout_ms,
                           cudapool_mapping *mapping) {
	CP_CALL(cpgo_importer_open(importer.h, (char *)name, (uintptr_t)stream, (cudapool_open_options *)opts,
	                           timeout_ms, OUT(mapping)));
}

int cudapool_importer_open_all(cudapool_importer importer, const char *const *names, size_t n,
                               void *stream, int64_t timeout_ms, cudapool_mapping *mappings) {
	CP_CALL(cpgo_importer_open_all(importer.h, (char **)names, n, (uintptr_t)stream, timeout_ms,
	                               (uint64_t *)mappings));
}

int cudapool_importer_release_all(cudapool_importer importer, const cudapool_mapping *mappings,
                                  size_t n, void *stream, int64_t timeout_ms) {
	CP_CALL(cpgo_importer_release_all(importer.h, (uint64_t *)mappings, n, (uintptr_t)stream, timeout_ms));
}

int cudapool_importer_done_fd(cudapool_importer importer, int *fd) {
	CP_CALL(cpgo_importer_done_fd(importer.h, fd));
}

int cudapool_importer_err(cudapool_importer importer) { CP_CALL(cpgo_importer_err(importer.h)); }

int cudapool_importer_close(cudapool_importer importer, int64_t timeout_ms) {
	CP_CALL(cpgo_importer_close(importer.h, timeout_ms));
}

int cudapool_mapping_info(cudapool_mapping mapping, void **ptr, uint64_t *size, size_t *meta_len) {
	CP_CALL(cpgo_mapping_info(mapping.h, (uintptr_t *)ptr, size, meta_len));
}

int cudapool_mapping_meta(cudapool_mapping mapping, void *buf, size_t cap, size_t *len) {
	CP_CALL(cpgo_mapping_meta(mapping.h, buf, cap, len));
}

int cudapool_mapping_err(cudapool_mapping mapping) { CP_CALL(cpgo_mapping_err(mapping.h)); }

int cudapool_mapping_release(cudapool_mapping mapping, void *stream, int64_t timeout_ms) {
	CP_CALL(cpgo_mapping_release(mapping.h, (uintptr_t)stream, timeout_ms));
}

int cudapool_vmm_granularity(int device, int flags, uint64_t *granularity) {
	CP_CALL(cpgo_vmm_granularity(device, flags, granularity));
}

int cudapool_chunk_create(int device, uint64_t size, int flags, cudapool_chunk *chunk) {
	CP_CALL(cpgo_chunk_create(device, size, flags, OUT(chunk)));
}

int cudapool_chunk_info(cudapool_chunk chunk, int *device, uint64_t *size, int *fabric) {
	CP_CALL(cpgo_chunk_info(chunk.h, device, size, fabric));
}

int cudapool_chunk_close(cudapool_chunk chunk) { CP_CALL(cpgo_chunk_close(chunk.h)); }

int cudapool_reservation_create(int device, uint64_t size, cudapool_reservation *reservation) {
	CP_CALL(cpgo_reservation_create(device, size, OUT(reservation)));
}

int cudapool_reservation_grow(cudapool_reservation reservation, const cudapool_chunk *chunks, size_t n) {
	CP_CALL(cpgo_reservation_grow(reservation.h, (uint64_t *)chunks, n));
}

int cudapool_reservation_shrink(cudapool_reservation reservation, size_t n) {
	CP_CALL(cpgo_reservation_shrink(reservation.h, n));
}

int cudapool_reservation_info(cudapool_reservation reservation, void **ptr, uint64_t *reserved,
                              uint64_t *mapped, size_t *chunks) {
	CP_CALL(cpgo_reservation_info(reservation.h, (uintptr_t *)ptr, reserved, mapped, chunks));
}

int cudapool_reservation_close(cudapool_reservation reservation) {
	CP_CALL(cpgo_reservation_close(reservation.h));
}

int cudapool_exporter_publish_chunks(cudapool_exporter exporter, const char *name, const cudapool_chunk *chunks,
                                     size_t n, uint64_t offset, uint64_t size, void *stream, const void *meta,
                                     size_t meta_len) {
	CP_CALL(cpgo_exporter_publish_chunks(exporter.h, (char *)name, (uint64_t *)chunks, n, offset, size,
	                                     (uintptr_t)stream, (void *)meta, meta_len));
}

int cudapool_exporter_publish_chunks_all(cudapool_exporter exporter, const cudapool_chunk *chunks, size_t n,
                                         const cudapool_chunk_entry *entries, size_t n_entries, void *stream) {
	CP_CALL(cpgo_exporter_publish_chunks_all(exporter.h, (uint64_t *)chunks, n, (cudapool_chunk_entry *)entries,
	                                         n_entries, (uintptr_t)stream));
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

int cudapool_torch_pool(int device, cudapool_pool *pool) {
	CP_CALL(cpgo_torch_pool(device, OUT(pool)));
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

int cudapool_kv_layer_ptrs(cudapool_kv_replica r, int32_t layer, void **k, void **v) {
	CP_CALL(cpgo_kv_layer_ptrs(r.h, layer, (uintptr_t *)k, (uintptr_t *)v));
}

int cudapool_kv_regions(cudapool_kv_replica r, void **ptrs, uint64_t *bytes, size_t cap, size_t *n) {
	CP_CALL(cpgo_kv_regions(r.h, (uintptr_t *)ptrs, bytes, cap, n));
}

int cudapool_kv_hashes(cudapool_kv_replica r, const int32_t *tokens, size_t n_tokens, uint8_t *hashes_out,
                       size_t cap_hashes, size_t *n_hashes) {
	CP_CALL(cpgo_kv_hashes(r.h, (int32_t *)tokens, n_tokens, hashes_out, cap_hashes, n_hashes));
}

int cudapool_kv_prefix_hashes(const char *ns, size_t ns_len, const int32_t *tokens, size_t n_tokens,
                              uint32_t tokens_per_page, uint8_t *hashes_out, size_t cap_hashes, size_t *n_hashes) {
	CP_CALL(cpgo_kv_prefix_hashes((char *)ns, ns_len, (int32_t *)tokens, n_tokens, tokens_per_page, hashes_out,
	                              cap_hashes, n_hashes));
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

int cudapool_kv_reattaches(cudapool_kv_replica r, uint64_t *n) { CP_CALL(cpgo_kv_reattaches(r.h, n)); }

int cudapool_kv_wait_attached(cudapool_kv_replica r, int64_t timeout_ms) {
	CP_CALL(cpgo_kv_wait_attached(r.h, timeout_ms));
}

int cudapool_kv_lease_lost(cudapool_kv_replica r, uint64_t lease, char *buf, size_t cap, size_t *len) {
	CP_CALL(cpgo_kv_lease_lost(r.h, lease, buf, cap, len));
}

int cudapool_kv_error(cudapool_kv_replica r, char *buf, size_t cap, size_t *len) {
	CP_CALL(cpgo_kv_error(r.h, buf, cap, len));
}

int cudapool_kv_stats(cudapool_kv_replica r, int64_t timeout_ms, char *buf, size_t cap, size_t *len) {
	CP_CALL(cpgo_kv_stats(r.h, timeout_ms, buf, cap, len));
}

int cudapool_kv_query_stats(const char *dir, int64_t timeout_ms, char *buf, size_t cap, size_t *len) {
	CP_CALL(cpgo_kv_query_stats((char *)dir, timeout_ms, buf, cap, len));
}

int cudapool_kv_close(cudapool_kv_replica r, int64_t timeout_ms) { CP_CALL(cpgo_kv_close(r.h, timeout_ms)); }
