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
 *  - Objects are handles: cudapool_pool, cudapool_exporter, cudapool_importer,
 *    cudapool_mapping, cudapool_chunk, cudapool_reservation, ..., each a struct of one
 *    opaque 64-bit value (never 0), passed by value, returned through a pointer. Each
 *    kind is its own type, so passing one where another is wanted does not compile. A
 *    handle that was closed, released or never issued fails with CUDAPOOL_EHANDLE; it
 *    never crashes the process. So a second close changes nothing and returns
 *    CUDAPOOL_EHANDLE, which a caller may ignore (as close(2)'s EBADF); a second
 *    release of a mapping is a bug and returns the same (of a KV lease,
 *    CUDAPOOL_ESTALE). Python's bindings return None for the second close and raise for
 *    the second release; Go returns ErrClosed and ErrReleased.
 *  - Options are structs whose first field, size, is sizeof the struct the caller was
 *    compiled with: fill one with its *_default function (a static inline here, which
 *    sets size), then set what you need. The library reads only the fields that size
 *    covers and refuses a size it cannot read, so a program built against an older
 *    header keeps working with a newer library. NULL options are the defaults.
 *  - Device memory is a plain pointer (void *); streams are cudaStream_t passed as
 *    void * (NULL is the legacy default stream).
 *  - Calls that wait take timeout_ms: the most they wait, in milliseconds. 0 means no
 *    bound (Python's timeout=None). CUDAPOOL_NO_WAIT (-1) means do not wait for
 *    anything to change (Python's timeout=0): the wait flags are off for the call
 *    (CUDAPOOL_DIAL_WAIT_FOR_EXPORTER, CUDAPOOL_OPEN_WAIT_FOR_NAME,
 *    CUDAPOOL_KV_WAIT_FOR_OWNER), so what is not there fails at once as without them,
 *    and the rest, a live peer's answer or a free a wait_for_memory pool waits for, is
 *    bounded by one second. Other negative values fail with CUDAPOOL_EINVAL. A
 *    call that runs out of time fails with CUDAPOOL_ETIMEOUT and holds nothing;
 *    cudapool_exporter_close is the one exception, CUDAPOOL_EABANDONED, which says
 *    what it left behind.
 *  - Sizes, lengths and counts are unsigned and checked before anything is read: one
 *    over the call's limit (CUDAPOOL_MAX_BATCH, CUDAPOOL_KV_MAX_BATCH,
 *    CUDAPOOL_KV_MAX_NAMESPACE, CUDAPOOL_MAX_META, ...) or larger than the library can
 *    address (a SIZE_MAX length) fails with CUDAPOOL_EINVAL, and outputs are left as
 *    they were. An output's capacity larger than its buffer is the caller's word.
 *  - The library writes nothing to stderr or anywhere else unless asked: see
 *    cudapool_set_log.
 *  - The library holds a Go runtime, which cannot survive fork(): in a child forked
 *    after the library was loaded every call fails with CUDAPOOL_EFORK (the PyTorch
 *    allocator returns NULL) instead of hanging. Start workers with spawn or
 *    fork+exec.
 *  - The runtime (a GPU through libcudart, or cudapool's software device) is chosen
 *    once per process: by cudapool_init, else at the first call that needs it from
 *    $CUDAPOOL_RUNTIME. Unless one of them asks for "auto" or "test", it is the GPU:
 *    a broken CUDA install fails with CUDAPOOL_ENORUNTIME instead of running on the
 *    software device unnoticed.
 */
#ifndef CUDAPOOL_H
#define CUDAPOOL_H

#include <stddef.h>
#include <stdint.h>
#include <sys/types.h>

#ifdef __cplusplus
extern "C" {
#endif

/* timeout_ms: do not wait (see the conventions above). */
#define CUDAPOOL_NO_WAIT (-1)

/* The version of this header. A library of the same major version and a minor version
 * at least this one has every call declared here (cudapool_version). */
#define CUDAPOOL_VERSION_MAJOR 1
#define CUDAPOOL_VERSION_MINOR 2

enum cudapool_status {
	CUDAPOOL_OK = 0,
	CUDAPOOL_EINVAL = 1,     /* a bad argument: NULL pointer, size 0, bad name, ... */
	CUDAPOOL_EHANDLE = 2,    /* a handle that is closed, released or was never issued */
	CUDAPOOL_EPOINTER = 3,   /* a device pointer no cudapool pool gave (or freed) */
	CUDAPOOL_ECLOSED = 4,    /* the object is closed or closing */
	CUDAPOOL_ENOMEM = 5,     /* the pool or device is out of memory */
	CUDAPOOL_ENOTFOUND = 6,  /* no buffer is published under that name (its buffer freed, or never published), or no such peer */
	CUDAPOOL_EEXIST = 7,     /* the name is published already, or the socket path is taken */
	CUDAPOOL_EBUSY = 8,      /* the pool has live buffers (close without force) */
	CUDAPOOL_EGONE = 9,      /* the exporter (or the KV owner) is gone */
	CUDAPOOL_EREFUSED = 10,  /* the exporter (or KV owner) refused this process */
	CUDAPOOL_EVERSION = 11,  /* the peer speaks another protocol version */
	CUDAPOOL_EPROTOCOL = 12, /* the peer broke the protocol, or found a request malformed */
	CUDAPOOL_ETIMEOUT = 13,  /* timeout_ms ran out; the call holds nothing */
	CUDAPOOL_ERANGE = 14,    /* an output buffer is too small; the size needed is given */
	CUDAPOOL_ENORUNTIME = 15,/* no runtime: none loads, or another was chosen already */
	CUDAPOOL_ECUDA = 16,     /* the CUDA runtime failed */
	CUDAPOOL_EFORK = 17,     /* this process was forked after the library was loaded */
	CUDAPOOL_ENOTSUP = 18,   /* the request is valid but not supported here */
	CUDAPOOL_EINTERNAL = 19, /* a bug in cudapool: please report the message */
	CUDAPOOL_EIO = 20,       /* the system failed: a socket, a file, a process */
	CUDAPOOL_ESTREAMDEVICE = 21, /* a stream of another device than the importer's */
	CUDAPOOL_EDUPLICATE = 22,    /* this process has an importer for that exporter already */
	CUDAPOOL_ETOOMANY = 23,      /* the connection holds as many grants as the exporter allows,
	                              * or a KV owner's cap is full (connections, leases, events) */
	CUDAPOOL_ELOST = 24,         /* the mapping's exporter is gone and it lives on another GPU:
	                              * reading it would lose this process's CUDA context */
	CUDAPOOL_EEXPORTER = 25,     /* the exporter failed to serve the request (its message) */
	CUDAPOOL_EABANDONED = 26,    /* exporter_close ran out of time: the exporter is closed, and
	                              * each buffer still held is freed once its consumer lets go */
	CUDAPOOL_ESTALE = 27,        /* a lease id the exporter or KV owner does not hold: released
	                              * already, another's, or never issued */
	CUDAPOOL_EBADDIR = 28,       /* the announce directory is not private to this user */
	CUDAPOOL_ENOSPACE = 29       /* the KV pool has not enough free or evictable pages */
};

/* cudapool_last_error is the message of this thread's last failed call, "" if the
 * last call succeeded. The string stays valid until this thread's next call. */
const char *cudapool_last_error(void);
/* cudapool_status_name names a status code, e.g. "CUDAPOOL_EHANDLE". */
const char *cudapool_status_name(int status);

/* cudapool_version gives the library's version (CUDAPOOL_VERSION_* of the header it was
 * built with); either output may be NULL. */
int cudapool_version(int *major, int *minor);
/* cudapool_protocol_version is the version of the sharing protocol this library speaks;
 * metadata travels with a publish from version 2 on. */
int cudapool_protocol_version(int *version);

/* ---- Handles ---- */

typedef struct { uint64_t h; } cudapool_pool;
typedef struct { uint64_t h; } cudapool_exporter;
typedef struct { uint64_t h; } cudapool_importer;
typedef struct { uint64_t h; } cudapool_mapping;
typedef struct { uint64_t h; } cudapool_chunk;       /* the VMM route, below */
typedef struct { uint64_t h; } cudapool_reservation; /* the VMM route, below */

/* ---- Logging ---- */

/* The levels of the library's messages (slog's). */
enum cudapool_log_level {
	CUDAPOOL_LOG_DEBUG = -4,
	CUDAPOOL_LOG_INFO = 0,
	CUDAPOOL_LOG_WARN = 4,
	CUDAPOOL_LOG_ERROR = 8,
	CUDAPOOL_LOG_OFF = 127 /* the default: nothing is written */
};
/* A cudapool_log_fn receives one message (without a newline) and the arg it was set
 * with. It may be called from any thread, also while a cudapool call runs on another;
 * it must not call the library. */
typedef void (*cudapool_log_fn)(int level, const char *msg, void *arg);
/* cudapool_set_log sends the events no call returns (a connection refused or cut,
 * cleanup that failed) at level or above to fn, or to stderr if fn is NULL.
 * CUDAPOOL_LOG_OFF, the default, drops them. */
int cudapool_set_log(int level, cudapool_log_fn fn, void *arg);

/* ---- Runtime ---- */

/* cudapool_init chooses the runtime: prefer is "gpu" (the real runtime and a visible
 * GPU), "auto" (a GPU when a CUDA runtime loads and sees one, else the software device,
 * and why says so) or "test" (the software device). NULL is $CUDAPOOL_RUNTIME, else
 * "gpu". The software device is in a library built with -tags cudapool_softdevice
 * only; without it "test", and "auto" without a GPU, fail with CUDAPOOL_ENORUNTIME. It
 * writes a sentence saying which and why into why (if not NULL; cut to why_len). A
 * second call with the same preference succeeds; with another it fails with
 * CUDAPOOL_ENORUNTIME. */
int cudapool_init(const char *prefer, char *why, size_t why_len);
/* cudapool_runtime_info says which runtime is in use (choosing it if none is):
 * *on_gpu is 1 for the real runtime, *devices the device count. */
int cudapool_runtime_info(int *on_gpu, int *devices, char *name, size_t name_len);

/* Streams and copies, for programs without the CUDA headers (and the software device,
 * whose memory only its own calls reach). */
int cudapool_stream_create(int device, void **stream);
/* cudapool_stream_destroy destroys a stream of cudapool_stream_create; every KV replica
 * that sealed or released on it takes its last record of it first, so that its close
 * still covers the stream's work without naming the destroyed stream. */
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

/* The options of pool.New. Fill with cudapool_pool_options_default (a zeroed struct has
 * no size and is refused; its handle type would be NONE, a pool no one can share). */
typedef struct {
	size_t size;                /* sizeof(cudapool_pool_options), set by _default */
	const char *name;           /* NULL: a made-up name */
	int handle_type;            /* CUDAPOOL_HANDLE_*; the default is POSIX_FD */
	uint64_t max_size;          /* 0: the device's memory */
	uint64_t release_threshold; /* used when has_release_threshold */
	int has_release_threshold;
	int wait_for_memory;        /* alloc on a full pool waits for a free (up to its timeout) */
	const int *peer_devices;    /* devices that may access the pool's memory */
	int peer_count;
	uint64_t cache_bytes;       /* freed buffers kept for reuse on their stream; 0: none */
} cudapool_pool_options;

/* cudapool_pool_options_init fills the size bytes at o with pool.New's defaults;
 * call it through cudapool_pool_options_default. */
int cudapool_pool_options_init(cudapool_pool_options *o, size_t size);
static inline int cudapool_pool_options_default(cudapool_pool_options *o) {
	return cudapool_pool_options_init(o, sizeof *o);
}

int cudapool_pool_create(int device, const cudapool_pool_options *opts, cudapool_pool *pool);

typedef struct {
	int device;
	int handle_type;
	uint64_t max_size, granularity;
	uint64_t reserved_current, reserved_high, used_current, used_high; /* the driver's */
	uint64_t live_buffers, bytes_requested, bytes_reserved;
	uint64_t shared_buffers, active_leases, deferred_frees, failed_frees;
	uint64_t cached_buffers, cached_bytes; /* kept for reuse (cache_bytes) */
} cudapool_pool_stats;

int cudapool_pool_stats_get(cudapool_pool pool, cudapool_pool_stats *stats);
/* cudapool_pool_close destroys the pool. Without force it fails with CUDAPOOL_EBUSY
 * while buffers are live; with force it frees them (buffers other processes still hold
 * are left allocated until the process exits). The handle is spent either way but
 * for EBUSY and ETIMEOUT. */
int cudapool_pool_close(cudapool_pool pool, int force, int64_t timeout_ms);

/* cudapool_alloc returns at least size bytes of the pool's device memory, ready for
 * work queued on stream after the call. A pool with wait_for_memory waits up to
 * timeout_ms for a free when it is full; a request larger than the pool's max_size
 * fails at once with CUDAPOOL_ENOMEM. */
int cudapool_alloc(cudapool_pool pool, uint64_t size, void *stream, int64_t timeout_ms, void **ptr);
/* cudapool_free returns ptr (from cudapool_alloc or the PyTorch allocator) once the
 * work queued on stream before the call has completed; other processes' leases
 * defer the real free until they release. */
int cudapool_free(void *ptr, void *stream);

/* ---- Exporter (producer) ---- */

/* The flags of cudapool_listen_options. */
enum cudapool_listen_flags {
	/* Consumers keep a buffer's import after they release it, so that leasing the same
	 * memory again (a buffer recycled through a pool's cache) costs no import and no
	 * free; the exporter revokes such imports before the memory goes back to the driver. */
	CUDAPOOL_LISTEN_RETAIN_IMPORTS = 1,
	/* No announcement for poolstat. */
	CUDAPOOL_LISTEN_NO_ANNOUNCE = 2,
	/* The socket admits whom the policy admits (mode 0660 with the one group, 0666 for
	 * other users or several groups) instead of this user alone (0600). */
	CUDAPOOL_LISTEN_SOCKET_FOLLOWS_POLICY = 4
};

/* The options of cudapool_exporter_listen. Fill with cudapool_listen_options_default. */
typedef struct {
	size_t size;             /* sizeof(cudapool_listen_options), set by _default */
	const char *name;        /* the process name it gives poolstat; NULL: the program's */
	int flags;               /* CUDAPOOL_LISTEN_* */
	/* The policy: with neither list set, processes of this user; with one set, exactly
	 * the processes whose uid or (primary) gid is listed. */
	const uint32_t *allow_uids;
	size_t uid_count;
	const uint32_t *allow_gids;
	size_t gid_count;
	int max_grants;          /* grants one connection may hold; 0: the default, 65536 */
} cudapool_listen_options;

int cudapool_listen_options_init(cudapool_listen_options *o, size_t size);
static inline int cudapool_listen_options_default(cudapool_listen_options *o) {
	return cudapool_listen_options_init(o, sizeof *o);
}

/* cudapool_exporter_listen creates an exporter on a new Unix socket at path (mode
 * 0600 unless the options say otherwise) and announces it for poolstat. */
int cudapool_exporter_listen(const char *path, const cudapool_listen_options *opts,
                             cudapool_exporter *exporter);
/* cudapool_exporter_publish makes the memory at [ptr, ptr+size) available under
 * name, ready once the work queued on stream before the call has completed. ptr must
 * lie in memory of a cudapool pool (cudapool_alloc, the PyTorch allocator);
 * size 0 means to the end of its buffer. ptr may lie inside a buffer (a tensor that
 * PyTorch carved out of a segment): consumers get that range, not aligned to anything.
 * They can read the rest of the pool all the same: the pool is the unit of trust. meta
 * (meta_len bytes, at most CUDAPOOL_MAX_META) travels to every consumer. */
#define CUDAPOOL_MAX_NAME 255
#define CUDAPOOL_MAX_META 4096
int cudapool_exporter_publish(cudapool_exporter exporter, const char *name, const void *ptr,
                              uint64_t size, void *stream, const void *meta, size_t meta_len);
/* One name for cudapool_exporter_publish_all: what cudapool_exporter_publish takes besides
 * the exporter and the stream. */
typedef struct {
	const char *name;
	const void *ptr;
	uint64_t size;
	const void *meta;
	size_t meta_len;
} cudapool_publish_entry;
/* cudapool_exporter_publish_all publishes n entries at once, each ready once the work
 * queued on stream before the call has completed; their buffers are on one device. It
 * publishes all of them or, with the error of the first that fails, none. At most
 * CUDAPOOL_MAX_BATCH. */
#define CUDAPOOL_MAX_BATCH 1024
int cudapool_exporter_publish_all(cudapool_exporter exporter, const cudapool_publish_entry *entries,
                                  size_t n, void *stream);
int cudapool_exporter_unpublish(cudapool_exporter exporter, const char *name);
/* cudapool_exporter_push leases the buffer published under name to process pid. */
int cudapool_exporter_push(cudapool_exporter exporter, int pid, const char *name, int64_t timeout_ms);
/* cudapool_exporter_state writes the exporter's state as JSON (poolstat's schema). On
 * CUDAPOOL_ERANGE *len is the size needed. */
int cudapool_exporter_state(cudapool_exporter exporter, char *buf, size_t cap, size_t *len);
/* cudapool_exporter_close stops sharing and waits up to timeout_ms for consumers to
 * release what they hold. If they do not, it fails with CUDAPOOL_EABANDONED: the
 * exporter is closed all the same (the handle is spent), and each buffer still held goes
 * back to its pool once its consumer releases it or exits. */
int cudapool_exporter_close(cudapool_exporter exporter, int64_t timeout_ms);

/* cudapool_query_state asks the exporter at socket for its state, as poolstat does. */
int cudapool_query_state(const char *socket, int64_t timeout_ms, char *buf, size_t cap, size_t *len);

/* ---- Importer (consumer) ---- */

/* The flags of cudapool_dial_options. */
enum cudapool_dial_flags {
	/* Wait (up to timeout_ms) for an exporter to listen at the path, instead of failing
	 * with CUDAPOOL_EGONE: for replicas started before their producer. */
	CUDAPOOL_DIAL_WAIT_FOR_EXPORTER = 1
};
typedef struct {
	size_t size; /* sizeof(cudapool_dial_options), set by _default */
	int flags;   /* CUDAPOOL_DIAL_* */
} cudapool_dial_options;
int cudapool_dial_options_init(cudapool_dial_options *o, size_t size);
static inline int cudapool_dial_options_default(cudapool_dial_options *o) {
	return cudapool_dial_options_init(o, sizeof *o);
}

/* cudapool_importer_dial connects to the exporter at path, for mappings on device. A
 * process has one importer per exporter (CUDAPOOL_EDUPLICATE otherwise), and cannot
 * import its own exports (CUDAPOOL_ENOTSUP: use the buffer's pointer). */
int cudapool_importer_dial(const char *path, int device, const cudapool_dial_options *opts,
                           int64_t timeout_ms, cudapool_importer *importer);

/* The flags of cudapool_open_options. */
enum cudapool_open_flags {
	/* Wait (up to timeout_ms) for the name to be published, instead of failing with
	 * CUDAPOOL_ENOTFOUND. */
	CUDAPOOL_OPEN_WAIT_FOR_NAME = 1,
	/* Copy the buffer into memory of the importer's own device (a local copy) and give
	 * the lease back at once: the mapping then outlives its producer on any GPU (never
	 * CUDAPOOL_ELOST). The copy comes from replica_pool, or (replica_pool.h 0) from a
	 * pool the importer makes. replica_pool must let the exporter's device access it
	 * (peer_devices). */
	CUDAPOOL_OPEN_LOCAL_COPY = 2,
	/* CUDAPOOL_OPEN_LOCAL_COPY's former name, kept for existing sources ("replica" now
	 * names only the KV pool's processes). */
	CUDAPOOL_OPEN_REPLICA = CUDAPOOL_OPEN_LOCAL_COPY
};
typedef struct {
	size_t size;                /* sizeof(cudapool_open_options), set by _default */
	int flags;                  /* CUDAPOOL_OPEN_* */
	cudapool_pool replica_pool; /* the local copy's pool, with CUDAPOOL_OPEN_LOCAL_COPY (the
	                             * field keeps its name for the ABI); h 0: the importer's own */
} cudapool_open_options;
int cudapool_open_options_init(cudapool_open_options *o, size_t size);
static inline int cudapool_open_options_default(cudapool_open_options *o) {
	return cudapool_open_options_init(o, sizeof *o);
}

/* cudapool_importer_open leases the buffer published under name and maps it; work
 * queued on stream (of the importer's device: CUDAPOOL_ESTREAMDEVICE otherwise) after
 * the call sees the producer's writes. Each open needs its release. */
int cudapool_importer_open(cudapool_importer importer, const char *name, void *stream,
                           const cudapool_open_options *opts, int64_t timeout_ms,
                           cudapool_mapping *mapping);
/* cudapool_importer_open_all opens n names (at most CUDAPOOL_MAX_BATCH) in one round
 * trip, into mappings[0..n): all of them, or none with the error of the first that
 * failed. */
int cudapool_importer_open_all(cudapool_importer importer, const char *const *names, size_t n,
                               void *stream, int64_t timeout_ms, cudapool_mapping *mappings);
/* cudapool_importer_release_all releases n mappings of the importer in one round trip,
 * once the work queued on stream before the call has completed. A handle listed twice
 * fails with CUDAPOOL_EINVAL and releases nothing. The handles are spent, also when
 * the exporter refuses some (the others are released all the same). */
int cudapool_importer_release_all(cudapool_importer importer, const cudapool_mapping *mappings,
                                  size_t n, void *stream, int64_t timeout_ms);
/* cudapool_importer_done_fd gives a file descriptor that becomes readable (poll, select,
 * epoll: POLLIN, then end of file) once the connection to the exporter has ended: its
 * process exited, crashed or closed. It is the importer's: do not close it, nor use it
 * after cudapool_importer_close. */
int cudapool_importer_done_fd(cudapool_importer importer, int *fd);
/* cudapool_importer_err returns CUDAPOOL_OK while the exporter is there, and
 * CUDAPOOL_EGONE, with why in cudapool_last_error, once it is gone. */
int cudapool_importer_err(cudapool_importer importer);
/* cudapool_importer_close frees what is still mapped (release first) and says goodbye. */
int cudapool_importer_close(cudapool_importer importer, int64_t timeout_ms);

/* cudapool_mapping_info: the mapped range's address in this process, its size and the
 * length of its metadata; any output may be NULL. */
int cudapool_mapping_info(cudapool_mapping mapping, void **ptr, uint64_t *size, size_t *meta_len);
/* cudapool_mapping_meta copies the metadata published with the buffer. On
 * CUDAPOOL_ERANGE *len is the size needed. */
int cudapool_mapping_meta(cudapool_mapping mapping, void *buf, size_t cap, size_t *len);
/* cudapool_mapping_err returns CUDAPOOL_OK while the mapping may be read, and
 * CUDAPOOL_ELOST once it must not be: its exporter is gone and it lives on another GPU
 * (stop the work that reads it, then release it: that frees the import without touching
 * the memory). It turns ELOST once the kernel says the exporter's process exited, which
 * can be a moment after the done descriptor turned readable: a consumer on another GPU
 * stops reading at the first of the two. */
int cudapool_mapping_err(cudapool_mapping mapping);
/* cudapool_mapping_release gives the mapping back once the work queued on stream
 * before the call has completed. The handle is spent. */
int cudapool_mapping_release(cudapool_mapping mapping, void *stream, int64_t timeout_ms);

/* ---- VMM route ----
 * Device memory made as chunks (cuMemCreate) rather than in a pool, shared as file
 * descriptors (or FABRIC handles) and mapped one behind the other into one range of
 * addresses: what a pool cannot share (one import of more than about 4.5 GiB), a chunk
 * can, and a consumer maps an allocation of many chunks as one range. The producer
 * makes the chunks (cudapool_chunk_create), maps them into a reservation of its own to
 * write them (cudapool_reservation_create, _grow; the address is
 * cudapool_reservation_info's ptr) and publishes them
 * (cudapool_exporter_publish_chunks). A consumer opens the name with
 * cudapool_importer_open as any other: its mapping is the whole allocation (or the
 * published range of it), one range, whatever the number of chunks.
 *
 * Who holds the memory: a chunk's memory lives while a handle, a mapping or a
 * descriptor of it remains, here or in another process. The exporter takes a
 * descriptor of each chunk at publish and keeps it until the name is unpublished (or
 * the exporter closed); a consumer's mapping holds it until its release. So once
 * published, the producer may close its chunks and, once the work queued on its
 * mapping has run (cudapool_stream_synchronize), its reservation: that unmaps the
 * producer's range only. cudapool_reservation_close (and _shrink) unmaps; nothing else
 * does.
 *
 * Sizes are positive multiples of cudapool_vmm_granularity (2 MiB on an H200):
 * another size fails with CUDAPOOL_EINVAL. A runtime without the VMM route fails with
 * CUDAPOOL_ENOTSUP. */

/* The flags of cudapool_chunk_create and cudapool_vmm_granularity. */
enum cudapool_chunk_flags {
	/* The chunk can travel as a FABRIC handle too (to a consumer on a byte stream, or
	 * on another node of an NVLink fabric). The driver refuses it on a host without an
	 * IMEX channel (nvidia-imex): CUDAPOOL_ENOTSUP. */
	CUDAPOOL_CHUNK_FABRIC = 1
};

/* cudapool_vmm_granularity: the size every chunk and reservation of device made with
 * flags (CUDAPOOL_CHUNK_*) is a multiple of. */
int cudapool_vmm_granularity(int device, int flags, uint64_t *granularity);
/* cudapool_chunk_create makes a chunk of size bytes of device memory on device,
 * unmapped: map it into a reservation to reach it. flags: CUDAPOOL_CHUNK_*. On failure
 * nothing is made. */
int cudapool_chunk_create(int device, uint64_t size, int flags, cudapool_chunk *chunk);
/* cudapool_chunk_info: the chunk's device, size and whether it has a FABRIC handle (1
 * or 0); any output may be NULL. */
int cudapool_chunk_info(cudapool_chunk chunk, int *device, uint64_t *size, int *fabric);
/* cudapool_chunk_close gives up this handle of the chunk; its memory lives on while a
 * reservation maps it or an exporter publishes it. The handle is spent, also on
 * failure. */
int cudapool_chunk_close(cudapool_chunk chunk);

/* cudapool_reservation_create reserves size bytes of addresses on device, readable and
 * writable from it, with nothing mapped. */
int cudapool_reservation_create(int device, uint64_t size, cudapool_reservation *reservation);
/* cudapool_reservation_grow maps n chunks (of the reservation's device), whole and in
 * order, behind what is mapped: the mapped part, from ptr on, grows by their sizes,
 * the bytes already mapped unchanged. Chunks that do not fit fail with CUDAPOOL_EINVAL.
 * On failure nothing of this call stays mapped. The chunks may be closed afterwards. */
int cudapool_reservation_grow(cudapool_reservation reservation, const cudapool_chunk *chunks, size_t n);
/* cudapool_reservation_shrink unmaps the last n mapped chunks (more than are mapped:
 * CUDAPOOL_EINVAL, nothing unmapped). Work queued that touches them must have run. */
int cudapool_reservation_shrink(cudapool_reservation reservation, size_t n);
/* cudapool_reservation_info: the reservation's address in this process (it never
 * moves), the bytes reserved, the bytes mapped from ptr on and the chunks mapped; any
 * output may be NULL. */
int cudapool_reservation_info(cudapool_reservation reservation, void **ptr, uint64_t *reserved,
                              uint64_t *mapped, size_t *chunks);
/* cudapool_reservation_close unmaps every chunk and frees the addresses. Work queued
 * that touches them must have run. The handle is spent, also on failure. */
int cudapool_reservation_close(cudapool_reservation reservation);

/* cudapool_exporter_publish_chunks makes the allocation of n chunks (at most
 * CUDAPOOL_MAX_CHUNKS, of one device; chunk i lies behind chunk i-1, as
 * cudapool_reservation_grow maps them) available under name, as
 * cudapool_exporter_publish does a pool's memory: ready once the work queued on stream
 * before the call has completed, meta (meta_len bytes, at most CUDAPOOL_MAX_META) sent
 * to every consumer. [offset, offset+size) is the range published; size 0 means to the
 * end. The exporter keeps a descriptor of every chunk until the name is unpublished,
 * so the chunks' handles may be closed. Each call publishes an allocation of its own.
 * Chunks made with CUDAPOOL_CHUNK_FABRIC on a host without an IMEX channel fail with
 * CUDAPOOL_ENOTSUP; on failure nothing is published. */
#define CUDAPOOL_MAX_CHUNKS 4096
int cudapool_exporter_publish_chunks(cudapool_exporter exporter, const char *name, const cudapool_chunk *chunks,
                                     size_t n, uint64_t offset, uint64_t size, void *stream, const void *meta,
                                     size_t meta_len);
/* One name for cudapool_exporter_publish_chunks_all: its range of the allocation
 * (size 0: to the end) and its metadata. */
typedef struct {
	const char *name;
	uint64_t offset;
	uint64_t size;
	const void *meta;
	size_t meta_len;
} cudapool_chunk_entry;
/* cudapool_exporter_publish_chunks_all publishes one allocation of n chunks (as
 * cudapool_exporter_publish_chunks) under the n_entries names of entries (at most
 * CUDAPOOL_MAX_BATCH), each for its range, all ready once the work queued on stream
 * before the call has completed. A consumer maps the allocation once, however many of
 * its names it opens: their mappings lie in one range, at their offsets. The exporter
 * keeps the chunks' descriptors until the last of the names is unpublished. It
 * publishes all the entries or, with the error of the first that fails, none. */
int cudapool_exporter_publish_chunks_all(cudapool_exporter exporter, const cudapool_chunk *chunks, size_t n,
                                         const cudapool_chunk_entry *entries, size_t n_entries, void *stream);

/* ---- PyTorch allocator ----
 * The entry points torch.cuda.memory.CUDAPluggableAllocator loads. Each device's
 * memory comes from an exportable cudapool pool made at its first allocation, with the
 * options of cudapool_torch_configure (else from $CUDAPOOL_TORCH_MAX_SIZE,
 * $CUDAPOOL_TORCH_CACHE (bytes) and $CUDAPOOL_TORCH_HANDLE_TYPE: "posix-fd", "none" or
 * "fabric"). A tensor allocated there can be published with cudapool_exporter_publish.
 * The allocator never waits for memory: a full pool returns NULL (torch raises). */
void *cudapool_torch_malloc(ssize_t size, int device, void *stream);
void cudapool_torch_free(void *ptr, ssize_t size, int device, void *stream);
/* cudapool_torch_configure sets the options of the pools not yet made. */
int cudapool_torch_configure(const cudapool_pool_options *opts);
/* cudapool_torch_pool returns the handle of device's pool (making it if need be). */
int cudapool_torch_pool(int device, cudapool_pool *pool);

/* ---- KV pages ----
 * A replica of a KV page pool's owner (cmd/kvpoold): the owner's slab for one device,
 * mapped once, and leases of its pages by index. The slab is the unit of trust: every
 * replica can read and write all of it (see cudapool_kv_dial). Each layer's K (and V)
 * is one [pages, tokens_per_page, kv_heads, head_dim] tensor, row-major and
 * contiguous, and a page index names the same block in every layer. The slab is on the
 * VMM route: one range of addresses per tensor (a region: K0, V0, K1, V1, ...;
 * cudapool_kv_regions lists them), whatever its size, into which the owner's chunks
 * are mapped as the slab grows; the
 * pages a lease names are always mapped: cudapool_kv_layer_ptrs says where each
 * layer's K and V begin.
 *  - alloc leases free (or evicted) pages for writing, all or none (CUDAPOOL_ENOSPACE);
 *  - seal publishes written pages under their prefix hashes, visible to every replica
 *    once the work queued on the stream before the seal has completed; the write
 *    lease ends either way;
 *  - match leases for reading the longest run of visible pages for a list of hashes;
 *  - release gives leases back once the work queued on the stream before the call has
 *    completed.
 * A lease id the owner does not hold for this replica (released or sealed already,
 * another replica's, never issued) fails with CUDAPOOL_ESTALE; once the owner is gone
 * every call that needs it fails with CUDAPOOL_EGONE. Counts over
 * CUDAPOOL_KV_MAX_BATCH, and requests that do not fit the geometry, fail with
 * CUDAPOOL_EINVAL, as do NULL outputs; an owner's reply with more pages than asked for,
 * or a page the slab does not have, fails with CUDAPOOL_EPROTOCOL (nothing is written to
 * pages, and the lease goes back to the owner); a call refused so leases and releases nothing,
 * and a refused seal or release keeps its leases. A seal or release that ran out of
 * time (CUDAPOOL_ETIMEOUT) holds nothing: its leases are given back (after the
 * stream's work so far) whether or not the owner saw the call, and naming them again
 * fails with CUDAPOOL_ESTALE. */

typedef struct { uint64_t h; } cudapool_kv_replica;

#define CUDAPOOL_KV_HASH_BYTES 16  /* a prefix hash */
#define CUDAPOOL_KV_MAX_BATCH 4096 /* pages, hashes or leases in one request */
#define CUDAPOOL_KV_MAX_NAMESPACE 4096 /* bytes of a namespace (ns_len) */

enum cudapool_kv_dtype {
	CUDAPOOL_KV_BF16 = 1,
	CUDAPOOL_KV_FP16 = 2,
	CUDAPOOL_KV_FP32 = 3,
	CUDAPOOL_KV_FP8E4M3 = 4
};

/* The flags of cudapool_kv_dial. */
enum cudapool_kv_dial_flags {
	/* Wait (up to timeout_ms) for an owner that is not listening yet. */
	CUDAPOOL_KV_WAIT_FOR_OWNER = 1,
	/* Reattach by itself to an owner restarted on dir (kvpoold over its keeper): once
	 * the owner is lost, calls fail with CUDAPOOL_EGONE while the replica redials and
	 * re-declares its leases; then they work again, the slab mapped where it was. A
	 * lease the new owner did not take back is lost (cudapool_kv_lease_lost says why):
	 * its pages may be another's already, so do not read or write them; sealing or
	 * releasing it fails with CUDAPOOL_ESTALE and forgets it. A seal or release that
	 * failed with CUDAPOOL_EGONE leaves its lease held, re-declared to the restarted
	 * owner, which holds its pages until it is ended: make the call again once
	 * attached (cudapool_kv_wait_attached), or close the replica. */
	CUDAPOOL_KV_RECONNECT = 2
};

/* The geometry of a replica's slab. Set size to sizeof(cudapool_kv_geometry) before the
 * call: the library writes only the fields that fit in size, so that a program built
 * against an older, shorter struct keeps working. */
typedef struct {
	size_t size;
	int32_t layers, kv_heads, head_dim, tokens_per_page;
	int32_t dtype;      /* enum cudapool_kv_dtype */
	int32_t dtype_size; /* bytes per element */
	int32_t pages;      /* pages per slab */
	int32_t device;     /* the replica's device */
	uint64_t page_bytes; /* one layer's K (or V) of one page: the block a page index names */
	uint64_t slab_bytes; /* layers * 2 * pages * page_bytes */
	/* Since 1.2: the slab is `regions` regions (cudapool_kv_regions), one per tensor
	 * (K0, V0, K1, V1, ...), of region_bytes bytes of addresses each, the first pages
	 * of which are mapped as the slab grows. */
	uint64_t region_bytes;
	int32_t regions;
	/* Since 1.1: one page in every layer's K and V, layers * 2 * page_bytes (kvpoold's
	 * "page span"). */
	uint64_t page_span_bytes;
} cudapool_kv_geometry;

/* cudapool_kv_dial connects to the owner serving dir (dir/kv.sock) and maps its slab
 * for device. ns (ns_len bytes, at most CUDAPOOL_KV_MAX_NAMESPACE;
 * may be NULL when 0) is the namespace the prefix hashes start from. It is no
 * boundary: the slab is the unit of trust, and every replica maps it whole, read-write,
 * whatever its namespace; run one owner (one dir) per trust domain. flags: CUDAPOOL_KV_*. With no owner there it fails
 * with CUDAPOOL_EGONE (CUDAPOOL_ETIMEOUT if it waited). */
int cudapool_kv_dial(const char *dir, int device, const char *ns, size_t ns_len, int flags,
                     int64_t timeout_ms, cudapool_kv_replica *out);
/* cudapool_kv_geometry_get: the geometry of the replica's slab. */
int cudapool_kv_geometry_get(cudapool_kv_replica r, cudapool_kv_geometry *out);
/* cudapool_kv_layer_ptrs (since 1.1): where layer's K and V tensors begin in this
 * process, on the replica's device: each [pages][tokens_per_page][kv_heads][head_dim] of
 * the geometry's dtype, contiguous, page p of it page_bytes * p further on. Either
 * output may be NULL. A layer outside [0, layers) is CUDAPOOL_EINVAL. */
int cudapool_kv_layer_ptrs(cudapool_kv_replica r, int32_t layer, void **k, void **v);
/* cudapool_kv_regions (since 1.2): the slab's regions in this process, in order (K0,
 * V0, K1, V1, ...; region 2 * layer + 0 is layer's K, 2 * layer + 1 its V): their
 * addresses into ptrs and the addresses each reserves (region_bytes) into bytes (either
 * may be NULL), which have room for cap; *n is their number. On CUDAPOOL_ERANGE nothing
 * is written and *n is the number needed. */
int cudapool_kv_regions(cudapool_kv_replica r, void **ptrs, uint64_t *bytes, size_t cap, size_t *n);
/* cudapool_kv_slab: fails with CUDAPOOL_ENOTSUP: since 1.2 no slab is one range.
 * Deprecated since 1.1: use cudapool_kv_layer_ptrs. */
int cudapool_kv_slab(cudapool_kv_replica r, void **base, uint64_t *bytes);
/* cudapool_kv_hashes writes the prefix hash of each full page of tokens
 * (n_tokens / tokens_per_page of them, CUDAPOOL_KV_HASH_BYTES each) into hashes_out,
 * which has room for cap_hashes; *n_hashes is their number. On CUDAPOOL_ERANGE
 * nothing is written and *n_hashes is the number needed. n_tokens of 2^29 or more (2 GiB of
 * tokens) fails with CUDAPOOL_EINVAL, *n_hashes untouched. */
int cudapool_kv_hashes(cudapool_kv_replica r, const int32_t *tokens, size_t n_tokens, uint8_t *hashes_out,
                       size_t cap_hashes, size_t *n_hashes);
/* cudapool_kv_prefix_hashes is cudapool_kv_hashes without a replica: the prefix hashes
 * of namespace ns (ns_len bytes, at most 65,536) for pages of tokens_per_page tokens
 * (n_tokens at most 2^32). It needs no runtime and no owner. */
int cudapool_kv_prefix_hashes(const char *ns, size_t ns_len, const int32_t *tokens, size_t n_tokens,
                              uint32_t tokens_per_page, uint8_t *hashes_out, size_t cap_hashes, size_t *n_hashes);
/* cudapool_kv_alloc leases n pages for writing: their indices go to pages (room for
 * n) and the lease's id to *lease. */
int cudapool_kv_alloc(cudapool_kv_replica r, uint32_t n, int64_t timeout_ms, uint64_t *lease,
                      uint32_t *pages);
/* cudapool_kv_seal publishes the first n pages of the write lease under hashes (n of
 * them; fewer than the lease's pages frees the rest), visible once the work queued on
 * stream before the call has completed. With wait it returns once they are visible.
 * *visible is the number visible on return, *duplicates the number whose hash was
 * visible already (those pages are freed); either may be NULL. */
int cudapool_kv_seal(cudapool_kv_replica r, uint64_t lease, const uint8_t *hashes, size_t n, void *stream,
                     int wait, int64_t timeout_ms, uint32_t *visible, uint32_t *duplicates);
/* cudapool_kv_match leases for reading the longest run of visible pages under hashes[0],
 * hashes[1], ...: *n_pages pages (room for n) and the lease's id in *lease, 0 when
 * none is visible (no lease then). Work queued on any stream after the call may read
 * them. stream is not used (the match queues nothing: the pages' writes completed
 * before they became visible); it is kept so that the ABI stays, and may be NULL. */
int cudapool_kv_match(cudapool_kv_replica r, const uint8_t *hashes, size_t n, void *stream, int64_t timeout_ms,
                      uint64_t *lease, uint32_t *pages, size_t *n_pages);
/* cudapool_kv_release gives back n leases (write or read) once the work queued on
 * stream before the call has completed. All or none: with one stale id, none is
 * released. */
int cudapool_kv_release(cudapool_kv_replica r, const uint64_t *leases, size_t n, void *stream,
                        int64_t timeout_ms);
/* cudapool_kv_done_fd: a file descriptor that becomes readable when the owner is gone
 * (for poll or epoll). It belongs to the replica: do not read or close it. */
int cudapool_kv_done_fd(cudapool_kv_replica r, int *fd);
/* cudapool_kv_alive: *alive is 1 while the owner is there, 0 once it is gone (with
 * CUDAPOOL_KV_RECONNECT: 1 again once reattached). The done fd tells the first loss only. */
int cudapool_kv_alive(cudapool_kv_replica r, int *alive);
/* cudapool_kv_reattaches: *n counts the times the replica reattached to a restarted
 * owner (CUDAPOOL_KV_RECONNECT). */
int cudapool_kv_reattaches(cudapool_kv_replica r, uint64_t *n);
/* cudapool_kv_wait_attached waits, up to timeout_ms (0: no bound; CUDAPOOL_NO_WAIT: not
 * at all), until the replica is attached to
 * a live owner: CUDAPOOL_OK (at once while it is), CUDAPOOL_ETIMEOUT, or CUDAPOOL_EGONE
 * where no reattach can come (no CUDAPOOL_KV_RECONNECT, or the slab's keeper is gone). */
int cudapool_kv_wait_attached(cudapool_kv_replica r, int64_t timeout_ms);
/* cudapool_kv_lease_lost writes why an owner's restart lost lease, as text, or ""
 * while the replica holds it (CUDAPOOL_KV_RECONNECT). On CUDAPOOL_ERANGE *len is the
 * size needed. A lease the replica does not hold (sealed or released already, lost
 * and then sealed or released, never issued) fails with CUDAPOOL_ESTALE. */
int cudapool_kv_lease_lost(cudapool_kv_replica r, uint64_t lease, char *buf, size_t cap, size_t *len);
/* cudapool_kv_error writes why the owner is gone ("" while it is there), as text. On
 * CUDAPOOL_ERANGE *len is the size needed. */
int cudapool_kv_error(cudapool_kv_replica r, char *buf, size_t cap, size_t *len);
/* cudapool_kv_stats writes the owner's statistics as JSON: per device its pages by
 * state and its counters, per replica its leases. On CUDAPOOL_ERANGE *len is the size
 * needed. */
int cudapool_kv_stats(cudapool_kv_replica r, int64_t timeout_ms, char *buf, size_t cap, size_t *len);
/* cudapool_kv_query_stats writes, as cudapool_kv_stats does, the statistics of the owner
 * serving dir, asked as an observer: a connection that maps no slab and takes no leases,
 * so it needs no runtime and no replica (poolstat's view). It fails with CUDAPOOL_EGONE
 * if no owner serves dir; on CUDAPOOL_ERANGE *len is the size needed. */
int cudapool_kv_query_stats(const char *dir, int64_t timeout_ms, char *buf, size_t cap, size_t *len);
/* cudapool_kv_close gives back the replica's leases, unmaps the slab and hangs up. The
 * handle is spent. The leases still held end after the work queued so far on every
 * stream the replica has sealed or released on (as a release on those streams would),
 * so pages a kernel still writes are not given to another replica; work on a stream
 * the replica never sealed or released on is not covered: release such leases first.
 * Such a stream must not be destroyed before the close (the driver does not survive a
 * record on a destroyed stream), unless it is destroyed with cudapool_stream_destroy.
 * If timeout_ms passes while that work is still queued, it returns CUDAPOOL_ETIMEOUT
 * and the rest completes once the work has run. */
int cudapool_kv_close(cudapool_kv_replica r, int64_t timeout_ms);

#ifdef CUDAPOOL_SOFTDEVICE_TESTING
/* Test-only, and only in a library built with -tags cudapool_softdevice (capi/
 * softdevice.go): cudapool_test_stall_stream holds stream s of device dev of the
 * software device, so that work queued on it afterwards does not run, until
 * cudapool_test_resume(*token). It fails with CUDAPOOL_EINVAL where the library does
 * not run on the software device. A test sees by it that a call put its work on the
 * stream it was given, as Go tests do with cudarttest's Stall. No API for anything
 * else. */
int cudapool_test_stall_stream(int dev, uintptr_t s, uint64_t *token);
int cudapool_test_resume(uint64_t token);
#endif

#ifdef __cplusplus
}
#endif
#endif /* CUDAPOOL_H */
