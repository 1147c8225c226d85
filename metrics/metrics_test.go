package metrics_test

import (
	"context"
	"errors"
	"fmt"
	"maps"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/testutil"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/cudapool/cudapool/cudart"
	"github.com/cudapool/cudapool/cudart/cudarttest"
	"github.com/cudapool/cudapool/export/consumer"
	"github.com/cudapool/cudapool/export/producer"
	"github.com/cudapool/cudapool/internal/peercred"
	"github.com/cudapool/cudapool/kv"
	"github.com/cudapool/cudapool/metrics"
	"github.com/cudapool/cudapool/pool"
)

// sharing is an exporter publishing two buffers of one pool, and a consumer (a second
// software device, which acts as a second process) holding a lease on one of them.
type sharing struct {
	rt     *cudarttest.Device
	pool   *pool.Pool
	ex     *producer.Exporter
	socket string
	imp    *consumer.Importer
}

func newSharing(t *testing.T) *sharing {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	t.Cleanup(cancel)
	dir, err := os.MkdirTemp("", "cpm") // short: a socket path must fit in 108 bytes
	require.NoError(t, err)
	t.Cleanup(func() { _ = os.RemoveAll(dir) }) // test cleanup

	rt := cudarttest.New()
	t.Cleanup(func() { _ = rt.Close() }) // test cleanup
	p, err := pool.New(rt, 0, pool.WithName("kv"), pool.WithMaxSize(16<<20))
	require.NoError(t, err)
	socket := filepath.Join(dir, "x.sock")
	ex, err := producer.Listen(socket, rt, producer.WithoutAnnounce(), producer.WithName("test-exporter"))
	require.NoError(t, err)
	t.Cleanup(func() { _ = ex.Close(ctx); _, _ = p.Close(ctx) }) // test cleanup
	// 3 MiB rounds up to 4 MiB in a 2 MiB-granular pool: 1 MiB of rounding overhead.
	for name, size := range map[string]uint64{"alpha": 4 << 20, "beta": 3 << 20} {
		buf, err := p.Alloc(ctx, size, 0)
		require.NoError(t, err)
		require.NoError(t, ex.Publish(ctx, name, buf, 0))
	}

	consDev := cudarttest.New()
	t.Cleanup(func() { _ = consDev.Close() }) // test cleanup
	imp, err := consumer.Dial(ctx, socket, consDev, 0)
	require.NoError(t, err)
	t.Cleanup(func() { _ = imp.Close(ctx) }) // test cleanup
	_, err = imp.Open(ctx, "alpha", 0)
	require.NoError(t, err)
	return &sharing{rt: rt, pool: p, ex: ex, socket: socket, imp: imp}
}

