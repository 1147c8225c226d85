/* cudapool.h: the C interface of libcudapool, cudapool's pools, sharing protocol and
 * PyTorch allocator built from the Go code into one shared library.
 *
 * Build (from the repository root; needs Go and a C compiler, no CUDA toolkit):
 *
 *     go build -buildmode=c-shared -o bin/libcudapool.so ./capi
 *
 * and compile against it with -Icapi -Lbin -lcudapool.
 *
 * Conventions
 *  - Every function returns 0 (CUDAPOOL_OK) or a CUDAPOOL_E* code, except the PyTorch
 *    entry points, whose signatures are PyTorch's. After a failure,
 *    cudapool_last_error() returns a message saying what failed and why; it is per
 *    thread, and every call that returns a status clears it first. The PyTorch entry
 *    points set it when they fail (NULL from malloc) and leave it alone otherwise.
 *  - Objects are opaque 64-bit handles (never 0). A handle that was closed, released,
 *    belongs to another kind of object or was never issued fails with
 *    CUDAPOOL_EHANDLE; it never crashes the process.
 *  - Device memory is a plain pointer (void *); streams are cudaStream_t passed as
 *    void * (NULL is the legacy default stream).
 *  - Calls that wait take timeout_ms: the most they wait, in milliseconds; 0 means no
 *    bound. A call that runs out of time fails with CUDAPOOL_ETIMEOUT and holds nothing.
 *  - The library holds a Go runtime, which cannot survive fork(): in a child forked
 *    after the library was loaded every call fails with CUDAPOOL_EFORK (the PyTorch
 *    allocator returns NULL) instead of hanging. Start workers with spawn or
 *    fork+exec.
 *  - The runtime (a GPU through libcudart, or cudapool's software device) is chosen
 *    once per process: by cudapool_init, else at the first call that needs it from
 *    $CUDAPOOL_RUNTIME ("auto" when unset).
 */
#ifndef CUDAPOOL_H
#define CUDAPOOL_H

#include <stddef.h>
#include <stdint.h>
#include <sys/types.h>

