package metrics_test

import (
	"context"
	"fmt"
	"log"
	"net/http"
	"os"
	"path/filepath"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/promhttp"

	"github.com/cudapool/cudapool/cudart/cudarttest"
	"github.com/cudapool/cudapool/export/producer"
	"github.com/cudapool/cudapool/metrics"
	"github.com/cudapool/cudapool/pool"
)

// A producer serves its own figures: its Exporter's (with the pools it publishes from)
// and those of a pool it keeps to itself.
func ExampleNewExporterCollector() {
	ctx := context.Background()
	rt := cudarttest.New()            // cudart.Load() on a GPU host
	defer func() { _ = rt.Close() }() // the example's cleanup
	dir, err := os.MkdirTemp("", "example")
	if err != nil {
		log.Fatal(err)
	}
	defer func() { _ = os.RemoveAll(dir) }() // the example's cleanup

	shared, err := pool.New(rt, 0, pool.WithName("kv"))
	if err != nil {
		log.Fatal(err)
	}
	scratch, err := pool.New(rt, 0, pool.WithName("scratch"))
	if err != nil {
		log.Fatal(err)
	}
	ex, err := producer.Listen(filepath.Join(dir, "kv.sock"), rt, producer.WithoutAnnounce(), producer.WithName("producer"))
	if err != nil {
		log.Fatal(err)
	}
	buf, err := shared.Alloc(ctx, 4<<20, 0)
	if err != nil {
		log.Fatal(err)
	}
	if err := ex.Publish(ctx, "prompt", buf, 0); err != nil {
		log.Fatal(err)
	}

	reg := prometheus.NewRegistry()
	reg.MustRegister(metrics.NewExporterCollector(ex), metrics.NewPoolCollector(scratch))
	mux := http.NewServeMux()
	mux.Handle("/metrics", promhttp.HandlerFor(reg, promhttp.HandlerOpts{}))
	// ... go http.ListenAndServe(":9400", mux)

	families, err := reg.Gather()
	if err != nil {
		log.Fatal(err)
	}
	for _, f := range families {
		if f.GetName() == "cudapool_pool_buffers" {
			for _, m := range f.GetMetric() {
				for _, l := range m.GetLabel() {
					if l.GetName() == "pool" {
						fmt.Printf("%s %s: %v\n", f.GetName(), l.GetValue(), m.GetGauge().GetValue())
					}
				}
			}
		}
	}

	_ = ex.Close(ctx)         // the example's cleanup
	_ = buf.Free(0)           // the example's cleanup
	_, _ = shared.Close(ctx)  // the example's cleanup
	_, _ = scratch.Close(ctx) // the example's cleanup
	// Output:
	// cudapool_pool_buffers scratch: 0
	// cudapool_pool_buffers kv: 1
}