// The figures that do not change from run to run, as Prometheus's text format shows them.
func stableFigures(socket string) string {
	return strings.NewReplacer("SOCKET", socket).Replace(`
# HELP cudapool_exporter_peers Peers that take leases: connected, or hung up and awaiting their exit.
# TYPE cudapool_exporter_peers gauge
cudapool_exporter_peers{exporter="test-exporter",socket="SOCKET"} 1
# HELP cudapool_exporter_published_buffers Buffers published under a name.
# TYPE cudapool_exporter_published_buffers gauge
cudapool_exporter_published_buffers{exporter="test-exporter",socket="SOCKET"} 2
# HELP cudapool_exporter_published_bytes Size of the buffers published under a name.
# TYPE cudapool_exporter_published_bytes gauge
cudapool_exporter_published_bytes{exporter="test-exporter",socket="SOCKET"} 7.340032e+06
# HELP cudapool_pool_info Always 1; its labels say how the pool is shared.
# TYPE cudapool_pool_info gauge
cudapool_pool_info{device="0",exporter="test-exporter",handle_type="posix-fd",pool="kv",pool_id="1",socket="SOCKET"} 1
# HELP cudapool_pool_max_bytes The most the pool may reserve (pool.WithMaxSize); absent when it has no limit.
# TYPE cudapool_pool_max_bytes gauge
cudapool_pool_max_bytes{device="0",exporter="test-exporter",pool="kv",pool_id="1",socket="SOCKET"} 1.6777216e+07
# HELP cudapool_pool_rounding_overhead_bytes Memory the live buffers hold beyond what they asked for (rounding to the granularity).
# TYPE cudapool_pool_rounding_overhead_bytes gauge
cudapool_pool_rounding_overhead_bytes{device="0",exporter="test-exporter",pool="kv",pool_id="1",socket="SOCKET"} 1.048576e+06
# HELP cudapool_pool_buffers Buffers not yet returned to the driver: live, waiting on leases to be freed, or whose free failed.
# TYPE cudapool_pool_buffers gauge
cudapool_pool_buffers{device="0",exporter="test-exporter",pool="kv",pool_id="1",socket="SOCKET"} 2
# HELP cudapool_pool_shared_buffers Buffers with at least one live lease.
# TYPE cudapool_pool_shared_buffers gauge
cudapool_pool_shared_buffers{device="0",exporter="test-exporter",pool="kv",pool_id="1",socket="SOCKET"} 1
# HELP cudapool_pool_leases Live leases on the pool's buffers.
# TYPE cudapool_pool_leases gauge
cudapool_pool_leases{device="0",exporter="test-exporter",pool="kv",pool_id="1",socket="SOCKET"} 1
# HELP cudapool_pool_deferred_frees Buffers freed while leased, waiting for their last lease to end.
# TYPE cudapool_pool_deferred_frees gauge
cudapool_pool_deferred_frees{device="0",exporter="test-exporter",pool="kv",pool_id="1",socket="SOCKET"} 0
# HELP cudapool_peer_leases Buffers the peer holds a lease on.
# TYPE cudapool_peer_leases gauge
cudapool_peer_leases{exporter="test-exporter",peer="PID",socket="SOCKET"} 1
# HELP cudapool_peer_leased_bytes Size of the buffers the peer holds a lease on.
# TYPE cudapool_peer_leased_bytes gauge
cudapool_peer_leased_bytes{exporter="test-exporter",peer="PID",socket="SOCKET"} 4.194304e+06
`)
}

var stableNames = []string{
	"cudapool_exporter_peers", "cudapool_exporter_published_buffers", "cudapool_exporter_published_bytes",
	"cudapool_pool_info", "cudapool_pool_max_bytes", "cudapool_pool_rounding_overhead_bytes", "cudapool_pool_buffers",
	"cudapool_pool_shared_buffers", "cudapool_pool_leases", "cudapool_pool_deferred_frees",
	"cudapool_peer_leases", "cudapool_peer_leased_bytes",
}

func expected(socket string) *strings.Reader {
	return strings.NewReader(strings.ReplaceAll(stableFigures(socket), `peer="PID"`, fmt.Sprintf(`peer="%d"`, os.Getpid())))
}

