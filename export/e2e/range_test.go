package e2e_test

import (
	"os"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/cudapool/cudapool/export/consumer"
	"github.com/cudapool/cudapool/export/internal/exporttest"
	"github.com/cudapool/cudapool/export/producer"
)

func TestPushedRangeCarriesItsMetadata(t *testing.T) {
	pr := exporttest.NewProducer(t, nil, nil)
	ctx := exporttest.Ctx(t)
	b := pr.Publish(t, "whole", 2<<20, 9)
	require.NoError(t, pr.Ex.Publish(ctx, "block", b, pr.Stream, producer.Range(4096, 512), producer.WithMeta([]byte(`{"block":1}`))))
	got := make(chan *consumer.Mapping, 1)
	d := exporttest.NewSide(t, 0)
	imp, err := consumer.Dial(ctx, pr.Path, d.Dev, 0, consumer.WithLogger(exporttest.DiscardLogger), consumer.WithPushes(func(name string, m *consumer.Mapping) { got <- m }, d.Stream))
	require.NoError(t, err)
	t.Cleanup(func() { imp.Close(ctx) })
	require.NoError(t, pr.Ex.Push(ctx, "block", os.Getpid()))
	var m *consumer.Mapping
	select {
	case m = <-got:
	case <-ctx.Done():
		t.Fatal("the push never arrived")
	}
	require.EqualValues(t, 512, m.Size())
	require.Equal(t, []byte(`{"block":1}`), m.Meta())
	out := make([]byte, m.Size())
	require.NoError(t, d.Dev.MemcpyDtoHAsync(0, out, m.Ptr(), d.Stream))
	require.True(t, exporttest.AllAre(out, 9))
	require.NoError(t, m.Release(ctx, d.Stream))
}
