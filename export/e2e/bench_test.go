package e2e_test

import (
	"fmt"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/cudapool/cudapool/export/internal/exporttest"
)

// BenchmarkOpenExportedInProcess is BenchmarkOpenExported with the consumer in this
// process on a second software device: the protocol's own cost, without a second
// process to schedule. The software device only: real CUDA cannot import a pool into
// the process that exported it.
func BenchmarkOpenExportedInProcess(b *testing.B) {
	pr := exporttest.NewProducer(b, nil, nil)
	const count = 64
	for i := range count {
		pr.Publish(b, fmt.Sprint("x", i), 1<<20, 1)
	}
	c := exporttest.NewConsumer(b, pr.Path, 1)
	ctx := exporttest.Ctx(b)
	_, err := exporttest.BenchOpen(ctx, c.Imp, c.Stream, "x", count, count) // warm up, untimed
	require.NoError(b, err)
	b.ResetTimer()
	spent, err := exporttest.BenchOpen(ctx, c.Imp, c.Stream, "x", count, b.N)
	require.NoError(b, err)
	b.ReportMetric(float64(spent.Nanoseconds())/float64(b.N), "ns/op")
}
