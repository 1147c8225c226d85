package main

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"os"
	"strings"
	"testing"

	"github.com/prometheus/client_golang/prometheus/testutil"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/cudapool/cudapool/cudart/cudarttest"
	"github.com/cudapool/cudapool/kv"
	"github.com/cudapool/cudapool/kv/owner"
	"github.com/cudapool/cudapool/kv/replica"
)

// kvOwner serves a KV page pool in dir, with a replica of this process holding a read
// lease of 3 pages.
func kvOwner(t *testing.T) string {
	t.Helper()
	dir := shortDir(t)
	ctx, cancel := context.WithTimeout(context.Background(), hangGuard)
	t.Cleanup(cancel)
	g := kv.Geometry{Layers: 2, KVHeads: 2, HeadDim: 8, TokensPerPage: 4, DType: kv.DTypeBF16, Pages: 16}
	odev := cudarttest.ForTest(t)
	o, err := owner.Listen(dir, odev, g)
	require.NoError(t, err)
	t.Cleanup(func() { o.Close(ctx) })
	rdev := cudarttest.ForTest(t)
	r, err := replica.Dial(ctx, dir, rdev, 0)
	require.NoError(t, err)
	t.Cleanup(func() { r.Close(ctx) })
	hashes := r.Hashes(make([]int32, 12))
	w, err := r.Alloc(ctx, 3)
	require.NoError(t, err)
	_, err = r.Seal(ctx, w, hashes, 0, replica.WaitVisible())
	require.NoError(t, err)
	_, err = r.Match(ctx, hashes)
	require.NoError(t, err)
	return dir
}

func TestKV(t *testing.T) {
	dir := kvOwner(t)
	code, out, errOut := poolstat(t, "-kv", dir)
	require.Equal(t, 0, code, "stderr: %s", errOut)
	lines := strings.Split(strings.TrimSpace(out), "\n")
	require.Len(t, lines, 5, "a summary, the devices' header and row, the replicas' header and row:\n%s", out)
	assert.Contains(t, lines[0], fmt.Sprintf("KV page pool at %s, owner pid %d: 2 layers", dir, os.Getpid()))
	assert.Contains(t, lines[0], "at most 16 pages of 512 B per slab (8.0 MiB reserved, in chunks of 2.0 MiB)")
	assert.Equal(t, strings.Fields("0 8.0 MiB 16 13 0 0 3 3 0 0 3 0 0 0 3 0"), strings.Fields(lines[2]), "device 0: 4 chunks mapped, 16 pages, 13 free, 3 sealed and leased, 3 hits, 3 seals")
	assert.Equal(t, []string{fmt.Sprint(os.Getpid()), "0", "1", "3"}, dropCommand(strings.Fields(lines[4])), "the replica: device 0, 1 lease, 3 pages")

	code, out, errOut = poolstat(t, "-kv", dir, "-json")
	require.Equal(t, 0, code, "stderr: %s", errOut)
	var st kv.Stats
	require.NoError(t, json.Unmarshal([]byte(out), &st))
	assert.Equal(t, 3, st.Devices[0].Leased)
	assert.Equal(t, uint64(2<<20), st.Geometry.ChunkBytes)
	assert.Equal(t, 4, st.Devices[0].Chunks)
	assert.Equal(t, uint64(8<<20), st.Devices[0].MappedBytes)
	assert.Equal(t, uint64(8<<20), st.Geometry.ReservedBytes)

	code, _, errOut = poolstat(t, "-kv", shortDir(t))
	assert.Equal(t, 1, code)
	assert.Contains(t, errOut, "owner is gone")
	code, _, _ = poolstat(t, "-kv", dir, "-keep-dead")
	assert.Equal(t, 2, code)
}

// A device's host tier is a table of its own.
func TestKVHostTier(t *testing.T) {
	dir := shortDir(t)
	ctx, cancel := context.WithTimeout(context.Background(), hangGuard)
	t.Cleanup(cancel)
	g := kv.Geometry{Layers: 2, KVHeads: 2, HeadDim: 8, TokensPerPage: 4, DType: kv.DTypeBF16, Pages: 16}
	o, err := owner.Listen(dir, cudarttest.ForTest(t), g, owner.WithHostBytes(8*owner.HostPageBytes(g)))
	require.NoError(t, err)
	t.Cleanup(func() { o.Close(ctx) })
	code, out, errOut := poolstat(t, "-kv", dir)
	require.Equal(t, 0, code, "stderr: %s", errOut)
	lines := strings.Split(strings.TrimSpace(out), "\n")
	require.Len(t, lines, 6, "a summary, the devices' header and row, the host tiers' header and row, no replica:\n%s", out)
	assert.Equal(t, strings.Fields("HOST TIER SIZE FREE FILLING SEALED TWINS SPILLS SPILL GB/s RESTORES RESTORE GB/s SPILLED LOST EVICTED COPIES BY"), strings.Fields(lines[3]))
	assert.Equal(t, strings.Fields("0 4.0 KiB 8 0 0 0 0 - 0 - 0 0 0 kernel"), strings.Fields(lines[4]), "device 0: 8 free host pages")
}

// dropCommand leaves out the command column of a replica row (the test binary's name).
func dropCommand(f []string) []string {
	if len(f) < 2 {
		return f
	}
	return append(f[:1:1], f[2:]...)
}

func TestServeKV(t *testing.T) {
	dir := kvOwner(t)
	url, stop := serving(t, "-dir", shortDir(t), "-kv", dir)
	want := fmt.Sprintf(`
# HELP cudapool_kv_leased_pages Sealed pages that read leases hold.
# TYPE cudapool_kv_leased_pages gauge
cudapool_kv_leased_pages{device="0",kv_dir=%q} 3
# HELP cudapool_kv_up 1 when the KV page pool's owner answered its stats at this scrape, 0 when it did not.
# TYPE cudapool_kv_up gauge
cudapool_kv_up{kv_dir=%q} 1
`, dir, dir)
	require.NoError(t, testutil.ScrapeAndCompare(url, strings.NewReader(want), "cudapool_kv_leased_pages", "cudapool_kv_up"))
	assert.Equal(t, 0, stop())
}

// An owner that keeps an index shows what it took back at its start, on a line of its
// own after the summary.
func TestKVShowsTheRestart(t *testing.T) {
	var b strings.Builder
	renderKV(&b, "/run/kv", kv.Stats{PID: 7, Geometry: kv.StatsGeometry{Layers: 2, Pages: 4, ChunkBytes: 2 << 20},
		Restart: &kv.RestartStats{Epoch: 3, Adopted: true, Keeper: 42, Restored: 2048, Replicas: 3, Awaiting: 1, Kept: 16}})
	lines := strings.Split(b.String(), "\n")
	require.Greater(t, len(lines), 2, b.String())
	assert.Equal(t, "start 3 over keeper pid 42: slabs adopted, 2048 visible pages restored, 3 replicas to reattach (1 not yet), 16 pages kept for the writers of before", lines[1])
}

// A Stats frame that left replicas out says how many, and how many are connected.
func TestRenderKVSaysWhatItLeftOut(t *testing.T) {
	var b bytes.Buffer
	st := kv.Stats{Devices: []kv.DeviceStats{{Device: 0}}, Replicas: []kv.ReplicaStats{{PID: 1}}, ReplicaCount: 3000, ReplicasOmitted: 2999}
	renderKV(&b, "/run/kv", st)
	assert.Contains(t, b.String(), "2999 more replicas not listed (3000 connected)")
}
