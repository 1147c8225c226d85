// Package kv owns what every side of cudapool's KV page pool agrees on: the geometry of
// a slab and the layout of its pages, the prefix hashes that name pages, and the errors
// the pool reports.
//
// One owner process (package kv/owner, cmd/kvpoold) owns one slab per GPU it serves:
// chunks of device memory on the VMM route (package vmm) carved into pages of one
// [Geometry]. Replicas (package kv/replica) map the slab once, and its growths in place,
// and lease pages by index: alloc for writing,
// seal to make written pages readable under their prefix hashes once the writer's work
// has completed (visible), match to lease the longest run of visible pages for a list
// of hashes, and release to give leases back after the caller's stream.
//
// # Layout
//
// Each layer's K (and V) is one tensor [Pages, TokensPerPage, KVHeads, HeadDim],
// row-major and contiguous, the paged layout of FlashAttention and FlashInfer, and page
// p names the same block in every layer. Every process that maps a slab (the owner and
// each replica) reserves, once, one range of addresses per tensor (a region: K0, V0,
// K1, V1, ... in that order, RegionBytes each, [SlabLayout]), whatever the slab's size:
// no tensor is bound by what one allocation may be. Geometry.Pages is the slab's bound
// (kvpoold -bytes). The memory is chunks of ChunkBytes (a multiple of the device's
// granularity, vmm.Granularity), each made by the owner and passed as a descriptor to
// every replica (kv.sock, Grow frames), which maps chunk i where [SlabLayout.ChunkPlace]
// says: region i mod 2*Layers, at offset (i div 2*Layers)*ChunkBytes. Chunks are mapped
// in index order, a step (a chunk a region) at a time, so the first
// [SlabLayout.MappedPages] pages of every tensor are mapped, and a growth maps more
// behind them in place: nothing mapped moves, and a tensor's address is its region's
// for the slab's life. What holds:
//
//   - a page a lease names is mapped in the replica when the reply granting it is read
//     (the owner sends every growth to every connection before such a reply);
//   - layer l's K of page p is at SlabLayout.Addr(regions, l, K, p), region 2l's
//     address plus p*PageBytes(), in every process at its own addresses;
//   - the slab grows (the owner maps more chunks) before an allocation evicts, up to the
//     bound; a replica maps each growth before it reads the frame after it;
//   - the chunks outlive the owner: a keeper holds their descriptors (kv/owner), and a
//     replica's mapping alone keeps their memory until it unmaps it.
//
// # Prefix hashes
//
// Page i of a token list holds tokens [i*T, (i+1)*T) and is named by
// h_i = SHA-256(h_{i-1} || le32(tok[i*T]) || ... || le32(tok[i*T+T-1]))[:16], with
// h_{-1} = Root(namespace); only full pages have a hash. A hash names the whole prefix,
// so equal hashes mean equal token prefixes (within a namespace).
//
// # Trust
//
// The slab is the unit of trust, as the pool is for shared buffers (docs/FACTS.md 2):
// every replica of an owner maps that owner's whole slab read-write, and can read and
// overwrite any page, sealed or not, of any namespace. The namespace only seeds the
// prefix hashes, so that two models' equal tokens get different hashes; the owner does
// not enforce it. Separate trust domains (tenants, models one must not corrupt the
// other's cache) by running one owner per domain, each with a directory of its own
// (kvpoold -dir) whose socket admits only that domain's processes.
package kv
