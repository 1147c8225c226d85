// cref is the C reference of cudapool's benchmarks: the CUDA runtime calls that
// cudapool makes, in loops of the same shape as cudart/bench_test.go and the Go
// suite (bench/gosuite), so that what the Go layers cost shows as a ratio taken in
// one run on one host. It also measures the legacy per-allocation IPC path
// (cudaMalloc, cudaIpcGetMemHandle, cudaIpcOpenMemHandle, cudaIpcCloseMemHandle) on
// the same operations, as the suite's "legacy IPC" column.
//
// Its consumers follow the protocol cudapool's export package follows, call for
// call, so that a ratio between the two columns compares the same work (issue 13):
// an Open checks that the stream is on the consumer's device (cudaStreamGetDevice),
// asks the kernel whether the producer lives (a pidfd polled) before each use of its
// ready event, asks whether that event has completed and makes the stream
// wait on it only if not; a record this process freed before is imported again only
// once that free has completed (a second import would alias the first, FACTS 4): the
// release event is asked, and the release stream synchronized only if it has not; a
// Release records an event on the caller's stream, makes the release stream wait on
// it, frees the import there, records the release event there and tells the producer,
// whose release stream waits on that event only if it has not completed.
//
// Usage:
//
//	cref bench     cudart's benchmarks: "cref NAME NS_PER_OP" lines (scripts/gpu-check.sh)
//	cref all       the suite's sharing operations, import pairs and legacy allocations
//	cref alloc PLAN IN OUT READY ROUND BATCHES PAIRS
//	               one participant of the allocation ring (see alloc_ring)
//
// For cudart's benchmarks a line is the median over 15 batches of the time per
// operation, the batch's closing synchronize included, after one batch untimed to
// warm up. For the suite (scripts/bench-suite.sh, bench/table.py) every measurement
// prints
//
//	result IMPL OP UNIT MEDIAN P90 N
//	raw IMPL OP UNIT V1 V2 ...
//
// IMPL is c (stream-ordered pools, as cudapool uses them) or legacy; UNIT is us,
// GB/s or shares/s. Times come from CLOCK_MONOTONIC, which all processes of a host
// share, and copies are timed with CUDA events.
//
// Build: nvcc -O2 -cudart shared -o cref cref.cu
#include <cuda_runtime.h>
#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#define CHECK(call) \
	do { \
		cudaError_t e_ = (call); \
		if (e_ != cudaSuccess) { \
			fprintf(stderr, "cref[%d]: line %d: %s: %s\n", (int)getpid(), __LINE__, #call, cudaGetErrorName(e_)); \
			exit(1); \
		} \
	} while (0)
#ifndef SYS_pidfd_open
#define SYS_pidfd_open 434 // Linux 5.3
#endif

#define CHECK_SYS(ok, what) \
	do { \
		if (!(ok)) { \
			perror("cref: " what); \
			exit(1); \
		} \
	} while (0)

enum { BATCHES = 15, SYNC_EVERY = 10000, EXPORTS_PER_BATCH = 200, IMPORT_BUFFERS = 1000 };
// The suite's operations. cudapool rounds every buffer of an exportable pool to the
// 2 MiB granularity, so the buffers shared here are 2 MiB, in every column.
enum {
	CONSUMERS = 7,           // the most consumer processes fan-out uses
	OTHER = CONSUMERS,       // the index of one more consumer, on device 1
	SUSTAIN_CONSUMERS = 4,   // consumers of the sustained rate
	SAMPLES = 200,           // timed operations of a per-operation measurement
	WARMUP = 20,             // untimed operations before them
	FANOUT_REPS = 50,        // fan-outs per consumer count
	RING = 64,               // buffers that "already exported" cycles through
	LEGACY_PAIRS = 100,      // pairs per batch of cudaMalloc+cudaFree, 100x slower
	LEGACY_IMPORTS = 50,     // handles per batch of cudaIpcOpenMemHandle+Close
	SUSTAIN_ROUNDS = 5,      // windows of the sustained rate
	SUSTAIN_MS = 300,        // length of each window
	READ_COPIES = 20,        // timed copies of the bandwidth measurement
};
static const size_t MiB = 1 << 20;
static const size_t SHARE_SIZE = 2 << 20;
static const size_t READ_SIZE = (size_t)1 << 30;

static int bench_mode; // cref bench: cudart's lines instead of the suite's

static double now_ns(void) {
	struct timespec t;
	clock_gettime(CLOCK_MONOTONIC, &t);
	return t.tv_sec * 1e9 + t.tv_nsec;
}

static int by_value(const void *a, const void *b) {
	double x = *(const double *)a, y = *(const double *)b;
	return (x > y) - (x < y);
}

// summarize prints a measurement's result line (median and 90th percentile of v)
// and its raw line. v is sorted in place.
static void summarize(const char *impl, const char *op, const char *unit, double *v, int n) {
	if (n <= 0) {
		printf("fail %s %s no samples\n", impl, op);
		fflush(stdout);
		return;
	}
	qsort(v, n, sizeof v[0], by_value);
	int p90 = (int)(0.9 * (n - 1) + 0.5);
	printf("result %s %s %s %.4f %.4f %d\n", impl, op, unit, v[n / 2], v[p90], n);
	printf("raw %s %s %s", impl, op, unit);
	for (int i = 0; i < n; i++) printf(" %.4f", v[i]);
	printf("\n");
	fflush(stdout);
}

// report prints, in bench mode, a cudart benchmark's line (ns per operation, median
// of the batches), and otherwise, where suite_op is set, the suite's lines in
// microseconds.
static void report(const char *name, const char *suite_op, double per_op[BATCHES]) {
	qsort(per_op, BATCHES, sizeof per_op[0], by_value);
	if (bench_mode) printf("cref %s %.1f\n", name, per_op[BATCHES / 2]);
	else if (suite_op) {
		double us[BATCHES];
		for (int i = 0; i < BATCHES; i++) us[i] = per_op[i] / 1e3;
		summarize("c", suite_op, "us", us, BATCHES);
	}
	fflush(stdout);
}

// pool_of is a new pool on device 0 that can be shared as ht (none: a local pool).
static cudaMemPool_t pool_of(cudaMemAllocationHandleType ht) {
	cudaMemPoolProps props;
	memset(&props, 0, sizeof props);
	props.allocType = cudaMemAllocationTypePinned;
	props.handleTypes = ht;
	props.location.type = cudaMemLocationTypeDevice;
	props.location.id = 0;
	cudaMemPool_t pool;
	CHECK(cudaMemPoolCreate(&pool, &props));
	return pool;
}

// ipc_pool is a pool on device 0 that can be shared as a POSIX fd, as cudapool's
// exportable pools are.
static cudaMemPool_t ipc_pool(void) { return pool_of(cudaMemHandleTypePosixFileDescriptor); }

static cudaStream_t new_stream(void) {
	cudaStream_t s;
	CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
	return s;
}

// malloc_free_pair times the pair, for cudart's benchmark of the same name.
static void malloc_free_pair(const char *name, size_t size) {
	cudaMemPool_t pool = ipc_pool();
	cudaStream_t s = new_stream();
	void *p;
	CHECK(cudaMallocFromPoolAsync(&p, size, pool, s)); // the pool reserves its memory once
	CHECK(cudaFreeAsync(p, s));
	CHECK(cudaStreamSynchronize(s));
	double per_op[BATCHES];
	for (int b = -1; b < BATCHES; b++) { // batch -1 warms up
		double t0 = now_ns();
		for (int i = 0; i < SYNC_EVERY; i++) {
			CHECK(cudaMallocFromPoolAsync(&p, size, pool, s));
			CHECK(cudaFreeAsync(p, s));
		}
		CHECK(cudaStreamSynchronize(s));
		if (b >= 0) per_op[b] = (now_ns() - t0) / SYNC_EVERY;
	}
	report(name, NULL, per_op);
	CHECK(cudaStreamDestroy(s));
	CHECK(cudaMemPoolDestroy(pool));
}

// legacy_malloc_free_pair is malloc_free_pair's loop on cudaMalloc and cudaFree,
// the allocator the legacy IPC path needs, in batches of LEGACY_PAIRS.
static void legacy_malloc_free_pair(const char *suite_op, size_t size) {
	void *p;
	CHECK(cudaMalloc(&p, size));
	CHECK(cudaFree(p));
	double per_op[BATCHES];
	for (int b = -1; b < BATCHES; b++) {
		double t0 = now_ns();
		for (int i = 0; i < LEGACY_PAIRS; i++) {
			CHECK(cudaMalloc(&p, size));
			CHECK(cudaFree(p));
		}
		CHECK(cudaDeviceSynchronize());
		if (b >= 0) per_op[b] = (now_ns() - t0) / LEGACY_PAIRS / 1e3;
	}
	summarize("legacy", suite_op, "us", per_op, BATCHES);
}

static void export_pointer(void) {
	cudaMemPool_t pool = ipc_pool();
	cudaStream_t s = new_stream();
	int fd;
	CHECK(cudaMemPoolExportToShareableHandle(&fd, pool, cudaMemHandleTypePosixFileDescriptor, 0));
	close(fd);
	void *p;
	CHECK(cudaMallocFromPoolAsync(&p, MiB, pool, s));
	CHECK(cudaStreamSynchronize(s));
	cudaMemPoolPtrExportData data;
	double per_op[BATCHES];
	for (int b = -1; b < BATCHES; b++) {
		double t0 = now_ns();
		for (int i = 0; i < EXPORTS_PER_BATCH; i++) CHECK(cudaMemPoolExportPointer(&data, p));
		if (b >= 0) per_op[b] = (now_ns() - t0) / EXPORTS_PER_BATCH;
	}
	report("ExportPointer", NULL, per_op);
	CHECK(cudaFreeAsync(p, s));
	CHECK(cudaStreamSynchronize(s));
	CHECK(cudaStreamDestroy(s));
	CHECK(cudaMemPoolDestroy(pool));
}

static void event_record_wait(void) {
	cudaStream_t s = new_stream(), waiter = new_stream();
	cudaEvent_t e;
	CHECK(cudaEventCreateWithFlags(&e, cudaEventInterprocess | cudaEventDisableTiming));
	double per_op[BATCHES];
	for (int b = -1; b < BATCHES; b++) {
		double t0 = now_ns();
		for (int i = 0; i < SYNC_EVERY; i++) {
			CHECK(cudaEventRecord(e, s));
			CHECK(cudaStreamWaitEvent(waiter, e, 0));
		}
		CHECK(cudaStreamSynchronize(waiter));
		if (b >= 0) per_op[b] = (now_ns() - t0) / SYNC_EVERY;
	}
	report("EventRecordWait", NULL, per_op);
	CHECK(cudaEventDestroy(e));
	CHECK(cudaStreamDestroy(s));
	CHECK(cudaStreamDestroy(waiter));
}

static void write_all(int sock, const void *buf, size_t n) {
	for (size_t done = 0; done < n;) {
		ssize_t k = write(sock, (const char *)buf + done, n - done);
		CHECK_SYS(k > 0, "write");
		done += (size_t)k;
	}
}

static void read_all(int sock, void *buf, size_t n) {
	for (size_t done = 0; done < n;) {
		ssize_t k = read(sock, (char *)buf + done, n - done);
		CHECK_SYS(k > 0, "read");
		done += (size_t)k;
	}
}

// fd_message makes msg a message of the one byte at byte, with room at control
// (n bytes) for one descriptor.
static void fd_message(struct msghdr *msg, struct iovec *iov, char *byte, char *control, size_t n) {
	iov->iov_base = byte;
	iov->iov_len = 1;
	memset(msg, 0, sizeof *msg);
	msg->msg_iov = iov;
	msg->msg_iovlen = 1;
	msg->msg_control = control;
	msg->msg_controllen = n;
}

static void send_fd(int sock, int fd) {
	char byte = 'f', control[CMSG_SPACE(sizeof fd)];
	struct iovec iov;
	struct msghdr msg;
	fd_message(&msg, &iov, &byte, control, sizeof control);
	struct cmsghdr *c = CMSG_FIRSTHDR(&msg);
	c->cmsg_level = SOL_SOCKET;
	c->cmsg_type = SCM_RIGHTS;
	c->cmsg_len = CMSG_LEN(sizeof fd);
	memcpy(CMSG_DATA(c), &fd, sizeof fd);
	CHECK_SYS(sendmsg(sock, &msg, 0) == 1, "sendmsg");
}

static int receive_fd(int sock) {
	char byte, control[CMSG_SPACE(sizeof(int))];
	struct iovec iov;
	struct msghdr msg;
	fd_message(&msg, &iov, &byte, control, sizeof control);
	CHECK_SYS(recvmsg(sock, &msg, 0) == 1, "recvmsg");
	struct cmsghdr *c = CMSG_FIRSTHDR(&msg);
	CHECK_SYS(c && c->cmsg_type == SCM_RIGHTS, "recvmsg: no descriptor");
	int fd;
	memcpy(&fd, CMSG_DATA(c), sizeof fd);
	return fd;
}

// exporter runs in the child forked before any CUDA call: it sends its pool's fd
// (SCM_RIGHTS, with one byte), then the export data of IMPORT_BUFFERS buffers (of
// SHARE_SIZE, or 1 MiB for cudart's benchmark), and exits once the parent says every
// import is freed.
static int exporter(int sock) {
	cudaMemPool_t pool = ipc_pool();
	cudaStream_t s = new_stream();
	int fd;
	CHECK(cudaMemPoolExportToShareableHandle(&fd, pool, cudaMemHandleTypePosixFileDescriptor, 0));
	static cudaMemPoolPtrExportData data[IMPORT_BUFFERS];
	for (int i = 0; i < IMPORT_BUFFERS; i++) {
		void *p; // cudart's benchmark imports 1 MiB buffers, the suite 2 MiB ones
		CHECK(cudaMallocFromPoolAsync(&p, bench_mode ? MiB : SHARE_SIZE, pool, s));
		CHECK(cudaStreamSynchronize(s));
		CHECK(cudaMemPoolExportPointer(&data[i], p));
	}
	send_fd(sock, fd);
	write_all(sock, data, sizeof data);
	char byte;
	read_all(sock, &byte, 1);
	return 0;
}

// import_pointer imports each of the exporter's buffers and frees the import, and
// synchronizes after each round of IMPORT_BUFFERS, as BenchmarkImportPointer does.
static void import_pointer(int sock) {
	int fd = receive_fd(sock);
	static cudaMemPoolPtrExportData data[IMPORT_BUFFERS];
	read_all(sock, data, sizeof data);
	cudaMemPool_t pool;
	CHECK(cudaMemPoolImportFromShareableHandle(&pool, (void *)(long)fd, cudaMemHandleTypePosixFileDescriptor, 0));
	close(fd);
	cudaStream_t s = new_stream();
	double per_op[BATCHES];
	for (int b = -1; b < BATCHES; b++) {
		double t0 = now_ns();
		for (int i = 0; i < IMPORT_BUFFERS; i++) {
			void *p;
			CHECK(cudaMemPoolImportPointer(&p, pool, &data[i]));
			CHECK(cudaFreeAsync(p, s));
		}
		CHECK(cudaStreamSynchronize(s));
		if (b >= 0) per_op[b] = (now_ns() - t0) / IMPORT_BUFFERS;
	}
	report("ImportPointer", "import/pair", per_op);
	CHECK(cudaStreamDestroy(s));
	char byte = 'k';
	write_all(sock, &byte, 1);
}

// ---- The suite's sharing operations, for both the pool route and the legacy one.
//
// A share is made by the producer (this process) and taken by consumer processes
// forked before any CUDA call. Both routes send a 64-byte record: the pool route's
// cudaMemPoolPtrExportData or the legacy cudaIpcMemHandle_t.

enum kind { POOL, LEGACY };
static const char *impl_name[] = {"c", "legacy"};

typedef struct { unsigned char b[64]; } record;

// Commands from the producer to a consumer, and what a consumer says while serving
// one: a request for buffer i (i >= 0), DONE, or RELEASED. count is how many distinct
// buffers the consumer's requests cycle through (request i is buffer i % count).
enum { CMD_OPEN, CMD_RELEASE, CMD_OPEN_RELEASE, CMD_FANOUT, CMD_SUSTAIN, CMD_READ, CMD_LEGACY_PAIRS, CMD_QUIT };
enum { DONE = -1, RELEASED = -2 };
typedef struct { int32_t op, kind, n, count; } command;

// The producer's side of sharing.
static struct {
	cudaMemPool_t pool;
	cudaStream_t stream;
	cudaStream_t release; // the pool's release stream: waits for consumers' frees
	cudaEvent_t ready; // recorded after the producer's writes; consumers wait on it
	int ndev;
	cudaEvent_t released[CONSUMERS + 1]; // each consumer's release event, opened here
} prod;

typedef struct { void *ptr; } buffer;

// make_buffer allocates size bytes by kind's route and writes them, and records the
// ready event after the writes.
static buffer make_buffer(enum kind k, size_t size) {
	buffer b;
	if (k == POOL) CHECK(cudaMallocFromPoolAsync(&b.ptr, size, prod.pool, prod.stream));
	else CHECK(cudaMalloc(&b.ptr, size));
	CHECK(cudaMemsetAsync(b.ptr, 0x5a, size, prod.stream));
	CHECK(cudaEventRecord(prod.ready, prod.stream));
	return b;
}

static void drop_buffer(enum kind k, buffer b) {
	if (k == POOL) CHECK(cudaFreeAsync(b.ptr, prod.stream));
	else CHECK(cudaFree(b.ptr));
}

static record export_buffer(enum kind k, buffer b) {
	record r;
	if (k == POOL) CHECK(cudaMemPoolExportPointer((cudaMemPoolPtrExportData *)&r, b.ptr));
	else CHECK(cudaIpcGetMemHandle((cudaIpcMemHandle_t *)&r, b.ptr));
	return r;
}

// export_fresh times the export of buffers never exported before.
static void export_fresh(enum kind k) {
	static buffer bufs[SAMPLES];
	double us[SAMPLES];
	for (int i = 0; i < SAMPLES; i++) bufs[i] = make_buffer(k, SHARE_SIZE);
	CHECK(cudaStreamSynchronize(prod.stream));
	for (int i = 0; i < SAMPLES; i++) {
		double t0 = now_ns();
		export_buffer(k, bufs[i]);
		us[i] = (now_ns() - t0) / 1e3;
	}
	for (int i = 0; i < SAMPLES; i++) drop_buffer(k, bufs[i]);
	CHECK(cudaStreamSynchronize(prod.stream));
	summarize(impl_name[k], "export/fresh", "us", us, SAMPLES);
}

// The buffers a consumer's requests are answered from: fresh ones are exported when
// asked for, the others were exported before.
static struct {
	enum kind k;
	int fresh, n;
	buffer *bufs;
	record *recs;
} shared;

static void share(enum kind k, int n, int fresh) {
	shared.k = k;
	shared.n = n;
	shared.fresh = fresh;
	shared.bufs = (buffer *)calloc(n, sizeof(buffer));
	shared.recs = (record *)calloc(n, sizeof(record));
	CHECK_SYS(shared.bufs && shared.recs, "calloc");
	for (int i = 0; i < n; i++) {
		shared.bufs[i] = make_buffer(k, SHARE_SIZE);
		if (!fresh) shared.recs[i] = export_buffer(k, shared.bufs[i]);
	}
	CHECK(cudaStreamSynchronize(prod.stream));
}

// unshare frees the shared buffers once the release stream has waited for every
// consumer's free (the consumers have also synchronized before saying DONE).
static void unshare(void) {
	CHECK(cudaStreamSynchronize(prod.release));
	for (int i = 0; i < shared.n; i++) drop_buffer(shared.k, shared.bufs[i]);
	CHECK(cudaStreamSynchronize(prod.stream));
	free(shared.bufs);
	free(shared.recs);
}

// completed reports whether the work captured by e has completed, as cudapool's
// export package asks before making a stream wait on another process's event.
static int completed(cudaEvent_t e) {
	cudaError_t err = cudaEventQuery(e);
	if (err == cudaErrorNotReady) return 0;
	CHECK(err);
	return 1;
}

// serve_one answers one message of consumer c: a record for a request, an
// acknowledgement for a release (after making the release stream wait for the
// consumer's free unless it has completed, as cudapool's exporter does). It returns
// what the consumer said.
static int serve_one(int sock, int c) {
	int32_t said;
	read_all(sock, &said, sizeof said);
	if (said >= 0) {
		int i = said % shared.n;
		record r = shared.fresh ? export_buffer(shared.k, shared.bufs[i]) : shared.recs[i];
		write_all(sock, &r, sizeof r);
	} else if (said == RELEASED) {
		if (shared.k == POOL && !completed(prod.released[c])) CHECK(cudaStreamWaitEvent(prod.release, prod.released[c], 0));
		char ack = 'a';
		write_all(sock, &ack, 1);
	}
	return said;
}

// serve answers consumer c until it says DONE, then reads its n samples.
static void serve(int sock, int c, double *samples, int n) {
	while (serve_one(sock, c) != DONE) {
	}
	read_all(sock, samples, n * sizeof samples[0]);
}

static void send_command(int sock, int op, enum kind k, int n, int count) {
	command cmd = {op, (int32_t)k, n, count};
	write_all(sock, &cmd, sizeof cmd);
}

// open_end_to_end: a consumer asks for a buffer, the producer answers with its
// record (exporting it first if fresh), the consumer opens it (the ordered protocol)
// and releases it, untimed; timed in the consumer, from the request to the usable
// pointer.
static void open_end_to_end(int sock, enum kind k, int fresh) {
	int count = fresh ? WARMUP + SAMPLES : RING;
	share(k, count, fresh);
	send_command(sock, CMD_OPEN, k, WARMUP + SAMPLES, count);
	double us[WARMUP + SAMPLES];
	serve(sock, 0, us, WARMUP + SAMPLES);
	unshare();
	summarize(impl_name[k], fresh ? "open/first" : "open/exported", "us", us + WARMUP, SAMPLES);
}

// release_round_trip: the consumer opens a buffer (untimed) and releases it: the
// ordered free, its release event, and the message the producer acknowledges after
// making its release stream wait for that event; timed in the consumer from the
// release's first call to the acknowledgement. With both, the same cycle timed whole.
static void release_round_trip(int sock, enum kind k, int both) {
	share(k, RING, 0);
	send_command(sock, both ? CMD_OPEN_RELEASE : CMD_RELEASE, k, WARMUP + SAMPLES, RING);
	double us[WARMUP + SAMPLES];
	serve(sock, 0, us, WARMUP + SAMPLES);
	unshare();
	summarize(impl_name[k], both ? "open+release/exported" : "release", "us", us + WARMUP, SAMPLES);
}

// fan_out: one fresh buffer to n consumers, from the producer's export to the last
// consumer's usable pointer (consumers stamp CLOCK_MONOTONIC, which is the host's).
static void fan_out(const int *socks, int n, enum kind k) {
	for (int c = 0; c < n; c++) send_command(socks[c], CMD_FANOUT, k, WARMUP + FANOUT_REPS, 1);
	double us[FANOUT_REPS];
	for (int rep = 0; rep < WARMUP + FANOUT_REPS; rep++) {
		buffer b = make_buffer(k, SHARE_SIZE);
		CHECK(cudaStreamSynchronize(prod.stream));
		double t0 = now_ns();
		record r = export_buffer(k, b);
		for (int c = 0; c < n; c++) write_all(socks[c], &r, sizeof r);
		double last = t0;
		for (int c = 0; c < n; c++) {
			double t;
			read_all(socks[c], &t, sizeof t);
			if (t > last) last = t;
		}
		for (int c = 0; c < n; c++) { // each consumer has freed its import
			char ack;
			read_all(socks[c], &ack, 1);
		}
		if (rep >= WARMUP) us[rep - WARMUP] = (last - t0) / 1e3;
		drop_buffer(k, b);
	}
	CHECK(cudaStreamSynchronize(prod.stream));
	char op[32];
	snprintf(op, sizeof op, "fanout/%d", n);
	summarize(impl_name[k], op, "us", us, FANOUT_REPS);
}

// A consumer's account of one sustained window: its shares, the Opens that took
// SLOW_OPEN_NS or more and their time, and the Opens that had to wait for an earlier
// free of the same record to complete (the settle) and the time in those waits.
enum { W_SHARES, W_SLOW, W_SLOW_MS, W_SETTLES, W_SETTLE_MS, W_FIELDS };
static const double SLOW_OPEN_NS = 1e6; // as bench/gosuite's slowOpen

// sustained: SUSTAIN_CONSUMERS consumers each open and release buffers of a ring
// already exported, as fast as they can, for SUSTAIN_MS; a round's rate is all
// their shares over the window. Each window also prints
//
//	window IMPL sustained/4 ROUND SHARES SLOW SLOW_MS TURNS
//	settle IMPL sustained/4 ROUND WAITS WAIT_MS
//
// (summed over the consumers; TURNS is how often they went round their rings): the
// stall pattern, and how much of it is the settle.
static void sustained(const int *socks, enum kind k) {
	share(k, RING, 0);
	for (int c = 0; c < SUSTAIN_CONSUMERS; c++) send_command(socks[c], CMD_SUSTAIN, k, SUSTAIN_ROUNDS, RING);
	double rate[SUSTAIN_ROUNDS];
	for (int round = 0; round < SUSTAIN_ROUNDS; round++) {
		char go = 'g';
		for (int c = 0; c < SUSTAIN_CONSUMERS; c++) write_all(socks[c], &go, 1);
		int running = SUSTAIN_CONSUMERS;
		double sum[W_FIELDS] = {0};
		while (running > 0) {
			struct pollfd fds[SUSTAIN_CONSUMERS];
			for (int c = 0; c < SUSTAIN_CONSUMERS; c++) {
				fds[c].fd = socks[c];
				fds[c].events = POLLIN;
				fds[c].revents = 0;
			}
			CHECK_SYS(poll(fds, SUSTAIN_CONSUMERS, -1) > 0, "poll");
			for (int c = 0; c < SUSTAIN_CONSUMERS; c++) {
				if (!(fds[c].revents & (POLLIN | POLLHUP))) continue;
				if (serve_one(socks[c], c) == DONE) {
					double w[W_FIELDS];
					read_all(socks[c], w, sizeof w);
					for (int f = 0; f < W_FIELDS; f++) sum[f] += w[f];
					running--;
				}
			}
		}
		rate[round] = sum[W_SHARES] / (SUSTAIN_MS / 1e3);
		printf("window %s sustained/4 %d %.0f %.0f %.3f %.2f\n", impl_name[k], round, sum[W_SHARES], sum[W_SLOW],
		       sum[W_SLOW_MS], sum[W_SHARES] / RING);
		printf("settle %s sustained/4 %d %.0f %.3f\n", impl_name[k], round, sum[W_SETTLES], sum[W_SETTLE_MS]);
	}
	unshare();
	summarize(impl_name[k], "sustained/4", "shares/s", rate, SUSTAIN_ROUNDS);
}

// read_imported: a consumer on dev copies an imported 1 GiB buffer into its own
// memory, each copy timed with events.
static void read_imported(int sock, enum kind k, int dev) {
	buffer b = make_buffer(k, READ_SIZE);
	CHECK(cudaStreamSynchronize(prod.stream));
	record r = export_buffer(k, b);
	send_command(sock, CMD_READ, k, READ_COPIES, 1);
	write_all(sock, &r, sizeof r);
	double gbs[READ_COPIES];
	read_all(sock, gbs, sizeof gbs);
	drop_buffer(k, b);
	CHECK(cudaStreamSynchronize(prod.stream));
	summarize(impl_name[k], dev == 0 ? "read/same-gpu" : "read/other-gpu", "GB/s", gbs, READ_COPIES);
}

// timed_copies copies n bytes from src to dst on s READ_COPIES times after one
// untimed copy, and returns each copy's rate in GB/s (10^9 bytes, counted once).
static void timed_copies(void *dst, const void *src, size_t n, cudaStream_t s, double gbs[READ_COPIES]) {
	cudaEvent_t start, stop;
	CHECK(cudaEventCreate(&start));
	CHECK(cudaEventCreate(&stop));
	CHECK(cudaMemcpyAsync(dst, src, n, cudaMemcpyDefault, s));
	for (int i = 0; i < READ_COPIES; i++) {
		CHECK(cudaEventRecord(start, s));
		CHECK(cudaMemcpyAsync(dst, src, n, cudaMemcpyDefault, s));
		CHECK(cudaEventRecord(stop, s));
		CHECK(cudaEventSynchronize(stop));
		float ms;
		CHECK(cudaEventElapsedTime(&ms, start, stop));
		gbs[i] = n / (ms / 1e3) / 1e9;
	}
	CHECK(cudaEventDestroy(start));
	CHECK(cudaEventDestroy(stop));
}

// plain_copy is the baseline of read_imported: a device copy of 1 GiB of plain
// cudaMalloc memory of device 0 into device dev, in this process, on dev's stream.
static void plain_copy(int dev) {
	void *src, *dst;
	CHECK(cudaSetDevice(0));
	CHECK(cudaMalloc(&src, READ_SIZE));
	CHECK(cudaMemset(src, 0x5a, READ_SIZE));
	CHECK(cudaSetDevice(dev));
	if (dev != 0) {
		cudaError_t e = cudaDeviceEnablePeerAccess(0, 0);
		if (e != cudaSuccess && e != cudaErrorPeerAccessAlreadyEnabled) CHECK(e);
	}
	CHECK(cudaMalloc(&dst, READ_SIZE));
	cudaStream_t s = new_stream();
	double gbs[READ_COPIES];
	timed_copies(dst, src, READ_SIZE, s, gbs);
	CHECK(cudaStreamDestroy(s));
	CHECK(cudaFree(dst));
	CHECK(cudaSetDevice(0));
	CHECK(cudaFree(src));
	summarize("c", dev == 0 ? "copy/same-gpu" : "copy/other-gpu", "GB/s", gbs, READ_COPIES);
}

// legacy_import_pairs is import_pointer's loop on the legacy route:
// cudaIpcOpenMemHandle and cudaIpcCloseMemHandle of LEGACY_IMPORTS buffers a batch.
static void legacy_import_pairs(int sock) {
	buffer bufs[LEGACY_IMPORTS];
	record recs[LEGACY_IMPORTS];
	for (int i = 0; i < LEGACY_IMPORTS; i++) {
		bufs[i] = make_buffer(LEGACY, SHARE_SIZE);
		recs[i] = export_buffer(LEGACY, bufs[i]);
	}
	CHECK(cudaStreamSynchronize(prod.stream));
	send_command(sock, CMD_LEGACY_PAIRS, LEGACY, LEGACY_IMPORTS, LEGACY_IMPORTS);
	write_all(sock, recs, sizeof recs);
	double us[BATCHES];
	read_all(sock, us, sizeof us);
	for (int i = 0; i < LEGACY_IMPORTS; i++) drop_buffer(LEGACY, bufs[i]);
	summarize("legacy", "import/pair", "us", us, BATCHES);
}

// ---- The consumer process.

// A consumer works on one device, as a cudapool Importer does: the producer's pool
// is made accessible there, and its ready event is opened there. Like an Importer it
// frees imports on a release stream of its own, after the caller's stream's work
// (the order event), and records its release event there.
static struct {
	int sock, dev;
	cudaMemPool_t pool; // the producer's, imported
	cudaEvent_t ready;  // the producer's, opened
	cudaEvent_t released;
	cudaEvent_t order;
	cudaStream_t stream, release;
	// freed[i]: record i (of the command's count) was freed since the last settle.
	unsigned char *freed;
	int count;
	int producer; // a pidfd of the producer's process: the Importer asks it before using its events
	double settles, settle_ms; // settles that waited, and their time
} cons;

// begin_command sizes the freed set for a command's count distinct records.
static void begin_command(int count) {
	free(cons.freed);
	cons.count = count > 0 ? count : 1;
	cons.freed = (unsigned char *)calloc(cons.count, 1);
	CHECK_SYS(cons.freed, "calloc");
}

static void *import_record(enum kind k, const record *r) {
	void *p;
	if (k == POOL) CHECK(cudaMemPoolImportPointer(&p, cons.pool, (cudaMemPoolPtrExportData *)r));
	else CHECK(cudaIpcOpenMemHandle(&p, *(const cudaIpcMemHandle_t *)r, cudaIpcMemLazyEnablePeerAccess));
	return p;
}

// check_producer asks the kernel, without blocking, whether the producer's process
// has exited, as cudapool's Importer does before each use of the producer's event (a
// dead process's event may never complete).
static void check_producer(void) {
	struct pollfd p = {cons.producer, POLLIN, 0};
	int n = poll(&p, 1, 0);
	CHECK_SYS(n >= 0, "poll the producer's pidfd");
	if (n > 0) {
		fprintf(stderr, "cref: consumer: the producer has exited\n");
		exit(1);
	}
}

// wait_ready makes s wait for the producer's writes unless they have completed, asking
// first, as the Importer does, whether the producer lives: before the lease is used,
// before the event is asked, and before the wait.
static void wait_ready(cudaStream_t s) {
	check_producer();
	check_producer();
	if (!completed(cons.ready)) {
		check_producer();
		CHECK(cudaStreamWaitEvent(s, cons.ready, 0));
	}
}

// settle: before record i, freed earlier by this process, is imported again, every
// free issued so far must have completed; the host waits only if the release event
// says it has not. As the Importer, it then forgets every freed record.
static void settle(int i) {
	if (!cons.freed[i]) return;
	if (!completed(cons.released)) {
		double t0 = now_ns();
		CHECK(cudaStreamSynchronize(cons.release));
		cons.settles++;
		cons.settle_ms += (now_ns() - t0) / 1e6;
	}
	memset(cons.freed, 0, cons.count);
}

// open_record asks the producer for buffer i and returns it imported, usable on s:
// the ordered protocol of cudapool's Importer.Open.
static void *open_record(enum kind k, int32_t i, cudaStream_t s) {
	int dev; // Open refuses a stream of another device than the Importer's
	CHECK(cudaStreamGetDevice(s, &dev));
	CHECK_SYS(dev == cons.dev, "a stream of another device");
	record r;
	write_all(cons.sock, &i, sizeof i);
	read_all(cons.sock, &r, sizeof r);
	wait_ready(s);
	if (k == POOL) settle(i % cons.count);
	return import_record(k, &r);
}

// release_record frees import p of request i after s's work and tells the producer,
// waiting for its answer: the ordered protocol of cudapool's Mapping.Release. The
// legacy route's close is synchronous and orders nothing.
static void release_record(enum kind k, void *p, int32_t i, cudaStream_t s) {
	if (k == POOL) {
		CHECK(cudaEventRecord(cons.order, s));
		CHECK(cudaStreamWaitEvent(cons.release, cons.order, 0));
		CHECK(cudaFreeAsync(p, cons.release));
		CHECK(cudaEventRecord(cons.released, cons.release));
		cons.freed[i % cons.count] = 1;
	} else {
		CHECK(cudaIpcCloseMemHandle(p));
	}
	int32_t said = RELEASED;
	write_all(cons.sock, &said, sizeof said);
	char ack;
	read_all(cons.sock, &ack, 1);
}

// free_now frees an import and waits for the free: for the measurements that do not
// time a release (fan-out, read, legacy pairs).
static void free_now(enum kind k, void *p, cudaStream_t s) {
	if (k == POOL) CHECK(cudaFreeAsync(p, s));
	else CHECK(cudaIpcCloseMemHandle(p));
	CHECK(cudaStreamSynchronize(s));
}

static void say_done(const double *samples, int n) {
	int32_t said = DONE;
	write_all(cons.sock, &said, sizeof said);
	write_all(cons.sock, samples, n * sizeof samples[0]);
}

// consume_cycle opens and releases n requests, timing the open (CMD_OPEN), the
// release (CMD_RELEASE) or both (CMD_OPEN_RELEASE), as bench/gosuite's consumer does.
static void consume_cycle(int op, enum kind k, int n) {
	double *us = (double *)calloc(n, sizeof(double));
	CHECK_SYS(us, "calloc");
	cudaStream_t s = cons.stream;
	for (int i = 0; i < n; i++) {
		double t0 = now_ns();
		void *p = open_record(k, i, s);
		double t1 = now_ns();
		release_record(k, p, i, s);
		double t2 = now_ns();
		us[i] = (op == CMD_OPEN ? t1 - t0 : op == CMD_RELEASE ? t2 - t1 : t2 - t0) / 1e3;
	}
	CHECK(cudaStreamSynchronize(cons.release));
	say_done(us, n);
	free(us);
}

static void consume_fanout(enum kind k, int n) {
	cudaStream_t s = cons.stream;
	for (int rep = 0; rep < n; rep++) {
		record r;
		read_all(cons.sock, &r, sizeof r);
		void *p = import_record(k, &r);
		wait_ready(s);
		double t = now_ns();
		write_all(cons.sock, &t, sizeof t);
		free_now(k, p, s);
		char ack = 'a';
		write_all(cons.sock, &ack, 1);
	}
}

static void consume_sustained(enum kind k, int rounds) {
	cudaStream_t s = cons.stream;
	for (int round = 0; round < rounds; round++) {
		char go;
		read_all(cons.sock, &go, 1);
		double w[W_FIELDS] = {0};
		cons.settles = cons.settle_ms = 0;
		double end = now_ns() + SUSTAIN_MS * 1e6;
		for (int32_t i = 0; now_ns() < end; i++) {
			double t0 = now_ns();
			void *p = open_record(k, i, s);
			double took = now_ns() - t0;
			if (took >= SLOW_OPEN_NS) {
				w[W_SLOW]++;
				w[W_SLOW_MS] += took / 1e6;
			}
			release_record(k, p, i, s);
			w[W_SHARES]++;
		}
		CHECK(cudaStreamSynchronize(cons.release));
		w[W_SETTLES] = cons.settles;
		w[W_SETTLE_MS] = cons.settle_ms;
		say_done(w, W_FIELDS);
	}
}

static void consume_read(enum kind k) {
	record r;
	read_all(cons.sock, &r, sizeof r);
	cudaStream_t s = cons.stream;
	void *src = import_record(k, &r), *dst;
	wait_ready(s);
	CHECK(cudaMalloc(&dst, READ_SIZE));
	double gbs[READ_COPIES];
	timed_copies(dst, src, READ_SIZE, s, gbs);
	free_now(k, src, s);
	CHECK(cudaFree(dst));
	write_all(cons.sock, gbs, sizeof gbs);
}

static void consume_legacy_pairs(int n) {
	record *recs = (record *)calloc(n, sizeof(record));
	read_all(cons.sock, recs, n * sizeof(record));
	double us[BATCHES];
	for (int b = -1; b < BATCHES; b++) {
		double t0 = now_ns();
		for (int i = 0; i < n; i++) CHECK(cudaIpcCloseMemHandle(import_record(LEGACY, &recs[i])));
		if (b >= 0) us[b] = (now_ns() - t0) / n / 1e3;
	}
	write_all(cons.sock, us, sizeof us);
	free(recs);
}

// consumer runs in a child forked before any CUDA call. It is told its device,
// imports the producer's pool and ready event, sends the handle of its own release
// event, and obeys commands until CMD_QUIT.
static int consumer(int sock) {
	cons.sock = sock;
	cons.producer = (int)syscall(SYS_pidfd_open, getppid(), 0);
	CHECK_SYS(cons.producer >= 0, "pidfd_open of the producer");
	int fd = receive_fd(sock);
	cudaIpcEventHandle_t ready;
	read_all(sock, &ready, sizeof ready);
	int32_t dev;
	read_all(sock, &dev, sizeof dev);
	cons.dev = dev;
	// The release event lives on device 0, where the producer opens it and its
	// stream waits on it (only consumers on device 0 release).
	CHECK(cudaSetDevice(0));
	CHECK(cudaEventCreateWithFlags(&cons.released, cudaEventInterprocess | cudaEventDisableTiming));
	cudaIpcEventHandle_t released;
	CHECK(cudaIpcGetEventHandle(&released, cons.released));
	CHECK(cudaSetDevice(cons.dev));
	CHECK(cudaMemPoolImportFromShareableHandle(&cons.pool, (void *)(long)fd, cudaMemHandleTypePosixFileDescriptor, 0));
	close(fd);
	if (cons.dev != 0) {
		cudaMemAccessDesc d;
		memset(&d, 0, sizeof d);
		d.location.type = cudaMemLocationTypeDevice;
		d.location.id = cons.dev;
		d.flags = cudaMemAccessFlagsProtReadWrite;
		CHECK(cudaMemPoolSetAccess(cons.pool, &d, 1));
	}
	CHECK(cudaIpcOpenEventHandle(&cons.ready, ready));
	cons.stream = new_stream();
	// The release stream and the order event live on device 0 with the release event.
	CHECK(cudaSetDevice(0));
	cons.release = new_stream();
	CHECK(cudaEventCreateWithFlags(&cons.order, cudaEventDisableTiming));
	CHECK(cudaSetDevice(cons.dev));
	write_all(sock, &released, sizeof released);
	for (;;) {
		command cmd;
		read_all(sock, &cmd, sizeof cmd);
		enum kind k = (enum kind)cmd.kind;
		begin_command(cmd.count);
		switch (cmd.op) {
		case CMD_OPEN:
		case CMD_RELEASE:
		case CMD_OPEN_RELEASE: consume_cycle(cmd.op, k, cmd.n); break;
		case CMD_FANOUT: consume_fanout(k, cmd.n); break;
		case CMD_SUSTAIN: consume_sustained(k, cmd.n); break;
		case CMD_READ: consume_read(k); break;
		case CMD_LEGACY_PAIRS: consume_legacy_pairs(cmd.n); break;
		case CMD_QUIT: return 0;
		default: fprintf(stderr, "cref: consumer: unknown command %d\n", cmd.op); return 1;
		}
	}
}

// sharing runs the suite's sharing operations on both routes with the consumers
// at socks, which it then tells to quit.
static void sharing(const int *socks) {
	CHECK(cudaGetDeviceCount(&prod.ndev));
	prod.pool = ipc_pool();
	prod.stream = new_stream();
	prod.release = new_stream();
	CHECK(cudaEventCreateWithFlags(&prod.ready, cudaEventInterprocess | cudaEventDisableTiming));
	int fd;
	CHECK(cudaMemPoolExportToShareableHandle(&fd, prod.pool, cudaMemHandleTypePosixFileDescriptor, 0));
	cudaIpcEventHandle_t ready;
	CHECK(cudaIpcGetEventHandle(&ready, prod.ready));
	for (int c = 0; c <= OTHER; c++) {
		int32_t dev = c == OTHER && prod.ndev > 1 ? 1 : 0;
		send_fd(socks[c], fd);
		write_all(socks[c], &ready, sizeof ready);
		write_all(socks[c], &dev, sizeof dev);
	}
	close(fd);
	for (int c = 0; c <= OTHER; c++) {
		cudaIpcEventHandle_t released;
		read_all(socks[c], &released, sizeof released);
		CHECK(cudaIpcOpenEventHandle(&prod.released[c], released));
	}

	for (int k = POOL; k <= LEGACY; k++) export_fresh((enum kind)k);
	legacy_import_pairs(socks[0]);
	for (int k = POOL; k <= LEGACY; k++) {
		open_end_to_end(socks[0], (enum kind)k, 1);
		open_end_to_end(socks[0], (enum kind)k, 0);
		release_round_trip(socks[0], (enum kind)k, 0);
		release_round_trip(socks[0], (enum kind)k, 1);
	}
	static const int fans[] = {1, 2, 4, 7};
	for (int k = POOL; k <= LEGACY; k++)
		for (int f = 0; f < 4; f++) fan_out(socks, fans[f], (enum kind)k);
	for (int k = POOL; k <= LEGACY; k++) sustained(socks, (enum kind)k);
	for (int dev = 0; dev < prod.ndev && dev < 2; dev++) {
		plain_copy(dev);
		for (int k = POOL; k <= LEGACY; k++) read_imported(socks[dev == 0 ? 0 : OTHER], (enum kind)k, dev);
	}
	if (prod.ndev < 2) { // bench/table.py: not run, needs 2 GPUs
		printf("needs c copy/other-gpu 2\n");
		for (int k = POOL; k <= LEGACY; k++) printf("needs %s read/other-gpu 2\n", impl_name[k]);
	}
	for (int c = 0; c <= OTHER; c++) send_command(socks[c], CMD_QUIT, POOL, 0, 1);
}

// ---- The allocation ring.
//
// The allocation pairs run as one participant of a ring of processes that take
// turns, one batch each, pinned by scripts/bench-suite.sh to the same CPU: this
// program, bench/gosuite and bench/cudacore.py (bench/gosuite/alloc.go says why).
// Every participant runs the same plan, "KIND/SIZE=BYTES ...": for each entry and
// each slot (api, then binding) one untimed warm-up batch and BATCHES measured ones
// of PAIRS pairs, each batch one turn. C has one layer, so it runs its pair in both
// slots. The token is the turn's number as a line of text.

enum { TURN_TIMEOUT_MS = 60000 };

static int take_turn(int in) {
	struct pollfd p = {in, POLLIN, 0};
	int n;
	do n = poll(&p, 1, TURN_TIMEOUT_MS);
	while (n < 0 && errno == EINTR);
	CHECK_SYS(n >= 0, "poll for the turn");
	if (n == 0) {
		fprintf(stderr, "cref: no turn came for %d ms: another participant died or runs another plan\n", TURN_TIMEOUT_MS);
		exit(1);
	}
	char buf[32];
	ssize_t k = read(in, buf, sizeof buf - 1);
	CHECK_SYS(k > 0, "read the turn");
	buf[k] = 0;
	char *end;
	long turn = strtol(buf, &end, 10);
	CHECK_SYS(end != buf && (*end == '\n' || *end == 0), "a turn token that is not a number");
	return (int)turn;
}

static void pass_turn(int out, int turn) {
	char buf[32];
	int n = snprintf(buf, sizeof buf, "%d\n", turn + 1);
	CHECK_SYS(write(out, buf, n) == n, "pass the turn");
}

static int open_fifo(const char *path) {
	int fd = open(path, O_RDWR); // never blocks on a FIFO (Linux)
	CHECK_SYS(fd >= 0, "open a FIFO of the ring");
	return fd;
}

static int alloc_ring(char *plan, const char *in_path, const char *out_path, const char *ready_path, int round,
                      int batches, int pairs) {
	static const char *slots[] = {"api", "binding"};
	int in = open_fifo(in_path), out = open_fifo(out_path), ready = open_fifo(ready_path);
	CHECK(cudaSetDevice(0));
	CHECK(cudaFree(0)); // the context, before saying ready
	dprintf(ready, "ready cref %d\n", (int)getpid());
	close(ready);
	for (char *save = NULL, *entry = strtok_r(plan, " ", &save); entry; entry = strtok_r(NULL, " ", &save)) {
		// hit and miss measure cudapool's cache; C has none and runs its plain pair on
		// an exportable pool there, the pair issue 11 compares with.
		char *eq = strchr(entry, '=');
		int local = strncmp(entry, "local/", 6) == 0;
		int ipc = strncmp(entry, "ipc/", 4) == 0 || strncmp(entry, "hit/", 4) == 0 || strncmp(entry, "miss/", 5) == 0;
		if (!eq || !(local || ipc)) {
			fprintf(stderr, "cref: plan entry %s: want KIND/SIZE=BYTES, KIND one of ipc, local, hit, miss\n", entry);
			return 2;
		}
		*eq = 0;
		char *end;
		size_t bytes = strtoull(eq + 1, &end, 10);
		if (*end || bytes == 0) {
			fprintf(stderr, "cref: plan entry %s: bad bytes %s\n", entry, eq + 1);
			return 2;
		}
		for (int slot = 0; slot < 2; slot++) {
			cudaMemPool_t pool = 0;
			cudaStream_t s = 0;
			for (int b = -1; b < batches; b++) {
				int turn = take_turn(in);
				void *p;
				if (b == -1) { // set up inside the first turn: nothing of it beside another's batch
					pool = pool_of(ipc ? cudaMemHandleTypePosixFileDescriptor : cudaMemHandleTypeNone);
					s = new_stream();
					CHECK(cudaMallocFromPoolAsync(&p, bytes, pool, s)); // the pool reserves its memory once
					CHECK(cudaFreeAsync(p, s));
					CHECK(cudaStreamSynchronize(s));
					printf("bytes c alloc/%s %zu\n", entry, bytes);
				}
				double t0 = now_ns();
				for (int i = 0; i < pairs; i++) {
					CHECK(cudaMallocFromPoolAsync(&p, bytes, pool, s));
					CHECK(cudaFreeAsync(p, s));
				}
				CHECK(cudaStreamSynchronize(s));
				double us = (now_ns() - t0) / 1e3 / pairs;
				if (b == batches - 1) {
					CHECK(cudaStreamDestroy(s));
					CHECK(cudaMemPoolDestroy(pool));
				}
				if (b >= 0) printf("sample c %s alloc/%s %d %d %d %.4f\n", slots[slot], entry, round, b, turn, us);
				fflush(stdout);
				pass_turn(out, turn);
			}
		}
	}
	return 0;
}

// spawn forks a child before any CUDA call (CUDA does not survive a fork) that runs
// role on its end of a new socket pair, and returns the parent's end.
// The child closes the parent's ends of earlier children's sockets, so that each
// child sees its end close when the parent exits, and cannot hang on it.
static int spawn(int (*role)(int), pid_t *pid) {
	static int parent_ends[2 + CONSUMERS], spawned;
	int socks[2];
	CHECK_SYS(spawned < 2 + CONSUMERS, "spawn: too many children");
	CHECK_SYS(socketpair(AF_UNIX, SOCK_STREAM, 0, socks) == 0, "socketpair");
	*pid = fork();
	CHECK_SYS(*pid >= 0, "fork");
	if (*pid == 0) {
		for (int i = 0; i < spawned; i++) close(parent_ends[i]);
		close(socks[0]);
		exit(role(socks[1]));
	}
	close(socks[1]);
	parent_ends[spawned++] = socks[0];
	return socks[0];
}

static int reap(pid_t pid, const char *what) {
	int status;
	CHECK_SYS(waitpid(pid, &status, 0) == pid, "waitpid");
	if (!WIFEXITED(status) || WEXITSTATUS(status) != 0) {
		fprintf(stderr, "cref: the %s failed (status %#x)\n", what, status);
		return 1;
	}
	return 0;
}

static int usage(void) {
	fprintf(stderr, "usage: cref bench | all | alloc PLAN IN OUT READY ROUND BATCHES PAIRS\n");
	return 2;
}

int main(int argc, char **argv) {
	const char *mode = argc > 1 ? argv[1] : "all";
	if (strcmp(mode, "alloc") == 0) {
		if (argc != 9) return usage();
		int round = atoi(argv[6]), batches = atoi(argv[7]), pairs = atoi(argv[8]);
		if (batches < 1 || pairs < 1) return usage();
		return alloc_ring(argv[2], argv[3], argv[4], argv[5], round, batches, pairs);
	}
	bench_mode = strcmp(mode, "bench") == 0;
	if (!bench_mode && strcmp(mode, "all") != 0) return usage();
	// Children first: CUDA does not survive a fork. In "all" the consumers wait,
	// without touching CUDA, until sharing sends them the pool.
	pid_t exporter_pid, consumer_pid[CONSUMERS + 1];
	int exporter_sock = spawn(exporter, &exporter_pid), socks[CONSUMERS + 1];
	if (!bench_mode)
		for (int c = 0; c <= OTHER; c++) socks[c] = spawn(consumer, &consumer_pid[c]);

	int runtime = 0, driver = 0;
	CHECK(cudaRuntimeGetVersion(&runtime));
	CHECK(cudaDriverGetVersion(&driver));
	CHECK(cudaSetDevice(0));
	printf("cref runtime %d driver %d\n", runtime, driver);
	int failed = 0;
	if (bench_mode) {
		malloc_free_pair("MallocFreePair/1KiB", 1 << 10);
		malloc_free_pair("MallocFreePair/1MiB", MiB);
		malloc_free_pair("MallocFreePair/64MiB", 64 * MiB);
		export_pointer();
		import_pointer(exporter_sock);
		event_record_wait();
		return reap(exporter_pid, "exporter");
	}
	// The exporter works (CUDA) until import_pointer has its records, and nothing
	// timed runs before.
	import_pointer(exporter_sock);
	failed |= reap(exporter_pid, "exporter");
	legacy_malloc_free_pair("alloc/1KiB", 1 << 10);
	legacy_malloc_free_pair("alloc/1MiB", MiB);
	legacy_malloc_free_pair("alloc/64MiB", 64 * MiB);
	sharing(socks);
	for (int c = 0; c <= OTHER; c++) failed |= reap(consumer_pid[c], "consumer");
	return failed;
}
