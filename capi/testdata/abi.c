// abi.c checks libcudapool's C interface against bad input, on the software device:
// every call below must return the status named, with a message, and none may crash.
// capi's TestCInterface builds the library and this program and runs it; it prints one
// line per failed check and exits 1 if any failed.
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "cudapool.h"

static int checks, failures;

static void expect(const char *what, int line, int got, int want) {
	checks++;
	const char *msg = cudapool_last_error();
	if (got != want) {
		fprintf(stderr, "line %d: %s = %s (%s), want %s\n", line, what, cudapool_status_name(got), msg,
		        cudapool_status_name(want));
		failures++;
	} else if (want != CUDAPOOL_OK && msg[0] == 0) {
		fprintf(stderr, "line %d: %s = %s without a message\n", line, what, cudapool_status_name(got));
		failures++;
	}
}

#define EXPECT(call, want) expect(#call, __LINE__, (call), (want))

// forked checks that a forked child fails clearly instead of hanging.
static void forked(void) {
	pid_t pid = fork();
	if (pid == 0) {
		int v = 0;
		int rc = cudapool_protocol_version(&v);
		int fork_named = strstr(cudapool_last_error(), "spawn") != NULL;
		void *p = cudapool_torch_malloc(1 << 20, 0, NULL);
		_exit(rc == CUDAPOOL_EFORK && fork_named && p == NULL ? 0 : 1);
	}
	int status = -1;
	for (int i = 0; i < 3000; i++) { // 30 s
		if (waitpid(pid, &status, WNOHANG) == pid) break;
		struct timespec ts = {0, 10 * 1000 * 1000};
		nanosleep(&ts, NULL);
	}
	checks++;
	if (status == -1) {
		kill(pid, SIGKILL);
		waitpid(pid, &status, 0);
		fprintf(stderr, "a forked child hung in the library\n");
		failures++;
	} else if (!WIFEXITED(status) || WEXITSTATUS(status) != 0) {
		fprintf(stderr, "a forked child did not get CUDAPOOL_EFORK naming spawn (status %#x)\n", status);
		failures++;
	}
}

