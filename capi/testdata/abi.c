// abi.c checks libcudapool's C interface against bad input, on the software device:
// every call below must return the status named, with a message, and none may crash.
// capi's TestCInterface builds the library and this program and runs it; it prints one
// line per failed check and exits 1 if any failed.
#include <poll.h>
#include <signal.h>
#include <spawn.h>
#include <stdint.h>
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "cudapool.h"
#include "expect.h"

extern char **environ;

// produce is the producer process of live(): it publishes "a" and "b" from device 0 in
// one batch and waits to be killed (at most two minutes).
static int produce(const char *sock) {
	char why[128];
	cudapool_pool pool;
	cudapool_exporter ex;
	void *a, *b;
	if (cudapool_init("test", why, sizeof why) || cudapool_pool_create(0, NULL, &pool) ||
	    cudapool_alloc(pool, 1 << 20, NULL, 0, &a) || cudapool_alloc(pool, 1 << 20, NULL, 0, &b)) {
		fprintf(stderr, "producer: %s\n", cudapool_last_error());
		return 1;
	}
	cudapool_listen_options lo;
	cudapool_listen_options_default(&lo);
	lo.flags = CUDAPOOL_LISTEN_NO_ANNOUNCE;
	if (cudapool_exporter_listen(sock, &lo, &ex)) {
		fprintf(stderr, "producer: %s\n", cudapool_last_error());
		return 1;
	}
	struct timespec ts = {0, 200 * 1000 * 1000}; // the consumer's waits wait meanwhile
	nanosleep(&ts, NULL);
	cudapool_publish_entry es[2] = {{"a", a, 0, "m", 1}, {"b", b, 4096, NULL, 0}};
	if (cudapool_exporter_publish_all(ex, es, 2, NULL)) {
		fprintf(stderr, "producer: %s\n", cudapool_last_error());
		return 1;
	}
	sleep(120);
	return 0;
}