#ifdef __cplusplus
extern "C" {
#endif

enum cudapool_status {
	CUDAPOOL_OK = 0,
	CUDAPOOL_EINVAL = 1,     /* a bad argument: NULL pointer, size 0, bad name, ... */
	CUDAPOOL_EHANDLE = 2,    /* a handle that is closed, foreign or was never issued */
	CUDAPOOL_EPOINTER = 3,   /* a device pointer no cudapool pool gave (or freed) */
	CUDAPOOL_ECLOSED = 4,    /* the object is closed or closing */
	CUDAPOOL_ENOMEM = 5,     /* the pool or device is out of memory */
	CUDAPOOL_ENOTFOUND = 6,  /* no buffer is published under that name */
	CUDAPOOL_EEXIST = 7,     /* the name is published already */
	CUDAPOOL_EBUSY = 8,      /* the pool has live buffers (close without force) */
	CUDAPOOL_EGONE = 9,      /* the exporter or the buffer is gone */
	CUDAPOOL_EREFUSED = 10,  /* the exporter refused this process */
	CUDAPOOL_EVERSION = 11,  /* the peer speaks another protocol version */
	CUDAPOOL_EPROTOCOL = 12, /* the peer broke the protocol */
	CUDAPOOL_ETIMEOUT = 13,  /* timeout_ms ran out */
	CUDAPOOL_ERANGE = 14,    /* an output buffer is too small; the size needed is given */
	CUDAPOOL_ENORUNTIME = 15,/* no runtime: none loads, or another was chosen already */
	CUDAPOOL_ECUDA = 16,     /* the CUDA runtime failed */
	CUDAPOOL_EFORK = 17,     /* this process was forked after the library was loaded */
	CUDAPOOL_ENOTSUP = 18,   /* the request is valid but not supported here */
	CUDAPOOL_EINTERNAL = 19, /* a bug in cudapool: please report the message */
	CUDAPOOL_EIO = 20        /* the system failed: a socket, a file, a process */
};

/* cudapool_last_error is the message of this thread's last failed call, "" if the
 * last call succeeded. The string stays valid until this thread's next call. */
const char *cudapool_last_error(void);
/* cudapool_status_name names a status code, e.g. "CUDAPOOL_EHANDLE". */
const char *cudapool_status_name(int status);

/* cudapool_protocol_version is the version of the sharing protocol this library speaks;
 * metadata travels with a publish from version 2 on. */
int cudapool_protocol_version(int *version);

/* ---- Runtime ---- */

/* cudapool_init chooses the runtime: prefer is "auto" (or NULL: a GPU when a CUDA
 * runtime loads and sees one, else the software device), "gpu" or "test" (the
 * software device). The software device is in a library built with -tags
 * cudapool_softdevice only; without it "test", and "auto" without a GPU, fail with
 * CUDAPOOL_ENORUNTIME. It writes a sentence saying which and why into why (if not
 * NULL; cut to why_len). A second call with the same preference succeeds; with
 * another it fails with CUDAPOOL_ENORUNTIME. */
int cudapool_init(const char *prefer, char *why, size_t why_len);
/* cudapool_runtime_info says which runtime is in use (choosing it if none is):
 * *on_gpu is 1 for the real runtime, *devices the device count. */
int cudapool_runtime_info(int *on_gpu, int *devices, char *name, size_t name_len);

/* Streams and copies, for programs without the CUDA headers (and the software device,
 * whose memory only its own calls reach). */
int cudapool_stream_create(int device, void **stream);
int cudapool_stream_destroy(int device, void *stream);
int cudapool_stream_synchronize(int device, void *stream);
/* cudapool_stream_wait makes the work queued on waiter from now on wait for the work
 * queued on waited so far; the host does not wait. */
int cudapool_stream_wait(int device, void *waiter, void *waited);
int cudapool_copy_to_device(int device, void *dst, const void *src, size_t n, void *stream);
/* cudapool_copy_from_device returns once the copy is done. */
int cudapool_copy_from_device(int device, void *dst, const void *src, size_t n, void *stream);

/* ---- Pools ---- */

enum cudapool_handle_type {
	CUDAPOOL_HANDLE_NONE = 0,     /* a local pool: not shareable, not rounded */
	CUDAPOOL_HANDLE_POSIX_FD = 1, /* the default */
	CUDAPOOL_HANDLE_FABRIC = 8
};

/* The options of pool.New. Zero-initialise and set what you need. */
typedef struct {
	const char *name;           /* NULL: a made-up name */
	int handle_type;            /* CUDAPOOL_HANDLE_*; 0 is NONE, so set it */
	uint64_t max_size;          /* 0: the device's memory */
	uint64_t release_threshold; /* used when has_release_threshold */
	int has_release_threshold;
	int wait_for_memory;        /* alloc on a full pool waits for a free */
	const int *peer_devices;    /* devices that may access the pool's memory */
	int peer_count;
	uint64_t cache_bytes;       /* freed buffers kept for reuse on their stream; 0: none */
} cudapool_pool_options;

/* cudapool_pool_options_default fills *o with pool.New's defaults (POSIX fd). */
void cudapool_pool_options_default(cudapool_pool_options *o);

int cudapool_pool_create(int device, const cudapool_pool_options *opts, uint64_t *pool);

typedef struct {
	int device;
	int handle_type;
	uint64_t max_size, granularity;
	uint64_t reserved_current, reserved_high, used_current, used_high; /* the driver's */
	uint64_t live_buffers, bytes_requested, bytes_reserved;
	uint64_t shared_buffers, active_leases, deferred_frees, failed_frees;
	uint64_t cached_buffers, cached_bytes; /* kept for reuse (cache_bytes) */
} cudapool_pool_stats;

int cudapool_pool_stats_get(uint64_t pool, cudapool_pool_stats *stats);
/* cudapool_pool_close destroys the pool. Without force it fails with CUDAPOOL_EBUSY
 * while buffers are live; with force it frees them (buffers other processes still hold
 * are left allocated until the process exits). The handle is spent either way but
 * for EBUSY and ETIMEOUT. */
int cudapool_pool_close(uint64_t pool, int force, int64_t timeout_ms);

/* cudapool_alloc returns at least size bytes of the pool's device memory, ready for
 * work queued on stream after the call. */
int cudapool_alloc(uint64_t pool, uint64_t size, void *stream, void **ptr);
/* cudapool_free returns ptr (from cudapool_alloc or the PyTorch allocator) once the
 * work queued on stream before the call has completed; other processes' leases
 * defer the real free until they release. */
int cudapool_free(void *ptr, void *stream);

/* ---- Exporter (producer) ---- */

/* cudapool_exporter_listen creates an exporter on a new Unix socket at path (mode
 * 0600) and announces it for poolstat. name (may be NULL) is the process name it
 * gives. */
int cudapool_exporter_listen(const char *path, const char *name, int flags, uint64_t *exporter);
/* The flags of cudapool_exporter_listen. */
enum cudapool_listen_flags {
	/* Consumers keep a buffer's import after they release it, so that leasing the same
	 * memory again (a buffer recycled through a pool's cache) costs no import and no
	 * free; the exporter revokes such imports before the memory goes back to the driver. */
	CUDAPOOL_LISTEN_RETAIN_IMPORTS = 1,
	/* No announcement for poolstat. */
	CUDAPOOL_LISTEN_NO_ANNOUNCE = 2
};
/* cudapool_exporter_publish makes the memory at [ptr, ptr+size) available under
 * name, ready once the work queued on stream before the call has completed. ptr must
 * lie in memory of a cudapool pool (cudapool_alloc, the PyTorch allocator);
 * size 0 means to the end of its buffer. ptr may lie inside a buffer (a tensor that
 * PyTorch carved out of a segment): consumers get that range, not aligned to anything.
 * They can read the rest of the pool all the same: the pool is the unit of trust. meta (meta_len bytes, at most
 * CUDAPOOL_MAX_META) travels to every consumer. */
#define CUDAPOOL_MAX_NAME 255
#define CUDAPOOL_MAX_META 4096
int cudapool_exporter_publish(uint64_t exporter, const char *name, const void *ptr, uint64_t size,
                              void *stream, const void *meta, size_t meta_len);
int cudapool_exporter_unpublish(uint64_t exporter, const char *name);
/* cudapool_exporter_push leases the buffer published under name to process pid. */
int cudapool_exporter_push(uint64_t exporter, int pid, const char *name, int64_t timeout_ms);
/* cudapool_exporter_state writes the exporter's state as JSON (poolstat's schema). On
 * CUDAPOOL_ERANGE *len is the size needed. */
int cudapool_exporter_state(uint64_t exporter, char *buf, size_t cap, size_t *len);
int cudapool_exporter_close(uint64_t exporter, int64_t timeout_ms);

/* cudapool_query_state asks the exporter at socket for its state, as poolstat does. */
int cudapool_query_state(const char *socket, int64_t timeout_ms, char *buf, size_t cap, size_t *len);

/* ---- Importer (consumer) ---- */

int cudapool_importer_dial(const char *path, int device, int64_t timeout_ms, uint64_t *importer);
/* cudapool_importer_open leases the buffer published under name and maps it; work
 * queued on stream after the call sees the producer's writes. Each open needs its
 * release. */
int cudapool_importer_open(uint64_t importer, const char *name, void *stream, int64_t timeout_ms,
                           uint64_t *mapping);
/* cudapool_importer_close frees what is still mapped (release first) and says goodbye. */
int cudapool_importer_close(uint64_t importer, int64_t timeout_ms);

/* cudapool_mapping_info: the mapped range's address in this process, its size and the
 * length of its metadata; any output may be NULL. */
int cudapool_mapping_info(uint64_t mapping, void **ptr, uint64_t *size, size_t *meta_len);
/* cudapool_mapping_meta copies the metadata published with the buffer. On
 * CUDAPOOL_ERANGE *len is the size needed. */
int cudapool_mapping_meta(uint64_t mapping, void *buf, size_t cap, size_t *len);
/* cudapool_mapping_release gives the mapping back once the work queued on stream
 * before the call has completed. The handle is spent. */
int cudapool_mapping_release(uint64_t mapping, void *stream, int64_t timeout_ms);

/* ---- PyTorch allocator ----
 * The entry points torch.cuda.memory.CUDAPluggableAllocator loads. Each device's
 * memory comes from an exportable cudapool pool made at its first allocation, with the
 * options of cudapool_torch_configure (else from $CUDAPOOL_TORCH_MAX_SIZE,
 * $CUDAPOOL_TORCH_CACHE (bytes) and $CUDAPOOL_TORCH_HANDLE_TYPE: "posix-fd", "none" or
 * "fabric"). A tensor allocated
 * there can be published with cudapool_exporter_publish. */
void *cudapool_torch_malloc(ssize_t size, int device, void *stream);
void cudapool_torch_free(void *ptr, ssize_t size, int device, void *stream);
/* cudapool_torch_configure sets the options of the pools not yet made. */
int cudapool_torch_configure(const cudapool_pool_options *opts);
/* cudapool_torch_pool returns the handle of device's pool (making it if need be). */
int cudapool_torch_pool(int device, uint64_t *pool);

#ifdef __cplusplus
}
#endif
#endif /* CUDAPOOL_H */
