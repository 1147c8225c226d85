package main

import (
	"context"
	"errors"
	"fmt"
	"io"
	"log"
	"net"
	"net/http"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/promhttp"

	"github.com/cudapool/cudapool/kv"
	"github.com/cudapool/cudapool/metrics"
)

// serve answers Prometheus scrapes at http://addr/metrics until ctx ends, and returns
// the exit status: 0 after Ctrl-C, 1 when it cannot serve. Each scrape takes a fresh
// look at the exporters, as poolstat does, and reports every one it finds but those it
// removed as dead beyond doubt: the dead and the unreachable with cudapool_exporter_up 0.
func serve(ctx context.Context, l *looker, addr string, stdout, stderr io.Writer) int {
	ln, err := net.Listen("tcp", addr)
	if err != nil {
		fmt.Fprintf(stderr, "poolstat: -serve: %v\n", err)
		return 1
	}
	reg := prometheus.NewRegistry()
	reg.MustRegister(metrics.NewTargetCollector(func() ([]metrics.Target, error) { return l.targets(ctx) }))
	if l.kv != "" {
		reg.MustRegister(metrics.NewKVCollector(l.kv, func() (kv.Stats, error) { return kvLook(ctx, l.kv, l.timeout) }))
	}
	mux := http.NewServeMux()
	mux.Handle("/metrics", promhttp.HandlerFor(reg, promhttp.HandlerOpts{
		ErrorLog:      log.New(stderr, "poolstat: ", 0),
		ErrorHandling: promhttp.HTTPErrorOnError, // an unreadable announce directory is no empty host
	}))
	srv := &http.Server{Handler: mux, ReadHeaderTimeout: 10 * time.Second, ErrorLog: log.New(stderr, "poolstat: ", 0)}
	fmt.Fprintf(stdout, "poolstat: serving metrics at http://%s/metrics (Ctrl-C stops)\n", ln.Addr())
	served := make(chan error, 1)
	go func() { served <- srv.Serve(ln) }()
	select {
	case err := <-served:
		fmt.Fprintf(stderr, "poolstat: -serve: %v\n", err)
		return 1
	case <-ctx.Done():
	}
	// Scrapes in progress get a moment to finish; their looks end with ctx already.
	shutdown, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	if err := srv.Shutdown(shutdown); err != nil && !errors.Is(err, context.DeadlineExceeded) {
		fmt.Fprintf(stderr, "poolstat: -serve: %v\n", err)
	}
	if err := <-served; !errors.Is(err, http.ErrServerClosed) {
		fmt.Fprintf(stderr, "poolstat: -serve: %v\n", err)
		return 1
	}
	return 0
}

// targets takes one look and returns what it found, for one scrape.
func (l *looker) targets(ctx context.Context) ([]metrics.Target, error) {
	r, err := l.look(ctx)
	if err != nil {
		return nil, err
	}
	ts := make([]metrics.Target, 0, len(r.Exporters))
	for _, e := range r.Exporters {
		if e.Status != Removed { // gone for good: no target to watch
			ts = append(ts, metrics.Target{Name: e.Name, Socket: e.Socket, State: e.State})
		}
	}
	return ts, nil
}
