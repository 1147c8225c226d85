// batchcopy.cu: the batch copy kernel that cudart.Runtime.MemcpyBatchAsync launches on a
// GPU. It copies many (dst, src, size) pieces in one launch, each piece by one block at
// a time, 16-byte loads where the piece allows them (FACTS 21: 51.2 GB/s restoring
// 2,048 KV pages of 32 pieces of 16 KiB from mapped pinned host memory, against 37.7
// for cudaMemcpyBatchAsync and 5.8 for one cudaMemcpyAsync per piece).
//
// The runtime loads the PTX beside this file at run time (cudaLibraryLoadData), so that
// building cudapool needs no CUDA toolkit. Regenerate it after a change, on a host with
// nvcc, from the repository root:
//
//     nvcc -ptx -arch=compute_90 -O3 -o cudart/kernels/batchcopy.ptx cudart/kernels/batchcopy.cu
//
// A piece's addresses are device addresses: device memory, or the device pointer of
// registered host memory (cudaHostGetDevicePointer).

struct cp_piece {
	unsigned long long dst, src, size;
};

extern "C" __global__ void __launch_bounds__(256) cudapool_batch_copy(const cp_piece *pieces, unsigned long long n) {
	for (unsigned long long i = blockIdx.x; i < n; i += gridDim.x) {
		const cp_piece p = pieces[i];
		const unsigned long long t = threadIdx.x, bd = blockDim.x;
		if (((p.dst | p.src | p.size) & 15) == 0) {
			uint4 *d = (uint4 *)p.dst;
			const uint4 *s = (const uint4 *)p.src;
			const unsigned long long m = p.size / 16;
			unsigned long long j = t;
			// Four loads in flight per thread before their stores: the source may be
			// host memory across PCIe, whose latency the loads must cover.
			for (; j + 3 * bd < m; j += 4 * bd) {
				const uint4 a = s[j], b = s[j + bd], c = s[j + 2 * bd], e = s[j + 3 * bd];
				d[j] = a;
				d[j + bd] = b;
				d[j + 2 * bd] = c;
				d[j + 3 * bd] = e;
			}
			for (; j < m; j += bd) d[j] = s[j];
		} else {
			unsigned char *d = (unsigned char *)p.dst;
			const unsigned char *s = (const unsigned char *)p.src;
			for (unsigned long long j = t; j < p.size; j += bd) d[j] = s[j];
		}
	}
}
