package kv

// Stats is a snapshot of an owner: what its Stats frame answers, as JSON. Replicas
// lists the connected replicas by pid; the Stats frame lists at most [MaxListed]
// (ReplicasOmitted counts those left out), so that it fits one frame however many
// replicas are connected. ReplicaCount counts them all.
type Stats struct {
	PID             int            `json:"pid"`
	Geometry        StatsGeometry  `json:"geometry"`
	Devices         []DeviceStats  `json:"devices"`
	Replicas        []ReplicaStats `json:"replicas"`
	ReplicaCount    int            `json:"replica_count"`
	ReplicasOmitted int            `json:"replicas_omitted,omitempty"`
	// Restart says what the owner took back at its start (kv/owner.Recovery); absent
	// for an owner that keeps no index.
	Restart *RestartStats `json:"restart,omitempty"`
}

// RestartStats is an owner's start over a keeper's slabs, in [Stats].
type RestartStats struct {
	Epoch    uint64 `json:"epoch"`    // starts on this index, this one included
	Adopted  bool   `json:"adopted"`  // the slabs were a live keeper's
	Keeper   int    `json:"keeper"`   // its pid
	Restored int    `json:"restored"` // visible pages taken back from the index
	// Replicas are the replicas of before to reattach, as the owner said at its start
	// (kv/owner's Recovery.Replicas, kvpoold's "N replicas to reattach"); Awaiting
	// are those of them not reattached yet, nor exited, while the reattach window
	// lasts (0 once it has ended).
	Replicas int `json:"replicas"`
	Awaiting int `json:"awaiting"`
	// Kept are the pages of write leases granted before the restart that their
	// writers, alive, have not re-declared (nor given back): no one else gets them
	// while those processes live.
	Kept    int    `json:"kept,omitempty"`
	Dropped string `json:"dropped,omitempty"`
}

// MaxListed is the most replicas a [Stats] frame lists.
const MaxListed = 1024

// StatsGeometry is the geometry in [Stats]' JSON.
type StatsGeometry struct {
	Layers        int    `json:"layers"`
	KVHeads       int    `json:"kv_heads"`
	HeadDim       int    `json:"head_dim"`
	TokensPerPage int    `json:"tokens_per_page"`
	DType         string `json:"dtype"`
	Pages         int    `json:"pages"`
	PageBytes     uint64 `json:"page_bytes"`
	SlabBytes     uint64 `json:"slab_bytes"`
	// ChunkBytes is the size of the chunks a slab maps ([SlabLayout]), Chunks their
	// number at the bound, and ReservedBytes the addresses a slab reserves.
	ChunkBytes    uint64 `json:"chunk_bytes"`
	Chunks        int    `json:"chunks"`
	ReservedBytes uint64 `json:"reserved_bytes"`
}

// StatsOf is the geometry of l, and its chunks, as [Stats] shows them.
func StatsOf(l SlabLayout) StatsGeometry {
	g := l.Geometry()
	return StatsGeometry{Layers: g.Layers, KVHeads: g.KVHeads, HeadDim: g.HeadDim, TokensPerPage: g.TokensPerPage,
		DType: g.DType.String(), Pages: g.Pages, PageBytes: g.PageBytes(), SlabBytes: g.SlabBytes(),
		ChunkBytes: l.ChunkBytes(), Chunks: l.Chunks(), ReservedBytes: l.ReservedBytes()}
}

// DeviceStats is one slab's pages by state, and its counters since the owner started.
// A page is in one of Free, Writing, Sealing, Sealed or Settling (which add up to the
// slab's pages); Leased counts the sealed pages that readers hold, and Releasing the
// sealed pages waiting for a reader's release to reach its point.
type DeviceStats struct {
	Device int `json:"device"`
	// Chunks are the chunks mapped and MappedBytes their memory; Pages are the pages
	// they hold (Geometry.Pages at the bound), the table's.
	Chunks      int    `json:"chunks"`
	MappedBytes uint64 `json:"mapped_bytes"`
	Pages       int    `json:"pages"`
	Free        int    `json:"free"`
	Writing     int    `json:"writing"`
	Sealing     int    `json:"sealing"`
	Sealed      int    `json:"sealed"`
	Settling    int    `json:"settling"`
	Leased      int    `json:"leased"`
	Releasing   int    `json:"releasing"`
	// Hits and Misses count pages matched and hashes a match did not find.
	Hits   uint64 `json:"hits"`
	Misses uint64 `json:"misses"`
	// Copied counts pages a match copied in from another device's slab.
	Copied     uint64 `json:"copied"`
	Evictions  uint64 `json:"evictions"`
	Seals      uint64 `json:"seals"`
	Duplicates uint64 `json:"duplicates"`
	// Host is the device's host tier; nil without one.
	Host *HostStats `json:"host,omitempty"`
}

// HostStats is one device's host tier: pinned host memory holding sealed pages the
// slab evicted (or is about to), and its counters since the owner started. A host page
// is Free, Filling (a spill copy in flight into it) or Sealed; Twins counts the sealed
// ones whose page is still visible in the slab too (copied ahead, or restored).
type HostStats struct {
	Bytes     uint64 `json:"bytes"`
	Pages     int    `json:"pages"`
	PageBytes uint64 `json:"page_bytes"` // one page: every layer's K and V
	Free      int    `json:"free"`
	Filling   int    `json:"filling"`
	Sealed    int    `json:"sealed"`
	Twins     int    `json:"twins"`
	// Spills counts pages copied into the host tier, SpillBytes their bytes and
	// SpillNanos the time from each batch's submission to its completion.
	Spills     uint64 `json:"spills"`
	SpillBytes uint64 `json:"spill_bytes"`
	SpillNanos uint64 `json:"spill_ns"`
	// Restores counts pages a match copied back into the slab, with their bytes and
	// time likewise.
	Restores     uint64 `json:"restores"`
	RestoreBytes uint64 `json:"restore_bytes"`
	RestoreNanos uint64 `json:"restore_ns"`
	// Spilled counts pages the slab evicted whose bytes the host tier kept; Lost those
	// it evicted with no copy there (gone from both tiers); Evictions the host pages
	// evicted (gone).
	Spilled   uint64 `json:"spilled"`
	Lost      uint64 `json:"lost"`
	Evictions uint64 `json:"evictions"`
	// CopyPath is how the copies run (cudart.CopyPath): "kernel" on a GPU.
	CopyPath string `json:"copy_path"`
}

// ReplicaStats is one connected replica.
type ReplicaStats struct {
	PID    int `json:"pid"`
	Device int `json:"device"`
	Leases int `json:"leases"`
	Pages  int `json:"pages"`
	// AwaitingExit is set for a replica whose connection ended without Bye while its
	// process lives on: its leases are kept until the process exits.
	AwaitingExit bool `json:"awaiting_exit,omitempty"`
}