// live checks the liveness calls against a producer process that is SIGKILLed: the
// waits for an exporter and a name, batches, the done descriptor, the importer's and
// the mappings' states, and a replica that outlives its producer.
static void live(char *self) {
	char sock[64];
	snprintf(sock, sizeof sock, "/tmp/cudapool-abi-live-%d.sock", (int)getpid());
	unlink(sock);
	pid_t pid;
	char *args[] = {self, "produce", sock, NULL};
	if (posix_spawn(&pid, "/proc/self/exe", NULL, NULL, args, environ) != 0) {
		CHECKF(0, "posix_spawn failed");
		return;
	}
	cudapool_importer imp;
	cudapool_dial_options dopts;
	EXPECT(cudapool_dial_options_default(&dopts), CUDAPOOL_OK);
	dopts.flags = CUDAPOOL_DIAL_WAIT_FOR_EXPORTER;
	EXPECT(cudapool_importer_dial(sock, 1, &dopts, 60000, &imp), CUDAPOOL_OK); // device 1: a peer GPU
	cudapool_open_options oo;
	EXPECT(cudapool_open_options_default(&oo), CUDAPOOL_OK);
	oo.flags = CUDAPOOL_OPEN_WAIT_FOR_NAME;
	cudapool_mapping m[2], one, replica;
	EXPECT(cudapool_importer_open(imp, "b", NULL, &oo, 60000, &one), CUDAPOOL_OK);
	const char *names[] = {"a", "b"};
	EXPECT(cudapool_importer_open_all(imp, names, 2, NULL, 10000, m), CUDAPOOL_OK);
	uint64_t size = 0;
	EXPECT(cudapool_mapping_info(m[1], NULL, &size, NULL), CUDAPOOL_OK);
	CHECKF(size == 4096, "mapping b has %llu bytes, want 4096", (unsigned long long)size);
	cudapool_mapping dup[2] = {m[0], m[0]};
	EXPECT(cudapool_importer_release_all(imp, dup, 2, NULL, 10000), CUDAPOOL_EINVAL);
	EXPECT(cudapool_importer_release_all(imp, dup, SIZE_MAX, NULL, 10000), CUDAPOOL_EINVAL);
	EXPECT(cudapool_importer_open_all(imp, names, SIZE_MAX, NULL, 10000, m), CUDAPOOL_EINVAL);
	oo.flags = CUDAPOOL_OPEN_LOCAL_COPY;
	EXPECT(cudapool_importer_open(imp, "a", NULL, &oo, 10000, &replica), CUDAPOOL_OK);
	EXPECT(cudapool_importer_open(imp, "a", NULL, NULL, 10000, NULL), CUDAPOOL_EINVAL);

	int fd = -1;
	EXPECT(cudapool_importer_done_fd(imp, NULL), CUDAPOOL_EINVAL);
	EXPECT(cudapool_importer_done_fd(imp, &fd), CUDAPOOL_OK);
	struct pollfd pfd = {fd, POLLIN, 0};
	CHECKF(poll(&pfd, 1, 0) == 0, "the done descriptor is readable while the exporter lives");
	EXPECT(cudapool_importer_err(imp), CUDAPOOL_OK);
	EXPECT(cudapool_mapping_err(m[0]), CUDAPOOL_OK);

	kill(pid, SIGKILL);
	int status;
	waitpid(pid, &status, 0);
	CHECKF(poll(&pfd, 1, 30000) == 1 && (pfd.revents & (POLLIN | POLLHUP)),
	       "the done descriptor did not become readable in 30 s after the exporter died");
	EXPECT(cudapool_importer_err(imp), CUDAPOOL_EGONE);
	// The loss follows the kernel's word that the process exited, which may come a
	// moment after the connection's end.
	for (int i = 0; i < 3000 && cudapool_mapping_err(m[0]) != CUDAPOOL_ELOST; i++) {
		struct timespec ts = {0, 10 * 1000 * 1000};
		nanosleep(&ts, NULL);
	}
	EXPECT(cudapool_mapping_err(m[0]), CUDAPOOL_ELOST);
	EXPECT(cudapool_mapping_err(replica), CUDAPOOL_OK);
	EXPECT(cudapool_importer_open(imp, "a", NULL, NULL, 10000, &one), CUDAPOOL_EGONE);
	EXPECT(cudapool_importer_release_all(imp, m, 2, NULL, 10000), CUDAPOOL_OK);
	EXPECT(cudapool_mapping_err(m[0]), CUDAPOOL_EHANDLE);
	EXPECT(cudapool_mapping_release(replica, NULL, 10000), CUDAPOOL_OK);
	EXPECT(cudapool_importer_close(imp, 10000), CUDAPOOL_OK);
	unlink(sock);
}

static int logged;
static void count_log(int level, const char *msg, void *arg) {
	(void)level, (void)msg;
	*(int *)arg += 1;
}

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

