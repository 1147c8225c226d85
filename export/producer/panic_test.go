package producer_test

import (
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/cudapool/cudapool/export/internal/exporttest"
	"github.com/cudapool/cudapool/export/internal/wire"
	"github.com/cudapool/cudapool/export/producer"
)

// A panic while serving one peer's request ends that peer's connection alone, as
// net/http does: it is logged with its stack, the peer is handled as one that hung
// up, and the exporter serves the others on.
func TestPanicEndsOnlyItsPeer(t *testing.T) {
	// Set first, so that it is cleared after the cleanups below, which end the peers.
	producer.SetFrameHook(t, func(m wire.Message) {
		if o, ok := m.(*wire.OpenMsg); ok && o.Name == "boom" {
			panic("producer test: a handler made to panic")
		}
	})
	pr := exporttest.NewProducer(t, nil, nil)
	pr.Publish(t, "a", 1<<20, 0x5a)
	bad := exporttest.NewConsumer(t, pr.Path, 0)
	good := exporttest.NewConsumer(t, pr.Path, 0)
	ctx := exporttest.Ctx(t)
	_, err := bad.Imp.Open(ctx, "boom", bad.Stream)
	require.Error(t, err, "the Open whose handling panicked")
	m, err := good.Imp.Open(ctx, "a", good.Stream)
	require.NoError(t, err, "the other peer is served on")
	require.True(t, exporttest.AllAre(good.Read(t, m), 0x5a))
	require.NoError(t, m.Release(ctx, good.Stream))
	again := exporttest.NewConsumer(t, pr.Path, 0)
	m, err = again.Imp.Open(ctx, "a", again.Stream)
	require.NoError(t, err, "a new peer is admitted")
	require.NoError(t, m.Release(ctx, again.Stream))
	assert.Contains(t, pr.Log.String(), "panic serving a connection", "the panic is logged")
	assert.Contains(t, pr.Log.String(), "panic_test.go", "with its stack")
}
