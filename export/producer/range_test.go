package producer_test

import (
	"bytes"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/cudapool/cudapool/export"
	"github.com/cudapool/cudapool/export/internal/exporttest"
	"github.com/cudapool/cudapool/export/producer"
)

func TestPublishRefusesBadRangesAndMetadata(t *testing.T) {
	pr := exporttest.NewProducer(t, nil, nil)
	ctx := exporttest.Ctx(t)
	b, err := pr.Pool.Alloc(ctx, 1<<20, pr.Stream)
	require.NoError(t, err)
	for _, r := range [][2]uint64{{1 << 20, 0}, {1 << 20, 1}, {0, 1<<20 + 1}, {5, 1 << 20}, {1<<64 - 1, 2}} {
		err := pr.Ex.Publish(ctx, "x", b, pr.Stream, producer.Range(r[0], r[1]))
		require.ErrorIs(t, err, export.ErrBadRange, "Range(%d, %d)", r[0], r[1])
	}
	err = pr.Ex.Publish(ctx, "x", b, pr.Stream, producer.WithMeta(bytes.Repeat([]byte{1}, export.MaxMetaLen+1)))
	require.ErrorIs(t, err, producer.ErrMetaTooLong)
	require.Zero(t, pr.Ex.PublishedCount(), "nothing was published")
	require.NoError(t, pr.Ex.Publish(ctx, "x", b, pr.Stream, producer.WithMeta(bytes.Repeat([]byte{1}, export.MaxMetaLen))))
}
