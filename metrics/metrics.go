// Package metrics owns cudapool's Prometheus metrics: collectors that turn an
// exporter's State (export.State) and a pool's figures (pool.Stats) into metrics named
// by Prometheus's conventions, at each scrape, with no state of their own.
//
// Three collectors cover the three places the figures live, and a fourth a KV page
// pool's:
//
//	NewExporterCollector(ex)  an Exporter in this process, read through ex.State
//	NewPoolCollector(pools)   pools in this process, read through their Stats
//	NewTargetCollector(fn)    exporters asked over their sockets, as poolstat -serve does
//	NewKVCollector(dir, fn)   a KV page pool's owner (kv/owner), in this process or asked
//
// Metrics are named cudapool_<subject>_<what>[_<unit>]: gauges for current values and
// high-water marks, counters (_total) for the counts a pool accumulates over its life
// (its cache's hits and misses). Every value is the exporter's or the pool's own; this
// package keeps none. Series of one exporter carry its announced name and its socket
// (the socket tells exporters of one host apart); a pool's also its id and device, a
// peer's its pid. The metrics (their help text says what each holds):
//
//	cudapool_exporter_{up,info,start_time_seconds,published_buffers,published_bytes,peers}
//	cudapool_pool_{info,max_bytes,reserved_bytes,reserved_high_water_bytes,used_bytes,
//	  used_high_water_bytes,rounding_overhead_bytes,buffers,shared_buffers,leases,
//	  deferred_frees,failed_frees,failed_free_bytes,cache_limit_bytes,cached_buffers,
//	  cached_bytes,cache_hits_total,cache_misses_total}
//	cudapool_peer_{info,leases,grants,leased_bytes,connect_time_seconds,awaiting_exit}
//	cudapool_kv_{up,info,slab_pages,slab_bytes,slab_chunks,slab_mapped_bytes,pages,leased_pages,releasing_pages,hits_total,
//	  misses_total,copied_pages_total,evictions_total,seals_total,duplicate_seals_total,
//	  host_bytes,host_pages,host_twin_pages,host_spills_total,host_spill_bytes_total,
//	  host_spill_seconds_total,host_restores_total,host_restore_bytes_total,
//	  host_restore_seconds_total,host_spilled_total,host_lost_total,host_evictions_total,
//	  replicas,replica_leases,replica_pages}
//
// Register the collectors with a prometheus.Registerer and serve it with promhttp.
// They are unchecked collectors (they describe no metric up front, as the series they
// yield depend on what runs), so several share one registry, which still refuses, at
// each scrape, a series collected twice: give all the pools of a process to one
// NewPoolCollector.
//
// A scrape reads each figure once, one exporter and pool after another, not at one
// instant. A pool whose Stats fail (closed, or the driver would not answer) is left
// out of that scrape; an exporter that cannot be asked is reported with
// cudapool_exporter_up 0 by the target collector, and as a collection error by the
// in-process one.
package metrics

import (
	"github.com/prometheus/client_golang/prometheus"
)

// The label names, shared by every metric of one subject.
const (
	labelExporter   = "exporter"    // the name the exporter announced (producer.WithName)
	labelSocket     = "socket"      // the exporter's socket: its identity on the host
	labelPool       = "pool"        // the pool's name
	labelPoolID     = "pool_id"     // the exporter's id for the pool, unique within it
	labelDevice     = "device"      // the pool's device ordinal
	labelHandleType = "handle_type" // how the pool is shared
	labelPID        = "pid"         // the exporter's process
	labelPeer       = "peer"        // a peer's pid, as the exporter's host sees it
	labelUID        = "uid"
	labelGID        = "gid"
	labelPeerDevice = "peer_device" // the UUID of the device the peer imports to
	labelRemote     = "remote"      // "true" for a peer on a byte stream (FABRIC)
	labelCommand    = "command"     // the peer's command name, when this host shows it
)

var (
	exporterLabels = []string{labelExporter, labelSocket}
	poolLabels     = []string{labelExporter, labelSocket, labelPool, labelPoolID, labelDevice}
	peerLabels     = []string{labelExporter, labelSocket, labelPeer}
)

// gauge describes the series cudapool_name, labelled labels and then extra.
func gauge(name, help string, labels []string, extra ...string) *prometheus.Desc {
	return prometheus.NewDesc("cudapool_"+name, help, append(labels[:len(labels):len(labels)], extra...), nil)
}

