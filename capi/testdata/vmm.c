// vmm.c checks the VMM route of libcudapool's C interface on the software device: a
// producer makes two chunks, maps them into a reservation, writes them and publishes
// them (the whole allocation, and a range of it across the chunk boundary with
// metadata); a consumer process, this program run as "consume SOCKET", opens both names
// and reads the bytes across the boundary. Every bad input must come back as the status
// named, with a message, and none may crash. capi's TestVMMCInterface builds the
// library and this program and runs it; it prints one line per failed check and exits
// 1 if any failed.
#include <spawn.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include "cudapool.h"
#include "expect.h"

extern char **environ;

#define SPAN 4096 // the bytes read on either side of the chunk boundary

// pattern is the byte the producer writes at offset o of the allocation.
static uint8_t pattern(uint64_t o) { return (uint8_t)(o * 131 + (o >> 12)); }

// consume opens "slab" and "part" of the exporter at sock and checks the bytes around
// the chunk boundary of each; it exits 1 if any check failed.
static int consume(const char *sock) {
	char why[128];
	EXPECT(cudapool_init("test", why, sizeof why), CUDAPOOL_OK);
	uint64_t g = 0;
	EXPECT(cudapool_vmm_granularity(0, 0, &g), CUDAPOOL_OK);
	cudapool_importer imp = {0};
	EXPECT(cudapool_importer_dial(sock, 0, NULL, 60000, &imp), CUDAPOOL_OK);
	cudapool_mapping slab = {0}, part = {0};
	EXPECT(cudapool_importer_open(imp, "slab", NULL, NULL, 60000, &slab), CUDAPOOL_OK);
	EXPECT(cudapool_importer_open(imp, "part", NULL, NULL, 60000, &part), CUDAPOOL_OK);
	void *p = NULL, *q = NULL;
	uint64_t n = 0, m = 0;
	size_t meta_len = 0;
	EXPECT(cudapool_mapping_info(slab, &p, &n, NULL), CUDAPOOL_OK);
	EXPECT(cudapool_mapping_info(part, &q, &m, &meta_len), CUDAPOOL_OK);
	CHECKF(n == 2 * g, "slab is %llu bytes, want %llu", (unsigned long long)n, (unsigned long long)(2 * g));
	CHECKF(m == 2 * SPAN, "part is %llu bytes, want %d", (unsigned long long)m, 2 * SPAN);
	char meta[8] = {0};
	EXPECT(cudapool_mapping_meta(part, meta, sizeof meta, &meta_len), CUDAPOOL_OK);
	CHECK(meta_len == 4 && memcmp(meta, "edge", 4) == 0);

	static uint8_t got[2 * SPAN];
	// The slab from SPAN before the boundary to SPAN after it, in one copy.
	EXPECT(cudapool_copy_from_device(0, got, (char *)p + g - SPAN, sizeof got, NULL), CUDAPOOL_OK);
	int bad = 0;
	for (uint64_t i = 0; i < sizeof got; i++) bad += got[i] != pattern(g - SPAN + i);
	CHECKF(bad == 0, "%d bytes of the slab around the chunk boundary differ", bad);
	memset(got, 0, sizeof got);
	EXPECT(cudapool_copy_from_device(0, got, q, sizeof got, NULL), CUDAPOOL_OK);
	bad = 0;
	for (uint64_t i = 0; i < sizeof got; i++) bad += got[i] != pattern(g - SPAN + i);
	CHECKF(bad == 0, "%d bytes of the published range differ", bad);

	// "k" and "v" are one allocation: mapped once, v a chunk behind k.
	cudapool_mapping k = {0}, v = {0};
	EXPECT(cudapool_importer_open(imp, "k", NULL, NULL, 60000, &k), CUDAPOOL_OK);
	EXPECT(cudapool_importer_open(imp, "v", NULL, NULL, 60000, &v), CUDAPOOL_OK);
	void *kp = NULL, *vp = NULL;
	uint64_t kn = 0, vn = 0;
	EXPECT(cudapool_mapping_info(k, &kp, &kn, NULL), CUDAPOOL_OK);
	EXPECT(cudapool_mapping_info(v, &vp, &vn, NULL), CUDAPOOL_OK);
	CHECKF(kn == g && vn == g, "k is %llu bytes and v %llu, want %llu each", (unsigned long long)kn,
	       (unsigned long long)vn, (unsigned long long)g);
	CHECKF((char *)vp - (char *)kp == (ptrdiff_t)g, "v lies %td bytes behind k, want %llu", (char *)vp - (char *)kp,
	       (unsigned long long)g);
	uint8_t head[SPAN];
	EXPECT(cudapool_copy_from_device(0, head, vp, sizeof head, NULL), CUDAPOOL_OK);
	bad = 0;
	for (uint64_t i = 0; i < sizeof head; i++) bad += head[i] != pattern(g + i);
	CHECKF(bad == 0, "%d bytes at the start of v differ", bad);
	cudapool_mapping kvs[2] = {k, v};
	EXPECT(cudapool_importer_release_all(imp, kvs, 2, NULL, 60000), CUDAPOOL_OK);

	EXPECT(cudapool_mapping_release(slab, NULL, 60000), CUDAPOOL_OK);
	EXPECT(cudapool_mapping_release(part, NULL, 60000), CUDAPOOL_OK);
	EXPECT(cudapool_importer_close(imp, 60000), CUDAPOOL_OK);
	printf("consumer: %d checks, %d failed\n", checks, failures);
	return failures ? 1 : 0;
}