int main(int argc, char **argv) {
	if (argc == 3 && strcmp(argv[1], "produce") == 0) return produce(argv[2]);
	char why[256], buf[8192], name[300];
	size_t len = 0;
	cudapool_pool pool = {0};
	cudapool_exporter ex = {0}, ex2;
	cudapool_importer imp = {0};
	cudapool_mapping m = {0};
	void *p = NULL, *q = NULL;
	int v = 0, minor = -1;

	EXPECT(cudapool_set_log(99, NULL, NULL), CUDAPOOL_EINVAL);
	EXPECT(cudapool_set_log(CUDAPOOL_LOG_DEBUG, count_log, &logged), CUDAPOOL_OK);
	EXPECT(cudapool_version(&v, &minor), CUDAPOOL_OK);
	CHECKF(v == CUDAPOOL_VERSION_MAJOR && minor == CUDAPOOL_VERSION_MINOR, "version %d.%d", v, minor);
	CHECKF(strcmp(cudapool_status_name(CUDAPOOL_ENOSPACE), "CUDAPOOL_ENOSPACE") == 0, "the last status has no name");
	CHECKF(strcmp(cudapool_status_name(CUDAPOOL_ENOSPACE + 1), "CUDAPOOL_UNKNOWN") == 0, "a status past the last has a name");
	EXPECT(cudapool_init("test", why, SIZE_MAX), CUDAPOOL_OK); // a length larger than the buffer is the caller's word
	EXPECT(cudapool_init("test", why, sizeof why), CUDAPOOL_OK);
	EXPECT(cudapool_init("gpu", why, sizeof why), CUDAPOOL_ENORUNTIME);
	EXPECT(cudapool_init("test", NULL, 0), CUDAPOOL_OK);
	EXPECT(cudapool_protocol_version(NULL), CUDAPOOL_EINVAL);
	EXPECT(cudapool_protocol_version(&v), CUDAPOOL_OK);

	int gpu = -1, devs = 0;
	EXPECT(cudapool_runtime_info(&gpu, &devs, name, SIZE_MAX), CUDAPOOL_OK);

	// Options structs: their size.
	cudapool_pool_options o;
	EXPECT(cudapool_pool_options_init(&o, 8), CUDAPOOL_EINVAL);
	EXPECT(cudapool_pool_options_init(NULL, sizeof o), CUDAPOOL_EINVAL);
	memset(&o, 0, sizeof o); // zeroed: no size
	EXPECT(cudapool_pool_create(0, &o, &pool), CUDAPOOL_EINVAL);
	CHECKF(strstr(cudapool_last_error(), "cudapool_pool_options_default") != NULL, "a zeroed struct's message: %s", cudapool_last_error());
	struct {
		cudapool_pool_options o;
		uint64_t newer;
	} grown;
	EXPECT(cudapool_pool_options_init(&grown.o, sizeof grown), CUDAPOOL_OK);
	CHECKF(grown.o.size == sizeof grown && grown.o.handle_type == CUDAPOOL_HANDLE_POSIX_FD, "a larger struct's defaults");
	EXPECT(cudapool_pool_create(0, &grown.o, &pool), CUDAPOOL_OK); // a newer field left zero: its default
	EXPECT(cudapool_pool_close(pool, 0, 1000), CUDAPOOL_OK);
	grown.newer = 1;
	EXPECT(cudapool_pool_create(0, &grown.o, &pool), CUDAPOOL_ENOTSUP); // a newer field set
	EXPECT(cudapool_pool_options_default(&o), CUDAPOOL_OK);
	o.handle_type = 55;
	EXPECT(cudapool_torch_configure(&o), CUDAPOOL_EINVAL);
	o.handle_type = CUDAPOOL_HANDLE_POSIX_FD;
	o.wait_for_memory = 1;
	EXPECT(cudapool_torch_configure(&o), CUDAPOOL_EINVAL);

	// Pools and pointers.
	EXPECT(cudapool_pool_create(0, NULL, NULL), CUDAPOOL_EINVAL);
	cudapool_pool_options_default(&o);
	o.peer_count = 2; // with no peer_devices
	EXPECT(cudapool_pool_create(0, &o, &pool), CUDAPOOL_EINVAL);
	o.peer_count = -1;
	EXPECT(cudapool_pool_create(0, &o, &pool), CUDAPOOL_EINVAL);
	int one_peer[1] = {0};
	o.peer_devices = one_peer;
	o.peer_count = INT_MAX; // N6: a count no device list has, checked before it is read
	EXPECT(cudapool_pool_create(0, &o, &pool), CUDAPOOL_EINVAL);
	EXPECT(cudapool_torch_configure(&o), CUDAPOOL_EINVAL);
	o.peer_devices = NULL;
	o.peer_count = 0;
	o.handle_type = 77;
	EXPECT(cudapool_pool_create(0, &o, &pool), CUDAPOOL_EINVAL);
	EXPECT(cudapool_pool_create(-1, NULL, &pool), CUDAPOOL_EINVAL);
	cudapool_pool small;
	cudapool_pool_options_default(&o);
	o.max_size = 4 << 20;
	o.wait_for_memory = 1;
	EXPECT(cudapool_pool_create(0, &o, &small), CUDAPOOL_OK);
	EXPECT(cudapool_alloc(small, 8 << 20, NULL, 0, &p), CUDAPOOL_ENOMEM); // never fits: at once
	EXPECT(cudapool_alloc(small, 4 << 20, NULL, 0, &p), CUDAPOOL_OK);
	EXPECT(cudapool_alloc(small, 1 << 20, NULL, 50, &q), CUDAPOOL_ETIMEOUT); // full: waits 50 ms
	EXPECT(cudapool_free(p, NULL), CUDAPOOL_OK);
	EXPECT(cudapool_alloc(small, UINT64_MAX - 5, NULL, 0, &p), CUDAPOOL_EINVAL); // rounding overflows
	CHECKF(strstr(cudapool_last_error(), "18446744073709551610") != NULL, "the size unsigned: %s", cudapool_last_error());
	EXPECT(cudapool_pool_close(small, 0, 1000), CUDAPOOL_OK);
	EXPECT(cudapool_pool_create(0, NULL, &pool), CUDAPOOL_OK);
	EXPECT(cudapool_alloc(pool, 0, NULL, 0, &p), CUDAPOOL_EINVAL);
	EXPECT(cudapool_alloc(pool, 1 << 20, NULL, 0, NULL), CUDAPOOL_EINVAL);
	EXPECT(cudapool_alloc((cudapool_pool){0}, 1 << 20, NULL, 0, &p), CUDAPOOL_EHANDLE);
	EXPECT(cudapool_alloc((cudapool_pool){0xdeadbeefcafe}, 1 << 20, NULL, 0, &p), CUDAPOOL_EHANDLE);
	EXPECT(cudapool_alloc((cudapool_pool){pool.h + 1}, 1 << 20, NULL, 0, &p), CUDAPOOL_EHANDLE);
	EXPECT(cudapool_alloc(pool, 1 << 20, NULL, -2, &p), CUDAPOOL_EINVAL);
	EXPECT(cudapool_alloc(pool, 1 << 20, NULL, 0, &p), CUDAPOOL_OK);
	EXPECT(cudapool_alloc(pool, 1 << 20, NULL, 0, &q), CUDAPOOL_OK);
	EXPECT(cudapool_free(NULL, NULL), CUDAPOOL_EINVAL);
	EXPECT(cudapool_free((void *)0x1234, NULL), CUDAPOOL_EPOINTER);
	EXPECT(cudapool_free((char *)p + 8, NULL), CUDAPOOL_EPOINTER);
	EXPECT(cudapool_free(q, NULL), CUDAPOOL_OK);
	EXPECT(cudapool_free(q, NULL), CUDAPOOL_EPOINTER);
	EXPECT(cudapool_pool_stats_get(pool, NULL), CUDAPOOL_EINVAL);
	EXPECT(cudapool_copy_to_device(0, NULL, buf, 8, NULL), CUDAPOOL_EINVAL);
	EXPECT(cudapool_copy_to_device(0, p, NULL, 8, NULL), CUDAPOOL_EINVAL);
	EXPECT(cudapool_copy_from_device(0, buf, p, 0, NULL), CUDAPOOL_EINVAL);
	EXPECT(cudapool_copy_to_device(0, p, buf, SIZE_MAX, NULL), CUDAPOOL_EINVAL);
	EXPECT(cudapool_copy_from_device(0, buf, p, SIZE_MAX, NULL), CUDAPOOL_EINVAL);
	CHECKF(strstr(cudapool_last_error(), "18446744073709551615") != NULL, "the size unsigned: %s", cudapool_last_error());
	EXPECT(cudapool_stream_destroy(0, NULL), CUDAPOOL_EINVAL);

	// The exporter.
	cudapool_listen_options lo;
	EXPECT(cudapool_listen_options_default(&lo), CUDAPOOL_OK);
	EXPECT(cudapool_exporter_listen(NULL, NULL, &ex), CUDAPOOL_EINVAL);
	EXPECT(cudapool_exporter_listen("/tmp/x.sock", NULL, NULL), CUDAPOOL_EINVAL);
	lo.flags = 0x100;
	EXPECT(cudapool_exporter_listen("/tmp/x.sock", &lo, &ex), CUDAPOOL_EINVAL);
	lo.flags = 0;
	lo.uid_count = 2; // with no allow_uids
	EXPECT(cudapool_exporter_listen("/tmp/x.sock", &lo, &ex), CUDAPOOL_EINVAL);
	uint32_t one_uid[1] = {0};
	lo.allow_uids = one_uid;
	lo.uid_count = SIZE_MAX;
	EXPECT(cudapool_exporter_listen("/tmp/x.sock", &lo, &ex), CUDAPOOL_EINVAL);
	lo.allow_uids = NULL;
	lo.uid_count = 0;
	lo.max_grants = -1;
	EXPECT(cudapool_exporter_listen("/tmp/x.sock", &lo, &ex), CUDAPOOL_EINVAL);
	char sock[64];
	snprintf(sock, sizeof sock, "/tmp/cudapool-abi-%d.sock", (int)getpid());
	uint32_t me = (uint32_t)getuid();
	lo.name = "abi";
	lo.flags = CUDAPOOL_LISTEN_RETAIN_IMPORTS | CUDAPOOL_LISTEN_SOCKET_FOLLOWS_POLICY;
	lo.allow_uids = &me;
	lo.uid_count = 1;
	lo.max_grants = 8;
	EXPECT(cudapool_exporter_listen(sock, &lo, &ex), CUDAPOOL_OK);
	EXPECT(cudapool_exporter_listen(sock, &lo, &ex2), CUDAPOOL_EEXIST);
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
	EXPECT(cudapool_exporter_publish(ex, "a", p, 0, NULL, buf, SIZE_MAX), CUDAPOOL_EINVAL);
	CHECKF(strstr(cudapool_last_error(), "18446744073709551615") != NULL, "the size unsigned: %s", cudapool_last_error());
	EXPECT(cudapool_exporter_publish_all(ex, NULL, 1, NULL), CUDAPOOL_EINVAL);
	cudapool_publish_entry es[2] = {{"pa", p, 0, NULL, 0}, {"pb", (void *)0x1234, 0, NULL, 0}};
	EXPECT(cudapool_exporter_publish_all(ex, es, 0, NULL), CUDAPOOL_EINVAL);
	EXPECT(cudapool_exporter_publish_all(ex, es, CUDAPOOL_MAX_BATCH + 1, NULL), CUDAPOOL_EINVAL);
	EXPECT(cudapool_exporter_publish_all(ex, es, SIZE_MAX, NULL), CUDAPOOL_EINVAL);
	EXPECT(cudapool_exporter_publish_all(ex, es, 2, NULL), CUDAPOOL_EPOINTER);
	EXPECT(cudapool_exporter_unpublish(ex, "pa"), CUDAPOOL_ENOTFOUND); // all or none
	EXPECT(cudapool_exporter_publish((cudapool_exporter){pool.h}, "a", p, 0, NULL, NULL, 0), CUDAPOOL_EHANDLE); // a pool's handle
	EXPECT(cudapool_exporter_publish(ex, "a", (char *)p + 100, 50, NULL, "m", 1), CUDAPOOL_OK);
	EXPECT(cudapool_exporter_publish(ex, "a", p, 0, NULL, NULL, 0), CUDAPOOL_EEXIST);
	EXPECT(cudapool_exporter_unpublish(ex, "nope"), CUDAPOOL_ENOTFOUND);
	EXPECT(cudapool_exporter_push(ex, 1, "a", 1000), CUDAPOOL_ENOTFOUND); // no such peer
	EXPECT(cudapool_exporter_push(ex, 1, "a", -2), CUDAPOOL_EINVAL);
	EXPECT(cudapool_exporter_push(ex, 1, "a", INT64_MIN), CUDAPOOL_EINVAL);
	// CUDAPOOL_NO_WAIT: the wait flag is off, so an exporter not there yet is EGONE at once.
	cudapool_dial_options wait_opts;
	cudapool_dial_options_default(&wait_opts);
	wait_opts.flags = CUDAPOOL_DIAL_WAIT_FOR_EXPORTER;
	cudapool_importer nobody;
	EXPECT(cudapool_importer_dial("/tmp/cudapool-abi-nobody.sock", 0, &wait_opts, CUDAPOOL_NO_WAIT, &nobody),
	       CUDAPOOL_EGONE);
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
	EXPECT(cudapool_importer_dial("/nonexistent/x.sock", 0, NULL, 1000, &imp), CUDAPOOL_EGONE);
	cudapool_dial_options dopts;
	cudapool_dial_options_default(&dopts);
	dopts.flags = CUDAPOOL_DIAL_WAIT_FOR_EXPORTER;
	EXPECT(cudapool_importer_dial("/nonexistent/x.sock", 0, &dopts, 100, &imp), CUDAPOOL_ETIMEOUT);
	dopts.flags = 0x40;
	EXPECT(cudapool_importer_dial(sock, 0, &dopts, 1000, &imp), CUDAPOOL_EINVAL);
	EXPECT(cudapool_importer_dial(sock, 0, NULL, -2, &imp), CUDAPOOL_EINVAL);
	EXPECT(cudapool_importer_dial(sock, 0, NULL, 1000, NULL), CUDAPOOL_EINVAL);
	EXPECT(cudapool_importer_dial(sock, 0, NULL, 5000, &imp), CUDAPOOL_ENOTSUP); // its own export
	CHECKF(strstr(cudapool_last_error(), "own") != NULL, "own export: %s", cudapool_last_error());
	EXPECT(cudapool_importer_open((cudapool_importer){ex.h}, "a", NULL, NULL, 1000, &m), CUDAPOOL_EHANDLE); // an exporter's handle
	EXPECT(cudapool_mapping_info((cudapool_mapping){0}, &p, NULL, NULL), CUDAPOOL_EHANDLE);
	EXPECT(cudapool_mapping_meta((cudapool_mapping){12345}, buf, sizeof buf, &len), CUDAPOOL_EHANDLE);
	EXPECT(cudapool_mapping_release((cudapool_mapping){ex.h}, NULL, 1000), CUDAPOOL_EHANDLE);
	EXPECT(cudapool_mapping_err((cudapool_mapping){ex.h}), CUDAPOOL_EHANDLE);
	EXPECT(cudapool_importer_err((cudapool_importer){0}), CUDAPOOL_EHANDLE);
	EXPECT(cudapool_importer_close((cudapool_importer){0}, 1000), CUDAPOOL_EHANDLE);

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
	live(argv[0]);

	// Use after close.
	EXPECT(cudapool_exporter_close(ex, 5000), CUDAPOOL_OK);
	EXPECT(cudapool_exporter_close(ex, 5000), CUDAPOOL_EHANDLE);
	EXPECT(cudapool_exporter_unpublish(ex, "a"), CUDAPOOL_EHANDLE);
	EXPECT(cudapool_pool_close(pool, 0, 5000), CUDAPOOL_EBUSY);
	EXPECT(cudapool_pool_close(pool, 1, 5000), CUDAPOOL_OK);
	EXPECT(cudapool_pool_close(pool, 1, 5000), CUDAPOOL_EHANDLE);
	EXPECT(cudapool_alloc(pool, 1 << 20, NULL, 0, &p), CUDAPOOL_EHANDLE);
	EXPECT(cudapool_free(p, NULL), CUDAPOOL_EPOINTER);

	CHECKF(logged > 0, "nothing came to the log function (the probe of a live path, the producer's death)");
	EXPECT(cudapool_set_log(CUDAPOOL_LOG_OFF, NULL, NULL), CUDAPOOL_OK);

	printf("%d checks, %d failed\n", checks, failures);
	return failures ? 1 : 0;
}
