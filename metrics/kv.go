package metrics

import (
	"strconv"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/cudapool/cudapool/kv"
)

// The labels of a KV page pool's series.
const (
	labelKVDir     = "kv_dir"  // the owner's directory: its identity on the host
	labelPageState = "state"   // free, writing, sealing, sealed or settling
	labelReplica   = "replica" // a replica's pid
)

var (
	kvLabels        = []string{labelKVDir}
	kvDeviceLabels  = []string{labelKVDir, labelDevice}
	kvReplicaLabels = []string{labelKVDir, labelReplica, labelDevice}
)

// KV page pool metrics.
var (
	kvUp = gauge("kv_up",
		"1 when the KV page pool's owner answered its stats at this scrape, 0 when it did not.", kvLabels)
	kvInfo = gauge("kv_info",
		"Always 1; its labels say which process owns the KV page pool and its geometry.", kvLabels, labelPID, "layers", "kv_heads", "head_dim", "dtype", "tokens_per_page")
	kvSlabPages = gauge("kv_slab_pages",
		"Pages of each slab.", kvDeviceLabels)
	kvSlabBytes = gauge("kv_slab_bytes",
		"Size of each slab (every layer's K and V of every page).", kvDeviceLabels)
	kvSlabChunks = gauge("kv_slab_chunks",
		"Chunks each slab maps now (the VMM route: it grows as pages are needed, up to kv_slab_bytes).", kvDeviceLabels)
	kvSlabMapped = gauge("kv_slab_mapped_bytes",
		"Memory each slab maps now: its chunks.", kvDeviceLabels)
	kvPages = gauge("kv_pages",
		"The slab's pages by state: free, writing (write-leased), sealing (waiting for the writer's work), sealed (visible), settling (waiting for a release's point to be freed).", kvDeviceLabels, labelPageState)
	kvLeased = gauge("kv_leased_pages",
		"Sealed pages that read leases hold.", kvDeviceLabels)
	kvReleasing = gauge("kv_releasing_pages",
		"Sealed pages whose readers' release points have not been reached: not evictable yet.", kvDeviceLabels)
	kvHits = counter("kv_hits_total",
		"Pages that matches found (leased for reading).", kvDeviceLabels)
	kvMisses = counter("kv_misses_total",
		"Hashes that matches asked for and did not find.", kvDeviceLabels)
	kvCopied = counter("kv_copied_pages_total",
		"Pages matches copied in from another device's slab.", kvDeviceLabels)
	kvEvictions = counter("kv_evictions_total",
		"Sealed pages evicted to make room.", kvDeviceLabels)
	kvSeals = counter("kv_seals_total",
		"Pages made visible by seals (and copies).", kvDeviceLabels)
	kvDuplicates = counter("kv_duplicate_seals_total",
		"Pages sealed under a hash that was visible already, and freed.", kvDeviceLabels)
	kvHostPages = gauge("kv_host_pages",
		"The host tier's pages by state: free, filling (a spill copy in flight into it), sealed (holding a page the slab evicted or is about to).", kvDeviceLabels, labelPageState)
	kvHostBytes = gauge("kv_host_bytes",
		"Size of each device's host tier of pinned host memory.", kvDeviceLabels)
	kvHostTwins = gauge("kv_host_twin_pages",
		"Sealed host pages whose page the slab still holds too (copied ahead, or restored).", kvDeviceLabels)
	kvSpills = counter("kv_host_spills_total",
		"Pages copied from the slab into the host tier.", kvDeviceLabels)
	kvSpillBytes = counter("kv_host_spill_bytes_total",
		"Bytes copied from the slab into the host tier.", kvDeviceLabels)
	kvSpillSeconds = counter("kv_host_spill_seconds_total",
		"Time the spill copies took, from each batch's submission to its completion.", kvDeviceLabels)
	kvRestores = counter("kv_host_restores_total",
		"Pages matches copied back from the host tier into the slab.", kvDeviceLabels)
	kvRestoreBytes = counter("kv_host_restore_bytes_total",
		"Bytes matches copied back from the host tier into the slab.", kvDeviceLabels)
	kvRestoreSeconds = counter("kv_host_restore_seconds_total",
		"Time the restore copies took, from each batch's submission to its completion.", kvDeviceLabels)
	kvSpilled = counter("kv_host_spilled_total",
		"Pages the slab evicted whose bytes the host tier kept.", kvDeviceLabels)
	kvLost = counter("kv_host_lost_total",
		"Pages the slab evicted with no copy in the host tier: gone from both tiers.", kvDeviceLabels)
	kvHostEvictions = counter("kv_host_evictions_total",
		"Host pages evicted to make room: gone.", kvDeviceLabels)
	kvReplicas = gauge("kv_replicas",
		"Replicas connected, all of them: the per-replica series cover at most the 1024 a stats answer lists.", kvLabels)
	kvReplicaLeases = gauge("kv_replica_leases",
		"Leases a replica holds.", kvReplicaLabels)
	kvReplicaPages = gauge("kv_replica_pages",
		"Pages a replica's leases hold.", kvReplicaLabels)
)