func TestExporterCollector(t *testing.T) {
	s := newSharing(t)
	c := metrics.NewExporterCollector(s.ex)
	require.NoError(t, testutil.CollectAndCompare(c, expected(s.socket), stableNames...))

	// The figures that change from run to run: checked for sense, not equality.
	reg := prometheus.NewPedanticRegistry()
	require.NoError(t, reg.Register(c))
	st, err := s.ex.State()
	require.NoError(t, err)
	families, err := reg.Gather()
	require.NoError(t, err)
	got := map[string]float64{}
	labels := map[string]map[string]string{}
	for _, f := range families {
		m := f.GetMetric()[0]
		got[f.GetName()] = m.GetGauge().GetValue()
		labels[f.GetName()] = map[string]string{}
		for _, l := range m.GetLabel() {
			labels[f.GetName()][l.GetName()] = l.GetValue()
		}
	}
	assert.InDelta(t, float64(st.Started.UnixNano())/1e9, got["cudapool_exporter_start_time_seconds"], 1e-3)
	assert.InDelta(t, float64(st.Peers[0].ConnectedSince.UnixNano())/1e9, got["cudapool_peer_connect_time_seconds"], 1e-3)
	assert.Equal(t, fmt.Sprint(os.Getpid()), labels["cudapool_exporter_info"]["pid"])
	me, err := peercred.Lookup(os.Getpid())
	require.NoError(t, err)
	assert.Equal(t, map[string]string{"exporter": "test-exporter", "socket": s.socket, "peer": fmt.Sprint(os.Getpid()),
		"uid": fmt.Sprint(os.Getuid()), "gid": fmt.Sprint(os.Getgid()), "peer_device": st.Peers[0].Device,
		"remote": "false", "command": me.Command}, labels["cudapool_peer_info"])
	assert.GreaterOrEqual(t, got["cudapool_pool_reserved_bytes"], float64(8<<20), "two buffers of 4 MiB reserved")
	assert.GreaterOrEqual(t, got["cudapool_pool_reserved_high_water_bytes"], got["cudapool_pool_reserved_bytes"])
	assert.GreaterOrEqual(t, got["cudapool_pool_used_high_water_bytes"], got["cudapool_pool_used_bytes"])
	assert.Zero(t, got["cudapool_peer_awaiting_exit"])
}

// documentedNames are the metric names the package documentation lists, its
// "cudapool_subject_{a,b,...}" lines expanded.
func documentedNames(t *testing.T) []string {
	t.Helper()
	src, err := os.ReadFile("metrics.go")
	require.NoError(t, err)
	var names []string
	prefix := ""
	for _, line := range strings.Split(string(src), "\n") {
		text, ok := strings.CutPrefix(line, "//\t")
		if !ok {
			prefix = ""
			continue
		}
		if p, rest, ok := strings.Cut(text, "{"); ok && strings.HasPrefix(p, "cudapool_") {
			prefix, text = p, rest
		}
		if prefix == "" {
			continue
		}
		list, closed := strings.CutSuffix(strings.TrimSpace(text), "}")
		for _, n := range strings.Split(list, ",") {
			if n = strings.TrimSpace(n); n != "" {
				names = append(names, prefix+n)
			}
		}
		if closed {
			prefix = ""
		}
	}
	return names
}

// The names follow Prometheus's conventions, as its own linter reads them, and are the
// ones the package documentation lists.
func TestLint(t *testing.T) {
	s := newSharing(t)
	cached, err := pool.New(s.rt, 0, pool.WithName("cached"), pool.WithCache(8<<20))
	require.NoError(t, err)
	t.Cleanup(func() { _, _ = cached.Close(context.Background()) }) // test cleanup
	// The cache counts a miss and a hit.
	for range 2 {
		buf, err := cached.Alloc(context.Background(), 2<<20, 0)
		require.NoError(t, err)
		require.NoError(t, buf.Free(0))
	}
	collected := map[string]bool{}
	for _, c := range []prometheus.Collector{
		metrics.NewExporterCollector(s.ex),
		metrics.NewPoolCollector(s.pool, cached),
		metrics.NewTargetCollector(func() ([]metrics.Target, error) {
			return []metrics.Target{{Name: "gone", Socket: "/nowhere"}}, nil
		}),
		metrics.NewKVCollector("/run/kv", func() (kv.Stats, error) { return kvStats, nil }),
	} {
		problems, err := testutil.CollectAndLint(c)
		require.NoError(t, err)
		assert.Empty(t, problems)
		reg := prometheus.NewPedanticRegistry()
		require.NoError(t, reg.Register(c))
		families, err := reg.Gather()
		require.NoError(t, err)
		for _, f := range families {
			collected[f.GetName()] = true
		}
	}
	documented := documentedNames(t)
	assert.ElementsMatch(t, documented, slices.Sorted(maps.Keys(collected)),
		"the metrics collected and those the package documentation lists (metrics.go)")
}

