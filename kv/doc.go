// Package kv owns what every side of cudapool's KV page pool agrees on: the geometry of
// a slab and the layout of its pages, the prefix hashes that name pages, and the errors
// the pool reports.
//
// One owner process (package kv/owner, cmd/kvpoold) owns one slab per GPU it serves:
// allocations (segments) of an IPC-capable pool carved into pages of one [Geometry]. Replicas
// (package kv/replica) map the slab once and lease pages by index: alloc for writing,
// seal to make written pages readable under their prefix hashes once the writer's work
// has completed (visible), match to lease the longest run of visible pages for a list
// of hashes, and release to give leases back after the caller's stream.
//
// # Layout
//
// Each layer's K (and V) is one tensor [Pages, TokensPerPage, KVHeads, HeadDim],
// row-major and contiguous, the paged layout of FlashAttention and FlashInfer, and page
// p names the same block in every layer. A slab is several allocations (segments) of
// at most [MaxSegmentBytes] each, as a replica cannot import larger ones: the tensors K0,
// V0, K1, V1, ... are packed whole into them in that order ([Geometry.Segments]), so
// that layer l's K of page p lies at Segments.Page(l, K, p), and its device address is
// Segments.Addr(bases, l, K, p) for the segments' addresses bases.
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
