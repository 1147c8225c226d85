package metrics_test

import (
	"errors"
	"strings"
	"testing"

	"github.com/prometheus/client_golang/prometheus/testutil"
	"github.com/stretchr/testify/require"

	"github.com/cudapool/cudapool/kv"
	"github.com/cudapool/cudapool/metrics"
)

// kvStats is an owner of two slabs with two replica connections of one process on
// device 1 and one on device 0.
var kvStats = kv.Stats{
	PID:      77,
	Geometry: kv.StatsGeometry{Layers: 2, KVHeads: 4, HeadDim: 8, TokensPerPage: 16, DType: "bf16", Pages: 10, PageBytes: 1024, SlabBytes: 40960, ChunkBytes: 4096, Chunks: 10, ReservedBytes: 40960},
	Devices: []kv.DeviceStats{
		{Device: 0, Chunks: 4, MappedBytes: 16384, Pages: 10, Free: 4, Writing: 1, Sealing: 2, Sealed: 2, Settling: 1, Leased: 1, Releasing: 1, Hits: 5, Misses: 6, Copied: 0, Evictions: 7, Seals: 8, Duplicates: 9},
		{Device: 1, Chunks: 10, MappedBytes: 40960, Pages: 10, Free: 10, Copied: 3, Seals: 3, Host: &kv.HostStats{Bytes: 1 << 20, Pages: 4, Free: 1, Filling: 1, Sealed: 2, Twins: 1,
			Spills: 3, SpillBytes: 3 << 18, SpillNanos: 2e9, Restores: 1, RestoreBytes: 1 << 18, RestoreNanos: 5e8, Spilled: 2, Lost: 1, Evictions: 1}},
	},
	Replicas: []kv.ReplicaStats{{PID: 100, Device: 1, Leases: 1, Pages: 2}, {PID: 100, Device: 1, Leases: 2, Pages: 3}, {PID: 101, Device: 0, Leases: 1, Pages: 1}},
}

func TestKVCollector(t *testing.T) {
	c := metrics.NewKVCollector("/run/kv", func() (kv.Stats, error) { return kvStats, nil })
	want := `
# HELP cudapool_kv_pages The slab's pages by state: free, writing (write-leased), sealing (waiting for the writer's work), sealed (visible), settling (waiting for a release's point to be freed).
# TYPE cudapool_kv_pages gauge
cudapool_kv_pages{device="0",kv_dir="/run/kv",state="free"} 4
cudapool_kv_pages{device="0",kv_dir="/run/kv",state="sealed"} 2
cudapool_kv_pages{device="0",kv_dir="/run/kv",state="sealing"} 2
cudapool_kv_pages{device="0",kv_dir="/run/kv",state="settling"} 1
cudapool_kv_pages{device="0",kv_dir="/run/kv",state="writing"} 1
cudapool_kv_pages{device="1",kv_dir="/run/kv",state="free"} 10
cudapool_kv_pages{device="1",kv_dir="/run/kv",state="sealed"} 0
cudapool_kv_pages{device="1",kv_dir="/run/kv",state="sealing"} 0
cudapool_kv_pages{device="1",kv_dir="/run/kv",state="settling"} 0
cudapool_kv_pages{device="1",kv_dir="/run/kv",state="writing"} 0
# HELP cudapool_kv_evictions_total Sealed pages evicted to make room.
# TYPE cudapool_kv_evictions_total counter
cudapool_kv_evictions_total{device="0",kv_dir="/run/kv"} 7
cudapool_kv_evictions_total{device="1",kv_dir="/run/kv"} 0
# HELP cudapool_kv_replica_pages Pages a replica's leases hold.
# TYPE cudapool_kv_replica_pages gauge
cudapool_kv_replica_pages{device="0",kv_dir="/run/kv",replica="101"} 1
cudapool_kv_replica_pages{device="1",kv_dir="/run/kv",replica="100"} 5
# HELP cudapool_kv_slab_bytes Size of each slab (every layer's K and V of every page).
# TYPE cudapool_kv_slab_bytes gauge
cudapool_kv_slab_bytes{device="0",kv_dir="/run/kv"} 40960
cudapool_kv_slab_bytes{device="1",kv_dir="/run/kv"} 40960
# HELP cudapool_kv_slab_chunks Chunks each slab maps now (the VMM route: it grows as pages are needed, up to kv_slab_bytes).
# TYPE cudapool_kv_slab_chunks gauge
cudapool_kv_slab_chunks{device="0",kv_dir="/run/kv"} 4
cudapool_kv_slab_chunks{device="1",kv_dir="/run/kv"} 10
# HELP cudapool_kv_slab_mapped_bytes Memory each slab maps now: its chunks.
# TYPE cudapool_kv_slab_mapped_bytes gauge
cudapool_kv_slab_mapped_bytes{device="0",kv_dir="/run/kv"} 16384
cudapool_kv_slab_mapped_bytes{device="1",kv_dir="/run/kv"} 40960
# HELP cudapool_kv_up 1 when the KV page pool's owner answered its stats at this scrape, 0 when it did not.
# TYPE cudapool_kv_up gauge
cudapool_kv_up{kv_dir="/run/kv"} 1
`
	require.NoError(t, testutil.CollectAndCompare(c, strings.NewReader(want),
		"cudapool_kv_pages", "cudapool_kv_evictions_total", "cudapool_kv_replica_pages", "cudapool_kv_slab_bytes", "cudapool_kv_slab_chunks", "cudapool_kv_slab_mapped_bytes", "cudapool_kv_up"))

	// Only device 1 has a host tier.
	require.NoError(t, testutil.CollectAndCompare(c, strings.NewReader(`
# HELP cudapool_kv_host_pages The host tier's pages by state: free, filling (a spill copy in flight into it), sealed (holding a page the slab evicted or is about to).
# TYPE cudapool_kv_host_pages gauge
cudapool_kv_host_pages{device="1",kv_dir="/run/kv",state="filling"} 1
cudapool_kv_host_pages{device="1",kv_dir="/run/kv",state="free"} 1
cudapool_kv_host_pages{device="1",kv_dir="/run/kv",state="sealed"} 2
# HELP cudapool_kv_host_spill_seconds_total Time the spill copies took, from each batch's submission to its completion.
# TYPE cudapool_kv_host_spill_seconds_total counter
cudapool_kv_host_spill_seconds_total{device="1",kv_dir="/run/kv"} 2
# HELP cudapool_kv_host_restores_total Pages matches copied back from the host tier into the slab.
# TYPE cudapool_kv_host_restores_total counter
cudapool_kv_host_restores_total{device="1",kv_dir="/run/kv"} 1
# HELP cudapool_kv_host_evictions_total Host pages evicted to make room: gone.
# TYPE cudapool_kv_host_evictions_total counter
cudapool_kv_host_evictions_total{device="1",kv_dir="/run/kv"} 1
`), "cudapool_kv_host_pages", "cudapool_kv_host_spill_seconds_total", "cudapool_kv_host_restores_total", "cudapool_kv_host_evictions_total"))

	down := metrics.NewKVCollector("/run/kv", func() (kv.Stats, error) { return kv.Stats{}, errors.New("no owner") })
	require.NoError(t, testutil.CollectAndCompare(down, strings.NewReader(`
# HELP cudapool_kv_up 1 when the KV page pool's owner answered its stats at this scrape, 0 when it did not.
# TYPE cudapool_kv_up gauge
cudapool_kv_up{kv_dir="/run/kv"} 0
`)), "an owner that does not answer is down, and nothing else")
}
