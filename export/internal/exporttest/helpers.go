package exporttest

import (
	"bytes"
	"context"
	"github.com/cudapool/cudapool/internal/testlog"
	"io"
	"log/slog"
	"os"
	"path/filepath"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/cudapool/cudapool/cudart"
	"github.com/cudapool/cudapool/cudart/cudarttest"
	"github.com/cudapool/cudapool/export/consumer"
	"github.com/cudapool/cudapool/export/producer"
	"github.com/cudapool/cudapool/pool"
)

// HangGuard bounds every blocking call of a test. It only ends a test that hangs; no
// test depends on it passing.
const HangGuard = 60 * time.Second

// Ended is a context that has ended already: a call given it must not wait.
func Ended() context.Context {
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	return ctx
}

func Ctx(t testing.TB) context.Context {
	ctx, cancel := context.WithTimeout(context.Background(), HangGuard)
	t.Cleanup(cancel)
	return ctx
}

// ShortDir is a fresh directory with a short path: a Unix socket path must fit in
// 108 bytes, which t.TempDir() under a long test name does not promise.
func ShortDir(t testing.TB) string {
	t.Helper()
	dir, err := os.MkdirTemp("", "cpx")
	require.NoError(t, err)
	t.Cleanup(func() { _ = os.RemoveAll(dir) }) // cleanup: what is tested is above
	return dir
}

// LogBuffer collects log records for a test to check, safe for concurrent writers.
type LogBuffer = testlog.Buffer

var DiscardLogger = slog.New(slog.NewTextHandler(io.Discard, nil))

// Side is one simulated process: a software device and a stream on device dev.
type Side struct {
	Dev    *cudarttest.Device
	Ord    int
	Stream cudart.Stream
}

func NewSide(t testing.TB, ord int, opts ...cudarttest.Option) *Side {
	t.Helper()
	d := cudarttest.ForTest(t, opts...) // logs the seed if the test fails
	s, err := d.StreamCreate(ord, cudart.StreamNonBlocking)
	require.NoError(t, err)
	return &Side{Dev: d, Ord: ord, Stream: s}
}

// CheckClean fails the test if the side's device saw a rule broken.
func (s *Side) CheckClean(t testing.TB) {
	t.Helper()
	require.NoError(t, s.Dev.Err(), "software device saw violations")
}

// Producer is an exporter with a pool, in its own simulated process.
type Producer struct {
	*Side
	Pool *pool.Pool
	Ex   *producer.Exporter
	Path string
	Log  *LogBuffer
}

func NewProducer(t testing.TB, poolOpts []pool.Option, exOpts []producer.ListenOption, devOpts ...cudarttest.Option) *Producer {
	t.Helper()
	return NewProducerOn(t, nil, poolOpts, exOpts, devOpts...)
}

// NewProducerOn is NewProducer whose pool and exporter call the runtime wrap makes of
// the software device (the device itself when wrap is nil), for tests that watch or
// steer the calls.
func NewProducerOn(t testing.TB, wrap func(cudart.Runtime) cudart.Runtime, poolOpts []pool.Option, exOpts []producer.ListenOption, devOpts ...cudarttest.Option) *Producer {
	t.Helper()
	s := NewSide(t, 0, devOpts...)
	var rt cudart.Runtime = s.Dev
	if wrap != nil {
		rt = wrap(rt)
	}
	p, err := pool.New(rt, 0, poolOpts...)
	require.NoError(t, err)
	lb := &LogBuffer{}
	path := filepath.Join(ShortDir(t), "x.sock")
	ex, err := producer.Listen(path, rt, append([]producer.ListenOption{producer.WithoutAnnounce(), producer.WithLogger(lb.Logger())}, exOpts...)...)
	require.NoError(t, err)
	pr := &Producer{Side: s, Pool: p, Ex: ex, Path: path, Log: lb}
	t.Cleanup(func() {
		// Tests close what they check; this only cleans up after a failure, without
		// waiting for consumers that will never release.
		_ = ex.Close(Ended())                 // cleanup: what is tested is above
		_, _ = p.Close(Ended(), pool.Force()) // cleanup: what is tested is above
	})
	return pr
}

// Publish allocates size bytes, fills them with fill on the producer's stream and
// publishes them under name.
func (pr *Producer) Publish(t testing.TB, name string, size uint64, fill byte) *pool.Buffer {
	t.Helper()
	ctx := Ctx(t)
	b, err := pr.Pool.Alloc(ctx, size, pr.Stream)
	require.NoError(t, err)
	require.NoError(t, pr.Dev.MemsetAsync(pr.Ord, b.Ptr(), fill, size, pr.Stream))
	require.NoError(t, pr.Ex.Publish(ctx, name, b, pr.Stream))
	return b
}

// Consumer is an importer in its own simulated process.
type Consumer struct {
	*Side
	Imp *consumer.Importer
}

func NewConsumer(t testing.TB, path string, ord int, opts ...consumer.DialOption) *Consumer {
	t.Helper()
	s := NewSide(t, ord)
	imp, err := consumer.Dial(Ctx(t), path, s.Dev, ord, append([]consumer.DialOption{consumer.WithLogger(DiscardLogger)}, opts...)...)
	require.NoError(t, err)
	t.Cleanup(func() { _ = imp.Close(context.Background()) }) // cleanup: what is tested is above
	return &Consumer{Side: s, Imp: imp}
}

// Read copies a mapping's bytes to the host on the consumer's stream.
func (c *Consumer) Read(t testing.TB, m *consumer.Mapping) []byte {
	t.Helper()
	out := make([]byte, m.Size())
	require.NoError(t, c.Dev.MemcpyDtoHAsync(c.Ord, out, m.Ptr(), c.Stream))
	return out
}

// AllAre reports whether every byte of b is v.
func AllAre(b []byte, v byte) bool {
	return len(b) > 0 && bytes.Count(b, []byte{v}) == len(b)
}

// WaitFor polls cond until it holds. The polling is a hang guard's loop, not a timing
// assumption: the test fails only if cond never holds within HangGuard.
func WaitFor(t testing.TB, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(HangGuard)
	for !cond() {
		require.False(t, time.Now().After(deadline), "gave up waiting for %s", what)
		time.Sleep(time.Millisecond)
	}
}