func TestTargetCollector(t *testing.T) {
	s := newSharing(t)
	st, err := s.ex.State()
	require.NoError(t, err)
	c := metrics.NewTargetCollector(func() ([]metrics.Target, error) {
		return []metrics.Target{{Name: "test-exporter", Socket: s.socket, State: st}, {Name: "dead\xff", Socket: "/run/gone.sock"}}, nil
	})
	want := `
# HELP cudapool_exporter_up 1 when the exporter answered its state at this scrape, 0 when it is announced but dead or did not answer.
# TYPE cudapool_exporter_up gauge
cudapool_exporter_up{exporter="dead�",socket="/run/gone.sock"} 0
cudapool_exporter_up{exporter="test-exporter",socket="SOCKET"} 1
`
	require.NoError(t, testutil.CollectAndCompare(c, strings.NewReader(strings.ReplaceAll(want, "SOCKET", s.socket)+stableFigures(s.socket)[1:]),
		append(stableNames[:3:3], "cudapool_exporter_up")...))
	// A dead exporter has only its up series.
	assert.Equal(t, 1+len(st.Pools)*13+len(st.Peers)*6+5+1, testutil.CollectAndCount(c))

	// Exporters that cannot be listed fail the scrape rather than show an empty host.
	broken := metrics.NewTargetCollector(func() ([]metrics.Target, error) { return nil, errors.New("unreadable directory") })
	reg := prometheus.NewRegistry()
	require.NoError(t, reg.Register(broken))
	_, err = reg.Gather()
	assert.ErrorContains(t, err, "unreadable directory")
}

func TestPoolCollector(t *testing.T) {
	s := newSharing(t)
	other, err := pool.New(s.rt, 0, pool.WithName("scratch"), pool.WithHandleType(cudart.HandleTypeNone), pool.WithCache(8<<20))
	require.NoError(t, err)
	// A miss, then a hit: the freed buffer goes to the cache and is taken from it.
	for range 2 {
		buf, err := other.Alloc(context.Background(), 2<<20, 0)
		require.NoError(t, err)
		require.NoError(t, buf.Free(0))
	}
	c := metrics.NewPoolCollector(s.pool, other, failing{})
	want := `
# HELP cudapool_pool_leases Live leases on the pool's buffers.
# TYPE cudapool_pool_leases gauge
cudapool_pool_leases{device="0",exporter="",pool="kv",pool_id="1",socket=""} 1
cudapool_pool_leases{device="0",exporter="",pool="scratch",pool_id="2",socket=""} 0
# HELP cudapool_pool_info Always 1; its labels say how the pool is shared.
# TYPE cudapool_pool_info gauge
cudapool_pool_info{device="0",exporter="",handle_type="posix-fd",pool="kv",pool_id="1",socket=""} 1
cudapool_pool_info{device="0",exporter="",handle_type="none",pool="scratch",pool_id="2",socket=""} 1
# HELP cudapool_pool_cache_hits_total Allocations the pool's cache served.
# TYPE cudapool_pool_cache_hits_total counter
cudapool_pool_cache_hits_total{device="0",exporter="",pool="scratch",pool_id="2",socket=""} 1
# HELP cudapool_pool_cache_misses_total Allocations that went to the driver while the pool's cache was on.
# TYPE cudapool_pool_cache_misses_total counter
cudapool_pool_cache_misses_total{device="0",exporter="",pool="scratch",pool_id="2",socket=""} 1
# HELP cudapool_pool_cached_buffers Freed buffers the pool's cache holds for reuse (reserved in the driver, not live).
# TYPE cudapool_pool_cached_buffers gauge
cudapool_pool_cached_buffers{device="0",exporter="",pool="scratch",pool_id="2",socket=""} 1
# HELP cudapool_pool_cache_limit_bytes The most the pool's cache of freed buffers may hold (pool.WithCache); absent without a cache.
# TYPE cudapool_pool_cache_limit_bytes gauge
cudapool_pool_cache_limit_bytes{device="0",exporter="",pool="scratch",pool_id="2",socket=""} 8.388608e+06
`
	require.NoError(t, testutil.CollectAndCompare(c, strings.NewReader(want), "cudapool_pool_leases", "cudapool_pool_info",
		"cudapool_pool_cache_hits_total", "cudapool_pool_cache_misses_total", "cudapool_pool_cached_buffers",
		"cudapool_pool_cache_limit_bytes"))
	// Without a limit the pool has no max series; the failing source has none at all.
	assert.Equal(t, 1, testutil.CollectAndCount(c, "cudapool_pool_max_bytes"))

	_, err = other.Close(context.Background())
	require.NoError(t, err)
	assert.Equal(t, 1, testutil.CollectAndCount(c, "cudapool_pool_info"), "a closed pool is left out")
}

