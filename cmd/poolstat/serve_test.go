package main

import (
	"bufio"
	"context"
	"fmt"
	"io"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus/testutil"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"golang.org/x/sync/errgroup"

	"github.com/cudapool/cudapool/export/producer"
)

// TestServe scrapes poolstat -serve over loopback: a live exporter with a published
// buffer; a dead one, announced by a process that has exited, whose announcement the
// first scrape removes and no scrape exports; and one whose process lives but whose
// socket refuses connections, exported with up 0.
func TestServe(t *testing.T) {
	dir := shortDir(t)
	ex := testExporter(t, dir, producer.WithName("served"))
	live, err := ex.State()
	require.NoError(t, err)
	gone := exec.Command("true")
	require.NoError(t, gone.Run())
	goneAnnounced := announce(t, dir, gone.Process.Pid, filepath.Join(dir, "gone.sock"), time.Now())
	deadSocket := filepath.Join(dir, "dead.sock")
	announce(t, dir, os.Getppid(), deadSocket, time.Now()) // a process that lives on

	url, stop := serving(t, "-dir", dir)

	want := fmt.Sprintf(`
# HELP cudapool_exporter_up 1 when the exporter answered its state at this scrape, 0 when it is announced but dead or did not answer.
# TYPE cudapool_exporter_up gauge
cudapool_exporter_up{exporter="planted",socket=%q} 0
cudapool_exporter_up{exporter="served",socket=%q} 1
# HELP cudapool_exporter_peers Peers that take leases: connected, or hung up and awaiting their exit.
# TYPE cudapool_exporter_peers gauge
cudapool_exporter_peers{exporter="served",socket=%q} 0
`, deadSocket, live.Socket, live.Socket)
	require.NoError(t, testutil.ScrapeAndCompare(url, strings.NewReader(want), "cudapool_exporter_up", "cudapool_exporter_peers"))
	assert.NoFileExists(t, goneAnnounced, "the scrape removed the announcement of an exporter whose process is gone")

	// Scrapes may overlap; each takes its own look.
	client := &http.Client{Timeout: hangGuard}
	var g errgroup.Group
	for range 4 {
		g.Go(func() error {
			resp, err := client.Get(url)
			if err != nil {
				return err
			}
			defer func() { _ = resp.Body.Close() }() // test cleanup
			body, err := io.ReadAll(resp.Body)
			if err == nil && (resp.StatusCode != http.StatusOK || !strings.Contains(string(body), "cudapool_exporter_up")) {
				err = fmt.Errorf("scrape answered %s:\n%s", resp.Status, body)
			}
			return err
		})
	}
	require.NoError(t, g.Wait())

	// Only /metrics is served.
	resp, err := client.Get(strings.TrimSuffix(url, "/metrics") + "/other")
	require.NoError(t, err)
	_ = resp.Body.Close() // test cleanup
	assert.Equal(t, http.StatusNotFound, resp.StatusCode)

	assert.Equal(t, 0, stop(), "poolstat -serve exited after Ctrl-C")
}

// serving runs poolstat -serve on a loopback port with args, and returns the URL it
// serves metrics at and a stop (Ctrl-C) that returns its exit status.
func serving(t *testing.T, args ...string) (url string, stop func() int) {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	t.Cleanup(cancel)
	out, w := io.Pipe()
	done := make(chan int, 1)
	go func() {
		done <- run(ctx, append([]string{"-serve", "127.0.0.1:0"}, args...), w, os.Stderr)
		w.Close()
	}()
	first := make(chan string, 1)
	go func() {
		line, _ := bufio.NewReader(out).ReadString('\n')
		first <- line
		io.Copy(io.Discard, out)
	}()
	select {
	case line := <-first:
		_, rest, ok := strings.Cut(line, "serving metrics at ")
		require.True(t, ok, "poolstat -serve said %q", line)
		url, _, _ = strings.Cut(rest, " ")
	case <-time.After(hangGuard):
		t.Fatal("poolstat -serve never said where it serves")
	}
	return url, func() int {
		cancel()
		select {
		case code := <-done:
			return code
		case <-time.After(hangGuard):
			t.Fatal("poolstat -serve did not stop after Ctrl-C")
			return -1
		}
	}
}

func TestServeBadAddress(t *testing.T) {
	code, _, errOut := poolstat(t, "-serve", "256.0.0.1:http", "-dir", t.TempDir())
	assert.Equal(t, 1, code)
	assert.Contains(t, errOut, "poolstat: -serve: ")
}