int main(void) {
	char why[256], buf[8192], name[300];
	size_t len = 0;
	uint64_t pool = 0, ex = 0, imp = 0, m = 0;
	void *p = NULL, *q = NULL;
	int v = 0;

	EXPECT(cudapool_init("test", why, sizeof why), CUDAPOOL_OK);
	EXPECT(cudapool_init("gpu", why, sizeof why), CUDAPOOL_ENORUNTIME);
	EXPECT(cudapool_init("test", NULL, 0), CUDAPOOL_OK);
	EXPECT(cudapool_protocol_version(NULL), CUDAPOOL_EINVAL);
	EXPECT(cudapool_protocol_version(&v), CUDAPOOL_OK);

	// Pools and pointers.
	EXPECT(cudapool_pool_create(0, NULL, NULL), CUDAPOOL_EINVAL);
	cudapool_pool_options o;
	cudapool_pool_options_default(&o);
	o.peer_count = 2; // with no peer_devices
	EXPECT(cudapool_pool_create(0, &o, &pool), CUDAPOOL_EINVAL);
	o.peer_count = -1;
	EXPECT(cudapool_pool_create(0, &o, &pool), CUDAPOOL_EINVAL);
	o.peer_count = 0;
	o.handle_type = 77;
	EXPECT(cudapool_pool_create(0, &o, &pool), CUDAPOOL_EINVAL);
	EXPECT(cudapool_pool_create(-1, NULL, &pool), CUDAPOOL_EINVAL);
	EXPECT(cudapool_pool_create(0, NULL, &pool), CUDAPOOL_OK);
	EXPECT(cudapool_alloc(pool, 0, NULL, &p), CUDAPOOL_EINVAL);
	EXPECT(cudapool_alloc(pool, 1 << 20, NULL, NULL), CUDAPOOL_EINVAL);
	EXPECT(cudapool_alloc(0, 1 << 20, NULL, &p), CUDAPOOL_EHANDLE);
	EXPECT(cudapool_alloc(0xdeadbeefcafe, 1 << 20, NULL, &p), CUDAPOOL_EHANDLE);
	EXPECT(cudapool_alloc(pool + 1, 1 << 20, NULL, &p), CUDAPOOL_EHANDLE);
	EXPECT(cudapool_alloc(pool, 1 << 20, NULL, &p), CUDAPOOL_OK);
	EXPECT(cudapool_alloc(pool, 1 << 20, NULL, &q), CUDAPOOL_OK);
	EXPECT(cudapool_free(NULL, NULL), CUDAPOOL_EINVAL);
	EXPECT(cudapool_free((void *)0x1234, NULL), CUDAPOOL_EPOINTER);
	EXPECT(cudapool_free((char *)p + 8, NULL), CUDAPOOL_EPOINTER);
	EXPECT(cudapool_free(q, NULL), CUDAPOOL_OK);
	EXPECT(cudapool_free(q, NULL), CUDAPOOL_EPOINTER);
	EXPECT(cudapool_pool_stats_get(pool, NULL), CUDAPOOL_EINVAL);
	EXPECT(cudapool_copy_to_device(0, NULL, buf, 8, NULL), CUDAPOOL_EINVAL);
	EXPECT(cudapool_copy_to_device(0, p, NULL, 8, NULL), CUDAPOOL_EINVAL);
	EXPECT(cudapool_copy_from_device(0, buf, p, 0, NULL), CUDAPOOL_EINVAL);
	EXPECT(cudapool_stream_destroy(0, NULL), CUDAPOOL_EINVAL);

	// The exporter.
	EXPECT(cudapool_exporter_listen(NULL, NULL, 0, &ex), CUDAPOOL_EINVAL);
	EXPECT(cudapool_exporter_listen("/tmp/x.sock", NULL, 0, NULL), CUDAPOOL_EINVAL);
	EXPECT(cudapool_exporter_listen("/tmp/x.sock", NULL, 0x100, &ex), CUDAPOOL_EINVAL);
	char sock[64];
	snprintf(sock, sizeof sock, "/tmp/cudapool-abi-%d.sock", (int)getpid());
	EXPECT(cudapool_exporter_listen(sock, "abi", CUDAPOOL_LISTEN_RETAIN_IMPORTS, &ex), CUDAPOOL_OK);
	EXPECT(cudapool_exporter_listen(sock, "abi", 0, &imp), CUDAPOOL_EEXIST);
	memset(name, 'x', 256);
	name[256] = 0;
	EXPECT(cudapool_exporter_publish(ex, name, p, 0, NULL, NULL, 0), CUDAPOOL_EINVAL);
	EXPECT(cudapool_exporter_publish(ex, "", p, 0, NULL, NULL, 0), CUDAPOOL_EINVAL);
	EXPECT(cudapool_exporter_publish(ex, NULL, p, 0, NULL, NULL, 0), CUDAPOOL_EINVAL);
	EXPECT(cudapool_exporter_publish(ex, "a", NULL, 0, NULL, NULL, 0), CUDAPOOL_EINVAL);
	EXPECT(cudapool_exporter_publish(ex, "a", (void *)0x1234, 0, NULL, NULL, 0), CUDAPOOL_EPOINTER);
	EXPECT(cudapool_exporter_publish(ex, "a", q, 0, NULL, NULL, 0), CUDAPOOL_EPOINTER); // freed
	EXPECT(cudapool_exporter_publish(ex, "a", p, (1 << 20) + 1, NULL, NULL, 0), CUDAPOOL_EINVAL);
	EXPECT(cudapool_exporter_publish(ex, "a", p, 0, NULL, NULL, 4097), CUDAPOOL_EINVAL);
	EXPECT(cudapool_exporter_publish(ex, "a", p, 0, NULL, buf, CUDAPOOL_MAX_META + 1), CUDAPOOL_EINVAL);
	EXPECT(cudapool_exporter_publish(pool, "a", p, 0, NULL, NULL, 0), CUDAPOOL_EHANDLE); // a pool's handle
	EXPECT(cudapool_exporter_publish(ex, "a", (char *)p + 100, 50, NULL, "m", 1), CUDAPOOL_OK);
	EXPECT(cudapool_exporter_publish(ex, "a", p, 0, NULL, NULL, 0), CUDAPOOL_EEXIST);
	EXPECT(cudapool_exporter_unpublish(ex, "nope"), CUDAPOOL_ENOTFOUND);
	EXPECT(cudapool_exporter_push(ex, 1, "a", 1000), CUDAPOOL_ENOTFOUND); // no such peer
	EXPECT(cudapool_exporter_push(ex, 1, "a", -1), CUDAPOOL_EINVAL);
	EXPECT(cudapool_exporter_state(ex, buf, 4, &len), CUDAPOOL_ERANGE);
	checks++;
	if (len <= 4) {
		fprintf(stderr, "state: ERANGE without the size needed\n");
		failures++;
	}
	EXPECT(cudapool_exporter_state(ex, buf, sizeof buf, NULL), CUDAPOOL_EINVAL);
	EXPECT(cudapool_exporter_state(ex, buf, sizeof buf, &len), CUDAPOOL_OK);
	EXPECT(cudapool_query_state(sock, 5000, buf, sizeof buf, &len), CUDAPOOL_OK);
	EXPECT(cudapool_query_state("/nonexistent/x.sock", 5000, buf, sizeof buf, &len), CUDAPOOL_EGONE);

	// The importer side, without a second process: the failures.
	EXPECT(cudapool_importer_dial("/nonexistent/x.sock", 0, 1000, &imp), CUDAPOOL_EGONE);
	EXPECT(cudapool_importer_dial(sock, 0, -1, &imp), CUDAPOOL_EINVAL);
	EXPECT(cudapool_importer_dial(sock, 0, 1000, NULL), CUDAPOOL_EINVAL);
	EXPECT(cudapool_importer_open(ex, "a", NULL, 1000, &m), CUDAPOOL_EHANDLE); // an exporter's handle
	EXPECT(cudapool_mapping_info(0, &p, NULL, NULL), CUDAPOOL_EHANDLE);
	EXPECT(cudapool_mapping_meta(12345, buf, sizeof buf, &len), CUDAPOOL_EHANDLE);
	EXPECT(cudapool_mapping_release(ex, NULL, 1000), CUDAPOOL_EHANDLE);
	EXPECT(cudapool_importer_close(0, 1000), CUDAPOOL_EHANDLE);

	// The PyTorch entry points.
	checks++;
	if (cudapool_torch_malloc(-5, 0, NULL) != NULL || strstr(cudapool_last_error(), "negative") == NULL) {
		fprintf(stderr, "torch_malloc(-5) did not fail with a message\n");
		failures++;
	}
	cudapool_torch_free((void *)0x1234, 16, 0, NULL); // an error to read, not a crash
	checks++;
	if (strstr(cudapool_last_error(), "not a pointer of a cudapool pool") == NULL) {
		fprintf(stderr, "torch_free of a foreign pointer said %s\n", cudapool_last_error());
		failures++;
	}
	EXPECT(cudapool_torch_configure(NULL), CUDAPOOL_EINVAL);

	forked();

	// Use after close.
	EXPECT(cudapool_exporter_close(ex, 5000), CUDAPOOL_OK);
	EXPECT(cudapool_exporter_close(ex, 5000), CUDAPOOL_EHANDLE);
	EXPECT(cudapool_exporter_unpublish(ex, "a"), CUDAPOOL_EHANDLE);
	EXPECT(cudapool_pool_close(pool, 0, 5000), CUDAPOOL_EBUSY);
	EXPECT(cudapool_pool_close(pool, 1, 5000), CUDAPOOL_OK);
	EXPECT(cudapool_pool_close(pool, 1, 5000), CUDAPOOL_EHANDLE);
	EXPECT(cudapool_alloc(pool, 1 << 20, NULL, &p), CUDAPOOL_EHANDLE);
	EXPECT(cudapool_free(p, NULL), CUDAPOOL_EPOINTER);

	printf("%d checks, %d failed\n", checks, failures);
	return failures ? 1 : 0;
}