// failing is a pool whose Stats always fail.
type failing struct{}

func (failing) Stats() (pool.Stats, error) { return pool.Stats{}, errors.New("no stats") }

// What another process reports twice is reported once: two announcements of one
// socket (a stale one beside the live exporter's), two peers of one pid (two Importers
// of one process), a pool listed twice. A duplicate series would fail the whole scrape.
func TestDuplicatesAreReportedOnce(t *testing.T) {
	s := newSharing(t)
	st, err := s.ex.State()
	require.NoError(t, err)
	require.Len(t, st.Peers, 1)
	st.Peers = append(st.Peers, st.Peers[0])
	st.Peers[1].ConnectedSince = st.Peers[0].ConnectedSince.Add(-time.Minute)
	st.Peers[1].AwaitingExit = true
	st.Pools = append(st.Pools, st.Pools[0])
	c := metrics.NewTargetCollector(func() ([]metrics.Target, error) {
		return []metrics.Target{{Name: "stale", Socket: s.socket}, {Name: "test-exporter", Socket: s.socket, State: st},
			{Name: "stale again", Socket: s.socket}}, nil
	})
	reg := prometheus.NewPedanticRegistry()
	require.NoError(t, reg.Register(c))
	_, err = reg.Gather()
	require.NoError(t, err)

	want := fmt.Sprintf(`
# HELP cudapool_exporter_up 1 when the exporter answered its state at this scrape, 0 when it is announced but dead or did not answer.
# TYPE cudapool_exporter_up gauge
cudapool_exporter_up{exporter="test-exporter",socket=%[1]q} 1
# HELP cudapool_peer_leases Buffers the peer holds a lease on.
# TYPE cudapool_peer_leases gauge
cudapool_peer_leases{exporter="test-exporter",peer="%[2]d",socket=%[1]q} 2
# HELP cudapool_peer_awaiting_exit 1 for a peer that hung up without Bye while its process lives on: its leases are kept until it exits.
# TYPE cudapool_peer_awaiting_exit gauge
cudapool_peer_awaiting_exit{exporter="test-exporter",peer="%[2]d",socket=%[1]q} 1
# HELP cudapool_peer_connect_time_seconds When the peer connected, in seconds since the Unix epoch.
# TYPE cudapool_peer_connect_time_seconds gauge
cudapool_peer_connect_time_seconds{exporter="test-exporter",peer="%[2]d",socket=%[1]q} %[3]v
`, s.socket, os.Getpid(), float64(st.Peers[1].ConnectedSince.UnixNano())/1e9)
	require.NoError(t, testutil.CollectAndCompare(c, strings.NewReader(want), "cudapool_exporter_up", "cudapool_peer_leases",
		"cudapool_peer_awaiting_exit", "cudapool_peer_connect_time_seconds"))
	assert.Equal(t, 1, testutil.CollectAndCount(c, "cudapool_pool_leases"), "a pool listed twice")
	assert.Equal(t, 1, testutil.CollectAndCount(c, "cudapool_peer_info"), "one peer's info, listed twice")
}
