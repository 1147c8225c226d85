package producer

import (
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/cudapool/cudapool/export/internal/wire"
)

// A panic while serving one peer's request ends that peer's connection alone, as
// net/http does: it is logged with its stack, the peer is handled as one that hung
// up, and the exporter serves the others on.
func TestPanicEndsOnlyItsPeer(t *testing.T) {
	frameHook = func(m wire.Message) {
		if o, ok := m.(*wire.OpenMsg); ok && o.Name == "boom" {
			panic("producer test: a handler made to panic")
		}
	}
	t.Cleanup(func() { frameHook = nil }) // after the cleanups below, which end the peers
	pr := newProducer(t, nil, nil)
	pr.publish(t, "a", 1<<20, 0x5a)
	bad := newConsumer(t, pr.path, 0)
	good := newConsumer(t, pr.path, 0)
	ctx := testCtx(t)
	_, err := bad.imp.Open(ctx, "boom", bad.stream)
	require.Error(t, err, "the Open whose handling panicked")
	m, err := good.imp.Open(ctx, "a", good.stream)
	require.NoError(t, err, "the other peer is served on")
	require.True(t, allAre(good.read(t, m), 0x5a))
	require.NoError(t, m.Release(ctx, good.stream))
	again := newConsumer(t, pr.path, 0)
	m, err = again.imp.Open(ctx, "a", again.stream)
	require.NoError(t, err, "a new peer is admitted")
	require.NoError(t, m.Release(ctx, again.stream))
	assert.Contains(t, pr.log.String(), "panic serving a connection", "the panic is logged")
	assert.Contains(t, pr.log.String(), "panic_test.go", "with its stack")
}
