// cref is the C reference for cudart's benchmarks: the same CUDA runtime calls in
// loops of the same shape as cudart/bench_test.go, so that the Go binding's cost can
// be read as a ratio taken in one run on one host. For each benchmark it prints
//
//	cref NAME NS_PER_OP
//
// the median over 15 batches of the time per operation, the batch's closing
// synchronize included, after one batch untimed to warm up. cudart's benchmarks
// report the same statistic. Build: nvcc -O2 -cudart shared -o cref cref.cu
#include <cuda_runtime.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#define CHECK(call) \
	do { \
		cudaError_t e_ = (call); \
		if (e_ != cudaSuccess) { \
			fprintf(stderr, "cref: line %d: %s: %s\n", __LINE__, #call, cudaGetErrorName(e_)); \
			exit(1); \
		} \
	} while (0)
#define CHECK_SYS(ok, what) \
	do { \
		if (!(ok)) { \
			perror("cref: " what); \
			exit(1); \
		} \
	} while (0)

enum { BATCHES = 15, SYNC_EVERY = 10000, EXPORTS_PER_BATCH = 200, IMPORT_BUFFERS = 1000 };
static const size_t MiB = 1 << 20;

static double now_ns(void) {
	struct timespec t;
	clock_gettime(CLOCK_MONOTONIC, &t);
	return t.tv_sec * 1e9 + t.tv_nsec;
}

static int by_value(const void *a, const void *b) {
	double x = *(const double *)a, y = *(const double *)b;
	return (x > y) - (x < y);
}

static void report(const char *name, double per_op[BATCHES]) {
	qsort(per_op, BATCHES, sizeof per_op[0], by_value);
	printf("cref %s %.1f\n", name, per_op[BATCHES / 2]);
	fflush(stdout);
}

// ipc_pool is a pool on device 0 that can be shared as a POSIX fd, as cudart's
// benchmarks use.
static cudaMemPool_t ipc_pool(void) {
	cudaMemPoolProps props;
	memset(&props, 0, sizeof props);
	props.allocType = cudaMemAllocationTypePinned;
	props.handleTypes = cudaMemHandleTypePosixFileDescriptor;
	props.location.type = cudaMemLocationTypeDevice;
	props.location.id = 0;
	cudaMemPool_t pool;
	CHECK(cudaMemPoolCreate(&pool, &props));
	return pool;
}

static cudaStream_t new_stream(void) {
	cudaStream_t s;
	CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
	return s;
}

// malloc_free_pair times the pair; with get_device, each call is preceded by the
// cudaGetDevice that cudart's trampolines make, to tell that cost from cgo's.
static void malloc_free_pair(const char *name, size_t size, int get_device) {
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
			int dev;
			if (get_device) CHECK(cudaGetDevice(&dev));
			CHECK(cudaMallocFromPoolAsync(&p, size, pool, s));
			if (get_device) CHECK(cudaGetDevice(&dev));
			CHECK(cudaFreeAsync(p, s));
		}
		CHECK(cudaStreamSynchronize(s));
		if (b >= 0) per_op[b] = (now_ns() - t0) / SYNC_EVERY;
	}
	report(name, per_op);
	CHECK(cudaStreamDestroy(s));
	CHECK(cudaMemPoolDestroy(pool));
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
	report("ExportPointer", per_op);
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
	report("EventRecordWait", per_op);
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

// exporter runs in the child forked before any CUDA call: it sends its pool's fd
// (SCM_RIGHTS, with one byte), then the export data of IMPORT_BUFFERS buffers of
// 1 MiB, and exits once the parent says every import is freed.
static int exporter(int sock) {
	cudaMemPool_t pool = ipc_pool();
	cudaStream_t s = new_stream();
	int fd;
	CHECK(cudaMemPoolExportToShareableHandle(&fd, pool, cudaMemHandleTypePosixFileDescriptor, 0));
	static cudaMemPoolPtrExportData data[IMPORT_BUFFERS];
	for (int i = 0; i < IMPORT_BUFFERS; i++) {
		void *p;
		CHECK(cudaMallocFromPoolAsync(&p, MiB, pool, s));
		CHECK(cudaStreamSynchronize(s));
		CHECK(cudaMemPoolExportPointer(&data[i], p));
	}
	char byte = 'f', control[CMSG_SPACE(sizeof fd)];
	struct iovec iov = {&byte, 1};
	struct msghdr msg;
	memset(&msg, 0, sizeof msg);
	msg.msg_iov = &iov;
	msg.msg_iovlen = 1;
	msg.msg_control = control;
	msg.msg_controllen = sizeof control;
	struct cmsghdr *c = CMSG_FIRSTHDR(&msg);
	c->cmsg_level = SOL_SOCKET;
	c->cmsg_type = SCM_RIGHTS;
	c->cmsg_len = CMSG_LEN(sizeof fd);
	memcpy(CMSG_DATA(c), &fd, sizeof fd);
	CHECK_SYS(sendmsg(sock, &msg, 0) == 1, "sendmsg");
	write_all(sock, data, sizeof data);
	read_all(sock, &byte, 1);
	return 0;
}

static int receive_fd(int sock) {
	char byte, control[CMSG_SPACE(sizeof(int))];
	struct iovec iov = {&byte, 1};
	struct msghdr msg;
	memset(&msg, 0, sizeof msg);
	msg.msg_iov = &iov;
	msg.msg_iovlen = 1;
	msg.msg_control = control;
	msg.msg_controllen = sizeof control;
	CHECK_SYS(recvmsg(sock, &msg, 0) == 1, "recvmsg");
	struct cmsghdr *c = CMSG_FIRSTHDR(&msg);
	CHECK_SYS(c && c->cmsg_type == SCM_RIGHTS, "recvmsg: no descriptor");
	int fd;
	memcpy(&fd, CMSG_DATA(c), sizeof fd);
	return fd;
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
	report("ImportPointer", per_op);
	CHECK(cudaStreamDestroy(s));
	char byte = 'k';
	write_all(sock, &byte, 1);
}

int main(void) {
	int socks[2];
	CHECK_SYS(socketpair(AF_UNIX, SOCK_STREAM, 0, socks) == 0, "socketpair");
	pid_t child = fork(); // before any CUDA call: CUDA does not survive a fork
	CHECK_SYS(child >= 0, "fork");
	if (child == 0) {
		close(socks[0]);
		return exporter(socks[1]);
	}
	close(socks[1]);

	int runtime = 0, driver = 0;
	CHECK(cudaRuntimeGetVersion(&runtime));
	CHECK(cudaDriverGetVersion(&driver));
	CHECK(cudaSetDevice(0));
	printf("cref runtime %d driver %d\n", runtime, driver);
	malloc_free_pair("MallocFreePair/1KiB", 1 << 10, 0);
	malloc_free_pair("MallocFreePair/1MiB", MiB, 0);
	malloc_free_pair("MallocFreePair/64MiB", 64 * MiB, 0);
	malloc_free_pair("MallocFreePairGetDevice/1MiB", MiB, 1);
	export_pointer();
	import_pointer(socks[0]);
	event_record_wait();

	int status;
	CHECK_SYS(waitpid(child, &status, 0) == child, "waitpid");
	if (!WIFEXITED(status) || WEXITSTATUS(status) != 0) {
		fprintf(stderr, "cref: the exporter failed (status %#x)\n", status);
		return 1;
	}
	return 0;
}
