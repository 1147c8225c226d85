// handles.c is compiled by TestCHandleTypes once as it is, which must succeed, and once
// with each -DCASE=n, each of which must fail to compile: a handle of one kind given
// where another is wanted, or a bare integer for a handle.
#include "cudapool.h"

int main(void) {
	cudapool_pool pool = {0};
	cudapool_exporter ex = {0};
	cudapool_importer imp = {0};
	cudapool_mapping m = {0};
	cudapool_chunk c = {0};
	cudapool_reservation r = {0};
	cudapool_pool_stats st;
	void *ptr;
	(void)pool, (void)ex, (void)imp, (void)m, (void)c, (void)r, (void)st, (void)ptr;
#if CASE == 0
	cudapool_pool_stats_get(pool, &st);
	cudapool_exporter_unpublish(ex, "x");
	cudapool_importer_close(imp, 1);
	cudapool_mapping_release(m, 0, 1);
	cudapool_chunk_close(c);
	cudapool_reservation_grow(r, &c, 1);
#elif CASE == 1
	cudapool_pool_stats_get(imp, &st); // an importer for a pool
#elif CASE == 2
	cudapool_exporter_unpublish(pool, "x"); // a pool for an exporter
#elif CASE == 3
	cudapool_mapping_release(imp, 0, 1); // an importer for a mapping
#elif CASE == 4
	cudapool_importer_close(m, 1); // a mapping for an importer
#elif CASE == 5
	cudapool_alloc(12345, 1, 0, 0, &ptr); // a made-up integer for a pool
#elif CASE == 6
	cudapool_importer_open(imp, "x", 0, 0, 1, &pool); // a pool's out-parameter for a mapping's
#elif CASE == 7
	cudapool_chunk_close(r); // a reservation for a chunk
#elif CASE == 8
	cudapool_reservation_grow(r, &m, 1); // mappings for chunks
#endif
	return 0;
}
