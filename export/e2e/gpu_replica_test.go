package e2e_test

import (
	"fmt"
	"path/filepath"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/cudapool/cudapool/cudart"
	"github.com/cudapool/cudapool/export/consumer"
	"github.com/cudapool/cudapool/export/internal/exporttest"
	"github.com/cudapool/cudapool/internal/gputest"
	"github.com/cudapool/cudapool/internal/proctest"
	"github.com/cudapool/cudapool/pool"
)

func TestGPUReplicaCost(t *testing.T) {
	rt := gputest.Devices(t, 2)
	const (
		size  = 256 << 20
		fill  = 0x3c
		dev   = 1
		tries = 6 // the first is a warm-up: it makes the Importer's stream and pool
	)
	path := filepath.Join(exporttest.ShortDir(t), "g.sock")
	k := proctest.Start(t, "producer", "gpu", path, "default", fmt.Sprintf("a=%d:%d", size, fill))
	k.Expect("ready")
	ctx := exporttest.Ctx(t)
	s, err := rt.StreamCreate(dev, cudart.StreamNonBlocking)
	require.NoError(t, err)
	defer rt.StreamDestroy(dev, s)
	imp, err := consumer.Dial(ctx, path, rt, dev)
	require.NoError(t, err)
	defer imp.Close(ctx)
	local, err := pool.New(rt, dev, pool.WithHandleType(cudart.HandleTypeNone))
	require.NoError(t, err)
	defer local.Close(ctx, pool.Force())
	dst, err := local.Alloc(ctx, size, s)
	require.NoError(t, err)
	defer dst.Free(s)

	// timed runs f and waits for s: the first time, and the best of the others.
	timed := func(f func() error) (first, best time.Duration) {
		best = time.Duration(1<<63 - 1)
		for i := range tries {
			start := time.Now()
			require.NoError(t, f())
			require.NoError(t, rt.StreamSynchronize(dev, s))
			if d := time.Since(start); i > 0 {
				best = min(best, d)
			} else {
				first = d
			}
		}
		return first, best
	}
	open := func(opts ...consumer.OpenOption) func() error {
		return func() error {
			m, err := imp.Open(ctx, "a", s, opts...)
			if err != nil {
				return err
			}
			return m.Release(ctx, s)
		}
	}
	read := func(m *consumer.Mapping) func() error {
		return func() error { return rt.MemcpyDtoDAsync(dev, dst.Ptr(), m.Ptr(), size, s) }
	}
	_, plainOpen := timed(open())
	firstReplica, replicaOpen := timed(open(consumer.WithLocalCopy(nil)))

	m, err := imp.Open(ctx, "a", s)
	require.NoError(t, err)
	_, overNVLink := timed(read(m))
	r, err := imp.Open(ctx, "a", s, consumer.WithLocalCopy(nil))
	require.NoError(t, err)
	require.NoError(t, exporttest.Holds(rt, dev, r, fill, s), "the replica's bytes")
	_, fromReplica := timed(read(r))
	require.NoError(t, r.Release(ctx, s))
	require.NoError(t, m.Release(ctx, s))

	gbps := func(d time.Duration) float64 { return float64(size) / max(d, 1).Seconds() / 1e9 }
	t.Logf("%d MiB, consumer on GPU 1, producer on GPU 0, best of %d:", size>>20, tries-1)
	t.Logf("  Open + Release, plain:          %v", plainOpen)
	t.Logf("  Open + Release, WithLocalCopy:    %v (the copy through GPU 0 included: %.0f GB/s); the first: %v", replicaOpen, gbps(replicaOpen-plainOpen), firstReplica)
	t.Logf("  one read of the mapping (NVLink): %v (%.0f GB/s)", overNVLink, gbps(overNVLink))
	t.Logf("  one read of the replica (local):  %v (%.0f GB/s)", fromReplica, gbps(fromReplica))
	require.NoError(t, imp.Close(ctx))
	k.Send("quit")
	k.Finish()
}