// NewKVCollector returns a collector of a KV page pool's kv.Stats at each scrape, read
// through stats: an owner's (kv/owner's Owner.Stats) in this process, or asked over its
// socket (kv/replica's Replica.Stats), as poolstat -serve -kv does. Series carry dir, the
// owner's directory. A stats that fails is reported with cudapool_kv_up 0.
func NewKVCollector(dir string, stats func() (kv.Stats, error)) prometheus.Collector {
	return kvCollector{dir: dir, stats: stats}
}

type kvCollector struct {
	dir   string
	stats func() (kv.Stats, error)
}

// Describe describes nothing: the collector is unchecked (see the package docs).
func (c kvCollector) Describe(chan<- *prometheus.Desc) {}

func (c kvCollector) Collect(ch chan<- prometheus.Metric) {
	st, err := c.stats()
	labels := []string{c.dir}
	if err != nil {
		send(ch, kvUp, 0, labels)
		return
	}
	send(ch, kvUp, 1, labels)
	send(ch, kvReplicas, float64(st.ReplicaCount), labels)
	g := st.Geometry
	send(ch, kvInfo, 1, labels, strconv.Itoa(st.PID), strconv.Itoa(g.Layers), strconv.Itoa(g.KVHeads), strconv.Itoa(g.HeadDim), g.DType, strconv.Itoa(g.TokensPerPage))
	seen := map[int]bool{}
	for _, d := range st.Devices {
		if seen[d.Device] {
			continue
		}
		seen[d.Device] = true
		dl := []string{c.dir, strconv.Itoa(d.Device)}
		send(ch, kvSlabPages, float64(d.Pages), dl)
		send(ch, kvSlabBytes, float64(g.SlabBytes), dl)
		send(ch, kvSlabChunks, float64(d.Chunks), dl)
		send(ch, kvSlabMapped, float64(d.MappedBytes), dl)
		for _, s := range []struct {
			state string
			n     int
		}{{"free", d.Free}, {"writing", d.Writing}, {"sealing", d.Sealing}, {"sealed", d.Sealed}, {"settling", d.Settling}} {
			send(ch, kvPages, float64(s.n), dl, s.state)
		}
		send(ch, kvLeased, float64(d.Leased), dl)
		send(ch, kvReleasing, float64(d.Releasing), dl)
		for _, cn := range []struct {
			desc *prometheus.Desc
			v    uint64
		}{{kvHits, d.Hits}, {kvMisses, d.Misses}, {kvCopied, d.Copied}, {kvEvictions, d.Evictions}, {kvSeals, d.Seals}, {kvDuplicates, d.Duplicates}} {
			sendCounter(ch, cn.desc, float64(cn.v), dl)
		}
		if h := d.Host; h != nil {
			collectHostTier(ch, h, dl)
		}
	}
	// A process may hold a replica per device, or several on one (one series each
	// pid and device, summed).
	type key struct{ pid, dev int }
	sums := map[key]*kv.ReplicaStats{}
	var order []key
	for _, r := range st.Replicas {
		k := key{r.PID, r.Device}
		if s, ok := sums[k]; ok {
			s.Leases += r.Leases
			s.Pages += r.Pages
			continue
		}
		sums[k] = &r
		order = append(order, k)
	}
	for _, k := range order {
		rl := []string{c.dir, strconv.Itoa(k.pid), strconv.Itoa(k.dev)}
		send(ch, kvReplicaLeases, float64(sums[k].Leases), rl)
		send(ch, kvReplicaPages, float64(sums[k].Pages), rl)
	}
}

// collectHostTier sends the series of one device's host tier, labelled dl.
func collectHostTier(ch chan<- prometheus.Metric, h *kv.HostStats, dl []string) {
	send(ch, kvHostBytes, float64(h.Bytes), dl)
	for _, s := range []struct {
		state string
		n     int
	}{{"free", h.Free}, {"filling", h.Filling}, {"sealed", h.Sealed}} {
		send(ch, kvHostPages, float64(s.n), dl, s.state)
	}
	send(ch, kvHostTwins, float64(h.Twins), dl)
	for _, cn := range []struct {
		desc *prometheus.Desc
		v    float64
	}{{kvSpills, float64(h.Spills)}, {kvSpillBytes, float64(h.SpillBytes)}, {kvSpillSeconds, float64(h.SpillNanos) / 1e9},
		{kvRestores, float64(h.Restores)}, {kvRestoreBytes, float64(h.RestoreBytes)}, {kvRestoreSeconds, float64(h.RestoreNanos) / 1e9},
		{kvSpilled, float64(h.Spilled)}, {kvLost, float64(h.Lost)}, {kvHostEvictions, float64(h.Evictions)}} {
		sendCounter(ch, cn.desc, cn.v, dl)
	}
}
