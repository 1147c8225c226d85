// kv.c checks libcudapool's KV pages calls against a live owner, on the software
// device: a replica dials the kvpoold serving $CUDAPOOL_KV_DIR (llama-0.85b, 32
// pages), allocs, writes a page, seals, matches, reads the page back and releases;
// stale leases, a full slab and bad input must come back as the status named, with a
// message. capi's TestKVCInterface starts the owner, builds this program and runs it; it
// prints one line per failed check and exits 1 if any failed.
#include <poll.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "cudapool.h"
#include "expect.h"

enum { PAGES = 32, T = 16, N = 3 };

int main(void) {
	const char *dir = getenv("CUDAPOOL_KV_DIR");
	if (!dir) {
		fprintf(stderr, "CUDAPOOL_KV_DIR is not set\n");
		return 2;
	}
	char why[256];
	EXPECT(cudapool_init("test", why, sizeof why), CUDAPOOL_OK);

	cudapool_kv_replica r = {0}, bad = {0};
	EXPECT(cudapool_kv_dial(dir, 0, "c", 1, CUDAPOOL_KV_WAIT_FOR_OWNER, 60000, NULL), CUDAPOOL_EINVAL);
	EXPECT(cudapool_kv_dial(NULL, 0, "c", 1, 0, 60000, &r), CUDAPOOL_EINVAL);
	EXPECT(cudapool_kv_dial(dir, 0, NULL, 1, 0, 60000, &r), CUDAPOOL_EINVAL);
	EXPECT(cudapool_kv_dial(dir, 0, "c", 1, 0x10, 60000, &r), CUDAPOOL_EINVAL);
	EXPECT(cudapool_kv_dial(dir, 0, "c", 1, 0, -2, &r), CUDAPOOL_EINVAL);
	// N6: lengths are checked before anything is read (SIZE_MAX aborted the process,
	// 2^32+3 cut the namespace to 3 bytes).
	EXPECT(cudapool_kv_dial(dir, 0, "c", SIZE_MAX, 0, 60000, &r), CUDAPOOL_EINVAL);
	EXPECT(cudapool_kv_dial(dir, 0, "abc", ((size_t)1 << 32) + 3, 0, 60000, &r), CUDAPOOL_EINVAL);
	EXPECT(cudapool_kv_dial(dir, 0, "c", CUDAPOOL_KV_MAX_NAMESPACE + 1, 0, 60000, &r), CUDAPOOL_EINVAL);
	CHECK(r.h == 0);
	EXPECT(cudapool_kv_dial(dir, 0, "c", 1, CUDAPOOL_KV_WAIT_FOR_OWNER, 60000, &r), CUDAPOOL_OK);
	if (r.h == 0) {
		fprintf(stderr, "no replica: %s\n", cudapool_last_error());
		return 1;
	}

	cudapool_kv_geometry g = {.size = sizeof g};
	EXPECT(cudapool_kv_geometry_get(r, NULL), CUDAPOOL_EINVAL);
	EXPECT(cudapool_kv_geometry_get(r, &g), CUDAPOOL_OK);
	CHECK(g.size == sizeof g);
	CHECK(g.layers == 16 && g.kv_heads == 8 && g.head_dim == 64 && g.tokens_per_page == T);
	CHECK(g.dtype == CUDAPOOL_KV_BF16 && g.dtype_size == 2 && g.pages == PAGES && g.device == 0);
	CHECK(g.page_bytes == (uint64_t)T * 8 * 64 * 2);
	CHECK(g.slab_bytes == 16ull * 2 * PAGES * g.page_bytes);
	CHECK(g.page_span_bytes == 16ull * 2 * g.page_bytes);
	CHECK(g.slab_bytes == PAGES * g.page_span_bytes);
	// The slab is 32 regions, one per tensor (K0, V0, K1, ...), each 2 MiB of addresses:
	// one chunk of the software device's granularity holds a tensor of 512 KiB.
	CHECK(g.regions == 32 && g.region_bytes == 2u << 20);
	void *regions[32] = {0};
	uint64_t region_bytes[32] = {0};
	size_t nregions = 0;
	EXPECT(cudapool_kv_regions(r, regions, region_bytes, 31, &nregions), CUDAPOOL_ERANGE);
	CHECK(nregions == 32 && regions[0] == NULL);
	EXPECT(cudapool_kv_regions(r, NULL, NULL, 0, NULL), CUDAPOOL_EINVAL);
	EXPECT(cudapool_kv_regions(r, NULL, NULL, 0, &nregions), CUDAPOOL_OK);
	CHECK(nregions == 32);
	EXPECT(cudapool_kv_regions(r, regions, region_bytes, 32, &nregions), CUDAPOOL_OK);
	for (int i = 0; i < 32; i++) {
		CHECK(regions[i] != NULL);
		CHECK(region_bytes[i] == 2u << 20);
	}
	void *k5 = NULL, *v5 = NULL, *k15 = NULL;
	EXPECT(cudapool_kv_layer_ptrs(r, 16, &k5, &v5), CUDAPOOL_EINVAL);
	EXPECT(cudapool_kv_layer_ptrs(r, -1, &k5, &v5), CUDAPOOL_EINVAL);
	EXPECT(cudapool_kv_layer_ptrs(r, 15, &k15, NULL), CUDAPOOL_OK);
	CHECK(k15 == (char *)regions[30]); // tensor 30 is region 30
	EXPECT(cudapool_kv_layer_ptrs(r, 5, &k5, &v5), CUDAPOOL_OK);
	// Layer 5's K and V are tensors 10 and 11, each a region of its own.
	CHECK(k5 == (char *)regions[10]);
	CHECK(v5 == (char *)regions[11]);
	void *k6 = NULL;
	EXPECT(cudapool_kv_layer_ptrs(r, 6, &k6, NULL), CUDAPOOL_OK);
	CHECK(k6 == (char *)regions[12]);
	void *base = NULL;
	uint64_t bytes = 0;
	EXPECT(cudapool_kv_slab(r, &base, &bytes), CUDAPOOL_ENOTSUP); // deprecated: no slab is one range

	// Hashes: N full pages and a partial one.
	int32_t tokens[N * T + 5];
	for (int i = 0; i < N * T + 5; i++) tokens[i] = i * 7919 - 1000;
	uint8_t hashes[N * CUDAPOOL_KV_HASH_BYTES];
	size_t n = 0;
	EXPECT(cudapool_kv_hashes(r, tokens, N * T + 5, hashes, N - 1, &n), CUDAPOOL_ERANGE);
	CHECK(n == N);
	EXPECT(cudapool_kv_hashes(r, NULL, 4, hashes, N, &n), CUDAPOOL_EINVAL);
	EXPECT(cudapool_kv_hashes(r, tokens, N * T + 5, hashes, N, NULL), CUDAPOOL_EINVAL);
	EXPECT(cudapool_kv_hashes(r, tokens, T - 1, NULL, 0, &n), CUDAPOOL_OK);
	CHECK(n == 0);
	EXPECT(cudapool_kv_hashes(r, tokens, N * T + 5, hashes, N, &n), CUDAPOOL_OK);
	CHECK(n == N);
	// N6: a token count no memory holds is refused, *n_hashes untouched (SIZE_MAX gave
	// OK with 0 hashes, 2^63+64 EINTERNAL and garbage).
	n = 12345;
	EXPECT(cudapool_kv_hashes(r, tokens, SIZE_MAX, hashes, N, &n), CUDAPOOL_EINVAL);
	CHECK(n == 12345);
	EXPECT(cudapool_kv_hashes(r, tokens, ((size_t)1 << 63) + 64, hashes, N, &n), CUDAPOOL_EINVAL);
	CHECK(n == 12345);
	EXPECT(cudapool_kv_hashes(r, tokens, N * T + 5, hashes, SIZE_MAX, &n), CUDAPOOL_OK); // room is the caller's word
	CHECK(n == N);

	// Alloc, write layer 5's V of the first page, seal.
	uint64_t w = 0, m = 0;
	uint32_t pages[PAGES + 1], got[N];
	EXPECT(cudapool_kv_alloc(r, N, 10000, NULL, pages), CUDAPOOL_EINVAL);
	EXPECT(cudapool_kv_alloc(r, N, 10000, &w, NULL), CUDAPOOL_EINVAL);
	EXPECT(cudapool_kv_alloc(r, CUDAPOOL_KV_MAX_BATCH + 1, 10000, &w, pages), CUDAPOOL_EINVAL);
	EXPECT(cudapool_kv_alloc(r, N, 10000, &w, pages), CUDAPOOL_OK);
	CHECK(w != 0);
	for (int i = 0; i < N; i++) CHECK(pages[i] < PAGES);
	char data[1024], back[1024];
	for (size_t i = 0; i < sizeof data; i++) data[i] = (char)(i * 31 + 7);
	char *page0 = (char *)v5 + pages[0] * g.page_bytes;
	EXPECT(cudapool_copy_to_device(0, page0, data, sizeof data, NULL), CUDAPOOL_OK);
	uint32_t visible = 99, dup = 99;
	EXPECT(cudapool_kv_seal(r, w, NULL, N, NULL, 1, 10000, &visible, &dup), CUDAPOOL_EINVAL);
	EXPECT(cudapool_kv_seal(r, w, hashes, CUDAPOOL_KV_MAX_BATCH + 1, NULL, 1, 10000, &visible, &dup),
	       CUDAPOOL_EINVAL);
	EXPECT(cudapool_kv_seal(r, w + 1000, hashes, N, NULL, 1, 10000, &visible, &dup), CUDAPOOL_ESTALE);
	EXPECT(cudapool_kv_seal(r, w, hashes, N, NULL, 1, 10000, &visible, &dup), CUDAPOOL_OK);
	CHECK(visible == N && dup == 0);
	EXPECT(cudapool_kv_seal(r, w, hashes, N, NULL, 1, 10000, &visible, &dup), CUDAPOOL_ESTALE);

	// Match and read back.
	EXPECT(cudapool_kv_match(r, hashes, N, NULL, 10000, &m, got, NULL), CUDAPOOL_EINVAL);
	EXPECT(cudapool_kv_match(r, hashes, N, NULL, 10000, &m, got, &n), CUDAPOOL_OK);
	CHECK(m != 0 && n == N);
	CHECK(memcmp(got, pages, sizeof got) == 0);
	EXPECT(cudapool_copy_from_device(0, back, page0, sizeof back, NULL), CUDAPOOL_OK);
	CHECK(memcmp(back, data, sizeof data) == 0);
	// A seal of a read lease is refused and keeps it.
	EXPECT(cudapool_kv_seal(r, m, hashes, N, NULL, 1, 10000, &visible, &dup), CUDAPOOL_EINVAL);
	// Release: all or none.
	uint64_t two[2] = {m, 12345};
	EXPECT(cudapool_kv_release(r, two, 2, NULL, 10000), CUDAPOOL_ESTALE);
	two[1] = m;
	EXPECT(cudapool_kv_release(r, two, 2, NULL, 10000), CUDAPOOL_ESTALE);
	EXPECT(cudapool_kv_release(r, NULL, 1, NULL, 10000), CUDAPOOL_EINVAL);
	EXPECT(cudapool_kv_release(r, &m, SIZE_MAX, NULL, 10000), CUDAPOOL_EINVAL);
	EXPECT(cudapool_kv_match(r, hashes, SIZE_MAX, NULL, 10000, &m, got, &n), CUDAPOOL_EINVAL);
	EXPECT(cudapool_kv_seal(r, m, hashes, SIZE_MAX, NULL, 1, 10000, &visible, &dup), CUDAPOOL_EINVAL);
	char lost[256] = "x";
	size_t lost_len = 99;
	EXPECT(cudapool_kv_lease_lost(r, m, lost, sizeof lost, NULL), CUDAPOOL_EINVAL);
	EXPECT(cudapool_kv_lease_lost(r, m, lost, sizeof lost, &lost_len), CUDAPOOL_OK); // held
	CHECK(lost_len == 0 && lost[0] == 0);
	EXPECT(cudapool_kv_release(r, &m, 1, NULL, 10000), CUDAPOOL_OK);
	EXPECT(cudapool_kv_lease_lost(r, m, lost, sizeof lost, &lost_len), CUDAPOOL_ESTALE); // ended
	EXPECT(cudapool_kv_release(r, &m, 1, NULL, 10000), CUDAPOOL_ESTALE);
	EXPECT(cudapool_kv_release(r, &w, 1, NULL, 10000), CUDAPOOL_ESTALE); // sealed: the lease ended

	// A miss holds nothing.
	uint8_t other[CUDAPOOL_KV_HASH_BYTES] = {1, 2, 3};
	m = 77;
	EXPECT(cudapool_kv_match(r, other, 1, NULL, 10000, &m, got, &n), CUDAPOOL_OK);
	CHECK(m == 0 && n == 0);

	// The whole slab, then one page too many. Visible pages are evicted for an alloc,
	// so the slab is full only with every page leased.
	uint64_t all = 0, more = 0;
	int full = CUDAPOOL_ENOSPACE;
	for (int i = 0; i < 30000 && full == CUDAPOOL_ENOSPACE; i++) { // 30 s: released pages settle first
		full = cudapool_kv_alloc(r, PAGES, 10000, &all, pages);
		struct timespec ts = {0, 1000 * 1000};
		if (full == CUDAPOOL_ENOSPACE) nanosleep(&ts, NULL);
	}
	EXPECT(full, CUDAPOOL_OK);
	EXPECT(cudapool_kv_alloc(r, 1, 10000, &more, pages), CUDAPOOL_ENOSPACE);
	EXPECT(cudapool_kv_release(r, &all, 1, NULL, 10000), CUDAPOOL_OK);

	// Liveness.
	int alive = -1, fd = -1;
	EXPECT(cudapool_kv_alive(r, NULL), CUDAPOOL_EINVAL);
	EXPECT(cudapool_kv_alive(r, &alive), CUDAPOOL_OK);
	CHECK(alive == 1);
	EXPECT(cudapool_kv_done_fd(r, &fd), CUDAPOOL_OK);
	struct pollfd p = {.fd = fd, .events = POLLIN};
	CHECK(fd >= 0 && poll(&p, 1, 0) == 0);
	char msg[256];
	size_t len = 99;
	EXPECT(cudapool_kv_error(r, msg, sizeof msg, &len), CUDAPOOL_OK);
	CHECK(len == 0 && msg[0] == 0);
	uint64_t reattaches = 99;
	EXPECT(cudapool_kv_reattaches(r, NULL), CUDAPOOL_EINVAL);
	EXPECT(cudapool_kv_reattaches(r, &reattaches), CUDAPOOL_OK);
	CHECK(reattaches == 0);
	EXPECT(cudapool_kv_wait_attached(r, 0), CUDAPOOL_OK); // attached: at once
	EXPECT(cudapool_kv_wait_attached(r, CUDAPOOL_NO_WAIT), CUDAPOOL_OK);
	EXPECT(cudapool_kv_wait_attached(r, -2), CUDAPOOL_EINVAL);

	// Handles.
	EXPECT(cudapool_kv_alive(bad, &alive), CUDAPOOL_EHANDLE);
	bad.h = 0xdeadbeefcafe;
	EXPECT(cudapool_kv_alive(bad, &alive), CUDAPOOL_EHANDLE);
	cudapool_pool pool = {0};
	EXPECT(cudapool_pool_create(0, NULL, &pool), CUDAPOOL_OK);
	bad.h = pool.h; // a live handle of another kind
	EXPECT(cudapool_kv_alive(bad, &alive), CUDAPOOL_EHANDLE);
	EXPECT(cudapool_pool_close(pool, 1, 10000), CUDAPOOL_OK);
	EXPECT(cudapool_kv_close(r, -2), CUDAPOOL_EINVAL);
	EXPECT(cudapool_kv_close(r, 10000), CUDAPOOL_OK);
	EXPECT(cudapool_kv_close(r, 10000), CUDAPOOL_EHANDLE);
	EXPECT(cudapool_kv_alloc(r, 1, 10000, &w, pages), CUDAPOOL_EHANDLE);

	printf("kv.c: %d checks, %d failed\n", checks, failures);
	return failures ? 1 : 0;
}