// counter is gauge for a series sent as a counter (sendCounter).
func counter(name, help string, labels []string) *prometheus.Desc { return gauge(name, help, labels) }

// Exporter metrics.
var (
	exporterUp = gauge("exporter_up",
		"1 when the exporter answered its state at this scrape, 0 when it is announced but dead or did not answer.", exporterLabels)
	exporterInfo = gauge("exporter_info",
		"Always 1; its labels say which process the exporter runs in.", exporterLabels, labelPID)
	exporterStart = gauge("exporter_start_time_seconds",
		"When the exporter started listening, in seconds since the Unix epoch.", exporterLabels)
	exporterPublished = gauge("exporter_published_buffers",
		"Buffers published under a name.", exporterLabels)
	exporterPublishedBytes = gauge("exporter_published_bytes",
		"Size of the buffers published under a name.", exporterLabels)
	exporterPeers = gauge("exporter_peers",
		"Peers that take leases: connected, or hung up and awaiting their exit.", exporterLabels)
)

// Pool metrics.
var (
	poolInfo = gauge("pool_info",
		"Always 1; its labels say how the pool is shared.", poolLabels, labelHandleType)
	poolMax = gauge("pool_max_bytes",
		"The most the pool may reserve (pool.WithMaxSize); absent when it has no limit.", poolLabels)
	poolReserved = gauge("pool_reserved_bytes",
		"Memory the driver holds for the pool.", poolLabels)
	poolReservedHigh = gauge("pool_reserved_high_water_bytes",
		"The most the driver held for the pool since it was created or its marks reset.", poolLabels)
	poolUsed = gauge("pool_used_bytes",
		"Memory of the pool that allocations use, as the driver counts it.", poolLabels)
	poolUsedHigh = gauge("pool_used_high_water_bytes",
		"The most memory of the pool allocations used since it was created or its marks reset.", poolLabels)
	poolRounding = gauge("pool_rounding_overhead_bytes",
		"Memory the live buffers hold beyond what they asked for (rounding to the granularity).", poolLabels)
	poolBuffers = gauge("pool_buffers",
		"Buffers not yet returned to the driver: live, waiting on leases to be freed, or whose free failed.", poolLabels)
	poolShared = gauge("pool_shared_buffers",
		"Buffers with at least one live lease.", poolLabels)
	poolLeases = gauge("pool_leases",
		"Live leases on the pool's buffers.", poolLabels)
	poolDeferred = gauge("pool_deferred_frees",
		"Buffers freed while leased, waiting for their last lease to end.", poolLabels)
	poolFailed = gauge("pool_failed_frees",
		"Deferred frees that failed; their memory stays reserved until the pool closes.", poolLabels)
	poolFailedBytes = gauge("pool_failed_free_bytes",
		"Memory the failed deferred frees left reserved.", poolLabels)
	poolCacheLimit = gauge("pool_cache_limit_bytes",
		"The most the pool's cache of freed buffers may hold (pool.WithCache); absent without a cache.", poolLabels)
	poolCachedBuffers = gauge("pool_cached_buffers",
		"Freed buffers the pool's cache holds for reuse (reserved in the driver, not live).", poolLabels)
	poolCachedBytes = gauge("pool_cached_bytes",
		"Memory the pool's cache holds.", poolLabels)
	poolCacheHits = counter("pool_cache_hits_total",
		"Allocations the pool's cache served.", poolLabels)
	poolCacheMisses = counter("pool_cache_misses_total",
		"Allocations that went to the driver while the pool's cache was on.", poolLabels)
)

// Peer metrics.
var (
	peerInfo = gauge("peer_info",
		"Always 1; its labels say who the peer is.", peerLabels, labelUID, labelGID, labelPeerDevice, labelRemote, labelCommand)
	peerLeases = gauge("peer_leases",
		"Buffers the peer holds a lease on.", peerLabels)
	peerGrants = gauge("peer_grants",
		"Opens behind the peer's leases.", peerLabels)
	peerLeasedBytes = gauge("peer_leased_bytes",
		"Size of the buffers the peer holds a lease on.", peerLabels)
	peerConnectTime = gauge("peer_connect_time_seconds",
		"When the peer connected, in seconds since the Unix epoch.", peerLabels)
	peerAwaitingExit = gauge("peer_awaiting_exit",
		"1 for a peer that hung up without Bye while its process lives on: its leases are kept until it exits.", peerLabels)
)
