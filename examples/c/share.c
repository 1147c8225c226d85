// share.c: a C producer shares a buffer with a C consumer process through libcudapool.
// It runs on the GPU, or on cudapool's software device where there is none (a library
// built with -tags cudapool_softdevice, as below, has it).
//
//     go build -buildmode=c-shared -tags cudapool_softdevice -o bin/libcudapool.so ./capi
//     cc -Icapi examples/c/share.c -Lbin -lcudapool -Wl,-rpath,"$PWD/bin" -o bin/share-c
//     bin/share-c
//
// The producer publishes "greeting" and starts itself again as the consumer
// (posix_spawn: a process that loaded the library must not fork without exec).
#include <spawn.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include "cudapool.h"

extern char **environ;

// CHECK stops the program with the library's message when a call fails.
#define CHECK(call) \
	do { \
		int rc_ = (call); \
		if (rc_ != CUDAPOOL_OK) { \
			fprintf(stderr, "%s failed: %s: %s\n", #call, cudapool_status_name(rc_), cudapool_last_error()); \
			exit(1); \
		} \
	} while (0)

static const char greeting[] = "hello from a C producer";

static int consume(const char *socket) {
	cudapool_importer imp;
	cudapool_mapping m;
	void *ptr;
	uint64_t size;
	char got[sizeof greeting];
	// A new process chooses its runtime again: without this it asks for a GPU.
	CHECK(cudapool_init("auto", NULL, 0));
	CHECK(cudapool_importer_dial(socket, 0, NULL, 10000, &imp));          // NULL: the default options
	CHECK(cudapool_importer_open(imp, "greeting", NULL, NULL, 10000, &m)); // NULL: the default stream
	CHECK(cudapool_mapping_info(m, &ptr, &size, NULL));
	CHECK(cudapool_copy_from_device(0, got, ptr, sizeof got, NULL));
	printf("consumer (pid %d): mapped %llu bytes, read \"%s\"\n", (int)getpid(), (unsigned long long)size, got);
	CHECK(cudapool_mapping_release(m, NULL, 10000));
	CHECK(cudapool_importer_close(imp, 10000));
	return strcmp(got, greeting) == 0 ? 0 : 1;
}

int main(int argc, char **argv) {
	if (argc == 3 && strcmp(argv[1], "consume") == 0) return consume(argv[2]);

	char why[256];
	CHECK(cudapool_init("auto", why, sizeof why)); // a GPU, else the software device, saying so
	printf("%s\n", why);

	cudapool_pool_options opts;
	cudapool_pool_options_default(&opts);
	opts.name = "c-example";
	cudapool_pool pool;
	cudapool_exporter ex;
	void *buf;
	CHECK(cudapool_pool_create(0, &opts, &pool));
	CHECK(cudapool_alloc(pool, 1 << 20, NULL, 10000, &buf));
	CHECK(cudapool_copy_to_device(0, buf, greeting, sizeof greeting, NULL));

	char socket[64];
	snprintf(socket, sizeof socket, "/tmp/cudapool-c-%d.sock", (int)getpid());
	cudapool_listen_options lopts;
	cudapool_listen_options_default(&lopts);
	lopts.name = "share-c";
	CHECK(cudapool_exporter_listen(socket, &lopts, &ex));
	CHECK(cudapool_exporter_publish(ex, "greeting", buf, sizeof greeting, NULL, "text/plain", 10));

	fflush(stdout); // before the consumer's lines
	pid_t pid;
	char *args[] = {argv[0], "consume", socket, NULL};
	if (posix_spawn(&pid, "/proc/self/exe", NULL, NULL, args, environ) != 0) {
		perror("posix_spawn");
		return 1;
	}
	int status = 0;
	waitpid(pid, &status, 0);

	CHECK(cudapool_free(buf, NULL));
	CHECK(cudapool_exporter_close(ex, 10000));
	CHECK(cudapool_pool_close(pool, 0, 10000));
	int ok = WIFEXITED(status) && WEXITSTATUS(status) == 0;
	printf("producer: the consumer %s\n", ok ? "read the greeting" : "FAILED");
	return ok ? 0 : 1;
}
