package metrics

import (
	"strconv"
	"strings"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/cudapool/cudapool/export"
	"github.com/cudapool/cudapool/export/producer"
	"github.com/cudapool/cudapool/internal/peercred"
	"github.com/cudapool/cudapool/pool"
)

// NewExporterCollector returns a collector of ex's State at each scrape: the exporter,
// the pools it publishes buffers of and its peers. A State that fails is a collection
// error of that scrape.
func NewExporterCollector(ex *producer.Exporter) prometheus.Collector { return exporterCollector{ex} }

type exporterCollector struct{ ex *producer.Exporter }

// Describe describes nothing: the collector is unchecked (see the package docs).
func (c exporterCollector) Describe(chan<- *prometheus.Desc) {}

func (c exporterCollector) Collect(ch chan<- prometheus.Metric) {
	st, err := c.ex.State()
	if err != nil {
		ch <- prometheus.NewInvalidMetric(exporterInfo, err)
		return
	}
	collectState(ch, st.Name, st.Socket, st)
}

// Target is one exporter as a scrape found it: its State, or nil when it could not be
// asked (announced but dead, refused, timed out).
type Target struct {
	Name   string // the name it announced
	Socket string // where it was asked: its identity, whatever its State says
	State  *export.State
}

// NewTargetCollector returns a collector that calls targets at each scrape and reports
// every exporter it returns: cudapool_exporter_up for each socket, and the figures of
// those with a State. Targets of one socket are one exporter (a stale announcement of
// an earlier exporter on the same path, say): up is 1 if any of them answered. An error from targets (the exporters could not be listed) is a
// collection error of that scrape. targets runs once per scrape, and scrapes may
// overlap: it must bound its own time, as a scrape waits for it.
func NewTargetCollector(targets func() ([]Target, error)) prometheus.Collector {
	return targetCollector(targets)
}

type targetCollector func() ([]Target, error)

// Describe describes nothing: the collector is unchecked (see the package docs).
func (c targetCollector) Describe(chan<- *prometheus.Desc) {}

func (c targetCollector) Collect(ch chan<- prometheus.Metric) {
	targets, err := c()
	if err != nil {
		ch <- prometheus.NewInvalidMetric(exporterUp, err)
		return
	}
	bySocket := map[string]Target{}
	var sockets []string
	for _, t := range targets {
		if seen, ok := bySocket[t.Socket]; !ok {
			sockets = append(sockets, t.Socket)
		} else if seen.State != nil || t.State == nil {
			continue // the first that answered speaks for the socket
		}
		bySocket[t.Socket] = t
	}
	for _, socket := range sockets {
		t := bySocket[socket]
		name, up := t.Name, 0.0
		if t.State != nil {
			name, up = t.State.Name, 1
			collectState(ch, name, socket, t.State)
		}
		send(ch, exporterUp, up, []string{name, socket})
	}
}

// StatsSource is what NewPoolCollector reads: *pool.Pool, or anything that wraps one.
type StatsSource interface {
	Stats() (pool.Stats, error)
}

// NewPoolCollector returns a collector of the pools' Stats at each scrape, for pools
// that no Exporter in the registry reports already (one reports the pools it publishes
// buffers of). Their exporter and socket labels are empty, and each pool's pool_id is
// its position among the arguments, from 1. A pool whose Stats fail is left out.
func NewPoolCollector(pools ...StatsSource) prometheus.Collector { return poolCollector(pools) }

type poolCollector []StatsSource

// Describe describes nothing: the collector is unchecked (see the package docs).
func (c poolCollector) Describe(chan<- *prometheus.Desc) {}

func (c poolCollector) Collect(ch chan<- prometheus.Metric) {
	for i, p := range c {
		s, err := p.Stats()
		if err != nil {
			continue
		}
		collectPool(ch, []string{"", "", s.Name, strconv.Itoa(i + 1), strconv.Itoa(s.Device)}, s)
	}
}

