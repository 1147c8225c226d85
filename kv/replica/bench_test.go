package replica_test

import (
	"encoding/binary"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/cudapool/cudapool/cudart"
	"github.com/cudapool/cudapool/kv"
	"github.com/cudapool/cudapool/kv/replica"
)

// BenchmarkMatch512 is a Match of 512 visible pages and its Release, owner and replica
// in one process (on software devices of their own).
func BenchmarkMatch512(b *testing.B) {
	r, rs := benchReplica(b, 1024)
	ctx := bound(b)
	hashes := r.Hashes(tokens(r.Geometry(), 512, 1))
	l, err := r.Alloc(ctx, 512)
	require.NoError(b, err)
	_, err = r.Seal(ctx, l, hashes, rs)
	require.NoError(b, err)
	b.Run("match", func(b *testing.B) {
		for b.Loop() {
			m, err := r.Match(ctx, hashes)
			if err != nil || len(m.Pages()) != 512 {
				b.Fatal(err, len(m.Pages()))
			}
			if err := r.Release(ctx, m, rs); err != nil {
				b.Fatal(err)
			}
		}
	})
}

// BenchmarkCycle256 is alloc + seal (waiting until visible) + match + release of 256
// pages, owner and replica in one process; pages/s is the rate of one replica.
func BenchmarkCycle256(b *testing.B) {
	r, rs := benchReplica(b, 4096)
	ctx := bound(b)
	const n = 256
	hashes := make([]kv.Hash, n)
	var seq uint64
	for b.Loop() {
		for i := range hashes {
			seq++
			binary.LittleEndian.PutUint64(hashes[i][:], seq)
		}
		w, err := r.Alloc(ctx, n)
		if err != nil {
			b.Fatal(err)
		}
		if _, err := r.Seal(ctx, w, hashes, rs, replica.WaitVisible()); err != nil {
			b.Fatal(err)
		}
		m, err := r.Match(ctx, hashes)
		if err != nil || len(m.Pages()) != n {
			b.Fatal(err)
		}
		if err := r.Release(ctx, m, rs); err != nil {
			b.Fatal(err)
		}
	}
	b.ReportMetric(float64(n*b.N)/b.Elapsed().Seconds(), "pages/s")
}

// benchReplica starts an owner of llama-0.85b slabs of pages pages and dials a replica
// of it, in this process (on software devices of their own).
func benchReplica(b *testing.B, pages int) (*replica.Replica, cudart.Stream) {
	g, err := kv.Layout("llama-0.85b")
	require.NoError(b, err)
	g.Pages = pages
	_, _, dir := startOwner(b, g)
	r, _, rs := dial(b, dir, 0)
	return r, rs
}
