package exporttest

import (
	"context"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/cudapool/cudapool/cudart"
	"github.com/cudapool/cudapool/export/consumer"
	"github.com/cudapool/cudapool/export/producer"
	"github.com/cudapool/cudapool/internal/intercept"
	"github.com/cudapool/cudapool/pool"
)

// ImportCounter counts the calls that a retained import saves: imports and frees of
// pointers, and exports of them.
type ImportCounter struct{ *intercept.Runtime }

// Imports counts MemPoolImportPointer calls.
func (r ImportCounter) Imports() int64 { return r.On.MemPoolImportPointer.Calls() }

// Frees counts FreeAsync calls.
func (r ImportCounter) Frees() int64 { return r.On.FreeAsync.Calls() }

// Exports counts MemPoolExportPointer calls.
func (r ImportCounter) Exports() int64 { return r.On.MemPoolExportPointer.Calls() }

// RetainingPair is a producer whose pool caches and whose exporter lets consumers
// retain imports, and a consumer whose runtime counts imports and frees.
type RetainingPair struct {
	Pr      *Producer
	PrCalls *ImportCounter
	C       *Consumer
	CCalls  *ImportCounter
}

func NewRetainingPair(t *testing.T, exOpts ...producer.ListenOption) RetainingPair {
	t.Helper()
	var prCalls *ImportCounter
	wrap := func(rt cudart.Runtime) cudart.Runtime {
		prCalls = &ImportCounter{intercept.Wrap(rt)}
		return prCalls
	}
	pr := NewProducerOn(t, wrap, []pool.Option{pool.WithCache(64 << 20)}, exOpts)
	s := NewSide(t, 0)
	cCalls := &ImportCounter{intercept.Wrap(s.Dev)}
	imp, err := consumer.Dial(Ctx(t), pr.Path, cCalls, 0, consumer.WithLogger(DiscardLogger))
	require.NoError(t, err)
	t.Cleanup(func() { _ = imp.Close(context.Background()) }) // cleanup: what is tested is above
	return RetainingPair{Pr: pr, PrCalls: prCalls, C: &Consumer{Side: s, Imp: imp}, CCalls: cCalls}
}

// Cycle publishes a buffer filled with fill under name, has the consumer open it,
// check its bytes and release it, and has the producer unpublish and free it.
func (rp RetainingPair) Cycle(t *testing.T, name string, fill byte) *pool.Buffer {
	t.Helper()
	ctx := Ctx(t)
	b := rp.Pr.Publish(t, name, 2<<20, fill)
	m, err := rp.C.Imp.Open(ctx, name, rp.C.Stream)
	require.NoError(t, err)
	require.True(t, AllAre(rp.C.Read(t, m), fill), "the consumer did not read the bytes of this lease (%#x)", fill)
	require.NoError(t, m.Release(ctx, rp.C.Stream))
	require.NoError(t, rp.Pr.Ex.Unpublish(name))
	require.NoError(t, b.Free(rp.Pr.Stream))
	return b
}

func PoolStats(t *testing.T, p *pool.Pool) pool.Stats {
	t.Helper()
	s, err := p.Stats()
	require.NoError(t, err)
	return s
}