// bad checks what the chunk and reservation calls refuse, with live objects c (a chunk
// of g bytes) and r (a reservation of 2g bytes, nothing mapped).
static void bad(uint64_t g, cudapool_chunk c, cudapool_reservation r, cudapool_exporter ex) {
	cudapool_chunk none = {0}, made_up = {0xDEADBEEF}, out = {0};
	cudapool_reservation rnone = {0};
	cudapool_mapping not_a_chunk = {c.h};
	uint64_t x = 0;
	(void)not_a_chunk;
	EXPECT(cudapool_vmm_granularity(0, 0, NULL), CUDAPOOL_EINVAL);
	EXPECT(cudapool_vmm_granularity(0, 4, &x), CUDAPOOL_EINVAL);
	EXPECT(cudapool_vmm_granularity(-1, 0, &x), CUDAPOOL_EINVAL);
	EXPECT(cudapool_chunk_create(0, g, 0, NULL), CUDAPOOL_EINVAL);
	EXPECT(cudapool_chunk_create(0, 0, 0, &out), CUDAPOOL_EINVAL);
	EXPECT(cudapool_chunk_create(0, g + 1, 0, &out), CUDAPOOL_EINVAL);
	EXPECT(cudapool_chunk_create(0, UINT64_MAX, 0, &out), CUDAPOOL_EINVAL);
	EXPECT(cudapool_chunk_create(0, g, 2, &out), CUDAPOOL_EINVAL);
	EXPECT(cudapool_chunk_create(-1, g, 0, &out), CUDAPOOL_EINVAL);
	// The software device, as a host without an IMEX channel, refuses FABRIC chunks.
	uint64_t gf = 0;
	EXPECT(cudapool_vmm_granularity(0, CUDAPOOL_CHUNK_FABRIC, &gf), CUDAPOOL_OK);
	EXPECT(cudapool_chunk_create(0, gf, CUDAPOOL_CHUNK_FABRIC, &out), CUDAPOOL_ENOTSUP);
	CHECK(strstr(cudapool_last_error(), "IMEX") != NULL);
	CHECK(out.h == 0);
	EXPECT(cudapool_chunk_info(none, NULL, NULL, NULL), CUDAPOOL_EHANDLE);
	EXPECT(cudapool_chunk_info(made_up, NULL, NULL, NULL), CUDAPOOL_EHANDLE);
	EXPECT(cudapool_chunk_close(none), CUDAPOOL_EHANDLE);
	EXPECT(cudapool_reservation_create(0, g, NULL), CUDAPOOL_EINVAL);
	EXPECT(cudapool_reservation_create(0, 0, &rnone), CUDAPOOL_EINVAL);
	EXPECT(cudapool_reservation_create(0, g - 1, &rnone), CUDAPOOL_EINVAL);
	CHECK(rnone.h == 0);
	EXPECT(cudapool_reservation_grow(r, NULL, 1), CUDAPOOL_EINVAL);
	EXPECT(cudapool_reservation_grow(r, &c, 0), CUDAPOOL_EINVAL);
	EXPECT(cudapool_reservation_grow(r, &c, SIZE_MAX), CUDAPOOL_EINVAL);
	EXPECT(cudapool_reservation_grow(r, &made_up, 1), CUDAPOOL_EHANDLE);
	// A reservation's handle where a chunk's is wanted is told apart from a made-up one.
	cudapool_chunk wrong = {r.h};
	EXPECT(cudapool_reservation_grow(r, &wrong, 1), CUDAPOOL_EHANDLE);
	CHECK(strstr(cudapool_last_error(), "reservation") != NULL);
	cudapool_chunk three[3] = {c, c, c}; // 3g into 2g
	EXPECT(cudapool_reservation_grow(r, three, 3), CUDAPOOL_EINVAL);
	EXPECT(cudapool_reservation_grow(rnone, &c, 1), CUDAPOOL_EHANDLE);
	EXPECT(cudapool_reservation_shrink(r, 1), CUDAPOOL_EINVAL);
	EXPECT(cudapool_reservation_shrink(r, SIZE_MAX), CUDAPOOL_EINVAL);
	size_t n = 7;
	EXPECT(cudapool_reservation_info(r, NULL, NULL, NULL, &n), CUDAPOOL_OK);
	CHECKF(n == 0, "%zu chunks mapped after refused grows, want 0", n);
	EXPECT(cudapool_reservation_info(rnone, NULL, NULL, NULL, NULL), CUDAPOOL_EHANDLE);
	EXPECT(cudapool_reservation_close(rnone), CUDAPOOL_EHANDLE);

	char meta[CUDAPOOL_MAX_META + 1] = {0};
	EXPECT(cudapool_exporter_publish_chunks(ex, NULL, &c, 1, 0, 0, NULL, NULL, 0), CUDAPOOL_EINVAL);
	EXPECT(cudapool_exporter_publish_chunks(ex, "x", NULL, 1, 0, 0, NULL, NULL, 0), CUDAPOOL_EINVAL);
	EXPECT(cudapool_exporter_publish_chunks(ex, "x", &c, 0, 0, 0, NULL, NULL, 0), CUDAPOOL_EINVAL);
	EXPECT(cudapool_exporter_publish_chunks(ex, "x", &c, CUDAPOOL_MAX_CHUNKS + 1, 0, 0, NULL, NULL, 0),
	       CUDAPOOL_EINVAL);
	EXPECT(cudapool_exporter_publish_chunks(ex, "x", &c, SIZE_MAX, 0, 0, NULL, NULL, 0), CUDAPOOL_EINVAL);
	EXPECT(cudapool_exporter_publish_chunks(ex, "x", &made_up, 1, 0, 0, NULL, NULL, 0), CUDAPOOL_EHANDLE);
	EXPECT(cudapool_exporter_publish_chunks(ex, "x", &c, 1, g, 1, NULL, NULL, 0), CUDAPOOL_EINVAL);
	EXPECT(cudapool_exporter_publish_chunks(ex, "x", &c, 1, 0, g + 1, NULL, NULL, 0), CUDAPOOL_EINVAL);
	EXPECT(cudapool_exporter_publish_chunks(ex, "x", &c, 1, 0, 0, NULL, meta, sizeof meta), CUDAPOOL_EINVAL);
	EXPECT(cudapool_exporter_publish_chunks(ex, "x", &c, 1, 0, 0, NULL, NULL, 1), CUDAPOOL_EINVAL);
	EXPECT(cudapool_exporter_publish_chunks(ex, "", &c, 1, 0, 0, NULL, NULL, 0), CUDAPOOL_EINVAL);
	cudapool_exporter exnone = {0};
	EXPECT(cudapool_exporter_publish_chunks(exnone, "x", &c, 1, 0, 0, NULL, NULL, 0), CUDAPOOL_EHANDLE);

	cudapool_chunk_entry es[2] = {{"x", 0, 0, NULL, 0}, {"y", 0, 0, NULL, 0}};
	EXPECT(cudapool_exporter_publish_chunks_all(ex, &c, 1, NULL, 1, NULL), CUDAPOOL_EINVAL);
	EXPECT(cudapool_exporter_publish_chunks_all(ex, &c, 1, es, 0, NULL), CUDAPOOL_EINVAL);
	EXPECT(cudapool_exporter_publish_chunks_all(ex, &c, 1, es, CUDAPOOL_MAX_BATCH + 1, NULL), CUDAPOOL_EINVAL);
	EXPECT(cudapool_exporter_publish_chunks_all(ex, NULL, 1, es, 2, NULL), CUDAPOOL_EINVAL);
	EXPECT(cudapool_exporter_publish_chunks_all(exnone, &c, 1, es, 2, NULL), CUDAPOOL_EHANDLE);
	es[1].name = NULL;
	EXPECT(cudapool_exporter_publish_chunks_all(ex, &c, 1, es, 2, NULL), CUDAPOOL_EINVAL);
	es[1].name = "x"; // twice in one publish
	EXPECT(cudapool_exporter_publish_chunks_all(ex, &c, 1, es, 2, NULL), CUDAPOOL_EEXIST);
	es[1].name = "y";
	es[1].offset = g + 1;
	EXPECT(cudapool_exporter_publish_chunks_all(ex, &c, 1, es, 2, NULL), CUDAPOOL_EINVAL);
	es[1].offset = 0;
	es[1].meta_len = CUDAPOOL_MAX_META + 1;
	es[1].meta = meta;
	EXPECT(cudapool_exporter_publish_chunks_all(ex, &c, 1, es, 2, NULL), CUDAPOOL_EINVAL);
	// Nothing of the refused calls is published.
	EXPECT(cudapool_exporter_unpublish(ex, "x"), CUDAPOOL_ENOTFOUND);
}