// collectState sends the figures of one exporter's State under its name and socket.
// The State comes from another process: a pool id or a peer pid it lists twice (two
// Importers of one process are two peers of one pid) is reported once, not as series
// that would fail the scrape.
func collectState(ch chan<- prometheus.Metric, name, socket string, st *export.State) {
	ex := []string{name, socket}
	var publishedBytes uint64
	for _, n := range st.Published {
		publishedBytes += n.Size
	}
	send(ch, exporterInfo, 1, ex, strconv.Itoa(st.PID))
	if !st.Started.IsZero() {
		send(ch, exporterStart, seconds(st.Started.UnixNano()), ex)
	}
	send(ch, exporterPublished, float64(len(st.Published)), ex)
	send(ch, exporterPublishedBytes, float64(publishedBytes), ex)
	send(ch, exporterPeers, float64(len(st.Peers)), ex)

	pools := map[uint64]bool{}
	for _, p := range st.Pools {
		if p.Error != "" || pools[p.ID] {
			continue // figures that could not all be read, or a pool already reported
		}
		pools[p.ID] = true
		collectPool(ch, append(ex[:2:2], p.Name, strconv.FormatUint(p.ID, 10), strconv.Itoa(p.Device)), p.Stats)
	}

	for _, p := range peersByPID(st.Peers) {
		labels := append(ex[:2:2], strconv.Itoa(p.PID))
		send(ch, peerLeases, float64(p.Leases), labels)
		send(ch, peerGrants, float64(p.Grants), labels)
		send(ch, peerLeasedBytes, float64(p.BytesLeased), labels)
		send(ch, peerConnectTime, seconds(p.ConnectedSince.UnixNano()), labels)
		send(ch, peerAwaitingExit, boolean(p.AwaitingExit), labels)
	}
	infos := map[[6]string]bool{}
	for _, p := range st.Peers {
		command := ""
		if info, err := peercred.Lookup(p.PID); err == nil && !p.Remote {
			command = info.Command
		}
		info := [6]string{strconv.Itoa(p.PID), strconv.FormatUint(uint64(p.UID), 10), strconv.FormatUint(uint64(p.GID), 10),
			p.Device, strconv.FormatBool(p.Remote), command}
		if !infos[info] {
			infos[info] = true
			send(ch, peerInfo, 1, append(ex[:2:2], info[0]), info[1:]...)
		}
	}
}

// peersByPID sums the peers of one pid into one, in the order of their first
// appearance: the earliest connection, and awaiting its exit if any is.
func peersByPID(peers []export.PeerState) []export.PeerState {
	var out []export.PeerState
	at := map[int]int{}
	for _, p := range peers {
		i, ok := at[p.PID]
		if !ok {
			at[p.PID] = len(out)
			out = append(out, p)
			continue
		}
		q := &out[i]
		q.Leases += p.Leases
		q.Grants += p.Grants
		q.BytesLeased += p.BytesLeased
		if p.ConnectedSince.Before(q.ConnectedSince) {
			q.ConnectedSince = p.ConnectedSince
		}
		q.AwaitingExit = q.AwaitingExit || p.AwaitingExit
	}
	return out
}

// collectPool sends one pool's figures under labels (poolLabels' values). A State
// read over a socket carries no cache figures: they are left out, as for a pool
// without a cache.
func collectPool(ch chan<- prometheus.Metric, labels []string, s pool.Stats) {
	send(ch, poolInfo, 1, labels, s.HandleType.String())
	if s.MaxSize > 0 {
		send(ch, poolMax, float64(s.MaxSize), labels)
	}
	for _, g := range []struct {
		desc  *prometheus.Desc
		value float64
	}{
		{poolReserved, float64(s.ReservedCurrent)}, {poolReservedHigh, float64(s.ReservedHigh)},
		{poolUsed, float64(s.UsedCurrent)}, {poolUsedHigh, float64(s.UsedHigh)},
		{poolRounding, float64(s.RoundingOverhead())}, {poolBuffers, float64(s.LiveBuffers)},
		{poolShared, float64(s.SharedBuffers)}, {poolLeases, float64(s.ActiveLeases)},
		{poolDeferred, float64(s.DeferredFrees)}, {poolFailed, float64(s.FailedFrees)},
		{poolFailedBytes, float64(s.FailedFreeBytes)},
	} {
		send(ch, g.desc, g.value, labels)
	}
	if s.CacheLimit == 0 {
		return
	}
	send(ch, poolCacheLimit, float64(s.CacheLimit), labels)
	send(ch, poolCachedBuffers, float64(s.CachedBuffers), labels)
	send(ch, poolCachedBytes, float64(s.CachedBytes), labels)
	sendCounter(ch, poolCacheHits, float64(s.CacheHits), labels)
	sendCounter(ch, poolCacheMisses, float64(s.CacheMisses), labels)
}

// send sends one gauge.
func send(ch chan<- prometheus.Metric, d *prometheus.Desc, v float64, labels []string, extra ...string) {
	ch <- prometheus.MustNewConstMetric(d, prometheus.GaugeValue, v, labelValues(labels, extra)...)
}

// sendCounter sends one counter.
func sendCounter(ch chan<- prometheus.Metric, d *prometheus.Desc, v float64, labels []string) {
	ch <- prometheus.MustNewConstMetric(d, prometheus.CounterValue, v, labelValues(labels, nil)...)
}

// labelValues joins labels and extra into a new slice. Label values come from other
// processes (names, UUIDs), so bytes that are not UTF-8, which Prometheus refuses, are
// replaced.
func labelValues(labels, extra []string) []string {
	values := append(labels[:len(labels):len(labels)], extra...)
	for i, s := range values {
		values[i] = strings.ToValidUTF8(s, "\uFFFD")
	}
	return values
}

func seconds(unixNano int64) float64 { return float64(unixNano) / 1e9 }

func boolean(b bool) float64 {
	if b {
		return 1
	}
	return 0
}