int main(int argc, char **argv) {
	if (argc == 3 && strcmp(argv[1], "consume") == 0) return consume(argv[2]);
	char why[128];
	EXPECT(cudapool_init("test", why, sizeof why), CUDAPOOL_OK);
	uint64_t g = 0;
	EXPECT(cudapool_vmm_granularity(0, 0, &g), CUDAPOOL_OK);
	if (g == 0 || g < 2 * SPAN) {
		fprintf(stderr, "granularity %llu: %s\n", (unsigned long long)g, cudapool_last_error());
		return 1;
	}
	cudapool_chunk cs[2] = {{0}, {0}};
	cudapool_reservation r = {0};
	EXPECT(cudapool_chunk_create(0, g, 0, &cs[0]), CUDAPOOL_OK);
	EXPECT(cudapool_chunk_create(0, g, 0, &cs[1]), CUDAPOOL_OK);
	EXPECT(cudapool_reservation_create(0, 2 * g, &r), CUDAPOOL_OK);
	int dev = -1, fabric = -1;
	uint64_t size = 0;
	EXPECT(cudapool_chunk_info(cs[1], &dev, &size, &fabric), CUDAPOOL_OK);
	CHECK(dev == 0 && size == g && fabric == 0);

	char sock[64];
	snprintf(sock, sizeof sock, "/tmp/cudapool-vmm-%d.sock", (int)getpid());
	unlink(sock);
	cudapool_listen_options lo;
	cudapool_listen_options_default(&lo);
	lo.flags = CUDAPOOL_LISTEN_NO_ANNOUNCE;
	cudapool_exporter ex = {0};
	EXPECT(cudapool_exporter_listen(sock, &lo, &ex), CUDAPOOL_OK);
	bad(g, cs[0], r, ex);

	EXPECT(cudapool_reservation_grow(r, cs, 2), CUDAPOOL_OK);
	void *p = NULL;
	uint64_t reserved = 0, mapped = 0;
	size_t n = 0;
	EXPECT(cudapool_reservation_info(r, &p, &reserved, &mapped, &n), CUDAPOOL_OK);
	CHECK(p != NULL && reserved == 2 * g && mapped == 2 * g && n == 2);
	uint8_t *host = malloc(2 * g);
	for (uint64_t i = 0; i < 2 * g; i++) host[i] = pattern(i);
	void *s = NULL;
	EXPECT(cudapool_stream_create(0, &s), CUDAPOOL_OK);
	EXPECT(cudapool_copy_to_device(0, p, host, 2 * g, s), CUDAPOOL_OK);
	free(host);
	EXPECT(cudapool_exporter_publish_chunks(ex, "slab", cs, 2, 0, 0, s, NULL, 0), CUDAPOOL_OK);
	EXPECT(cudapool_exporter_publish_chunks(ex, "part", cs, 2, g - SPAN, 2 * SPAN, s, "edge", 4), CUDAPOOL_OK);
	EXPECT(cudapool_exporter_publish_chunks(ex, "slab", cs, 2, 0, 0, s, NULL, 0), CUDAPOOL_EEXIST);
	// One allocation under two names, a chunk each: the consumer maps it once.
	cudapool_chunk_entry kv[2] = {{"k", 0, g, NULL, 0}, {"v", g, 0, "v", 1}};
	EXPECT(cudapool_exporter_publish_chunks_all(ex, cs, 2, kv, 2, s), CUDAPOOL_OK);
	// The exporter holds the memory now: the producer's handles and mapping may go.
	EXPECT(cudapool_stream_synchronize(0, s), CUDAPOOL_OK);
	EXPECT(cudapool_chunk_close(cs[0]), CUDAPOOL_OK);
	EXPECT(cudapool_chunk_close(cs[1]), CUDAPOOL_OK);
	EXPECT(cudapool_chunk_close(cs[1]), CUDAPOOL_EHANDLE); // a second close changes nothing
	EXPECT(cudapool_reservation_grow(r, cs, 1), CUDAPOOL_EHANDLE);
	EXPECT(cudapool_reservation_shrink(r, 1), CUDAPOOL_OK);
	EXPECT(cudapool_reservation_close(r), CUDAPOOL_OK);
	EXPECT(cudapool_reservation_close(r), CUDAPOOL_EHANDLE);

	pid_t pid;
	char *args[] = {argv[0], "consume", sock, NULL};
	int rc = posix_spawn(&pid, argv[0], NULL, NULL, args, environ);
	CHECKF(rc == 0, "posix_spawn: %s", strerror(rc));
	if (rc == 0) {
		int st = 0;
		CHECK(waitpid(pid, &st, 0) == pid);
		CHECKF(WIFEXITED(st) && WEXITSTATUS(st) == 0, "the consumer failed (status %#x)", st);
	}
	EXPECT(cudapool_exporter_unpublish(ex, "slab"), CUDAPOOL_OK);
	EXPECT(cudapool_exporter_unpublish(ex, "part"), CUDAPOOL_OK);
	EXPECT(cudapool_exporter_unpublish(ex, "k"), CUDAPOOL_OK);
	EXPECT(cudapool_exporter_unpublish(ex, "v"), CUDAPOOL_OK);
	EXPECT(cudapool_exporter_close(ex, 60000), CUDAPOOL_OK);
	EXPECT(cudapool_stream_destroy(0, s), CUDAPOOL_OK);
	unlink(sock);
	printf("%d checks, %d failed\n", checks, failures);
	return failures ? 1 : 0;
}
