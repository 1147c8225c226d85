package producer

import (
	"bytes"
	"context"
	"io"
	"log/slog"
	"os"
	"path/filepath"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/cudapool/cudapool/cudart"
	"github.com/cudapool/cudapool/cudart/cudarttest"
	"github.com/cudapool/cudapool/export/consumer"
	"github.com/cudapool/cudapool/pool"
)

// hangGuard bounds every blocking call of a test. It only ends a test that hangs; no
// test depends on it passing.
const hangGuard = 60 * time.Second

// ended is a context that has ended already: a call given it must not wait.
func ended() context.Context {
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	return ctx
}

func testCtx(t testing.TB) context.Context {
	ctx, cancel := context.WithTimeout(context.Background(), hangGuard)
	t.Cleanup(cancel)
	return ctx
}

// shortDir is a fresh directory with a short path: a Unix socket path must fit in
// 108 bytes, which t.TempDir() under a long test name does not promise.
func shortDir(t testing.TB) string {
	t.Helper()
	dir, err := os.MkdirTemp("", "cpx")
	require.NoError(t, err)
	t.Cleanup(func() { os.RemoveAll(dir) })
	return dir
}

// logBuffer collects log records for a test to check, safe for concurrent writers.
type logBuffer struct {
	mu  sync.Mutex
	buf bytes.Buffer
}

func (l *logBuffer) Write(p []byte) (int, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.buf.Write(p)
}

func (l *logBuffer) String() string {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.buf.String()
}

func (l *logBuffer) logger() *slog.Logger {
	return slog.New(slog.NewTextHandler(l, &slog.HandlerOptions{Level: slog.LevelDebug}))
}

var discardLogger = slog.New(slog.NewTextHandler(io.Discard, nil))

// side is one simulated process: a software device and a stream on device dev.
type side struct {
	dev    *cudarttest.Device
	ord    int
	stream cudart.Stream
}

func newSide(t testing.TB, ord int, opts ...cudarttest.Option) *side {
	t.Helper()
	d := cudarttest.ForTest(t, opts...) // logs the seed if the test fails
	s, err := d.StreamCreate(ord, cudart.StreamNonBlocking)
	require.NoError(t, err)
	return &side{dev: d, ord: ord, stream: s}
}

// checkClean fails the test if the side's device saw a rule broken.
func (s *side) checkClean(t testing.TB) {
	t.Helper()
	require.NoError(t, s.dev.Err(), "software device saw violations")
}

// producer is an exporter with a pool, in its own simulated process.
type producer struct {
	*side
	pool *pool.Pool
	ex   *Exporter
	path string
	log  *logBuffer
}

func newProducer(t testing.TB, poolOpts []pool.Option, exOpts []ListenOption, devOpts ...cudarttest.Option) *producer {
	t.Helper()
	return newProducerOn(t, nil, poolOpts, exOpts, devOpts...)
}

// newProducerOn is newProducer whose pool and exporter call the runtime wrap makes of
// the software device (the device itself when wrap is nil), for tests that watch or
// steer the calls.
func newProducerOn(t testing.TB, wrap func(cudart.Runtime) cudart.Runtime, poolOpts []pool.Option, exOpts []ListenOption, devOpts ...cudarttest.Option) *producer {
	t.Helper()
	s := newSide(t, 0, devOpts...)
	var rt cudart.Runtime = s.dev
	if wrap != nil {
		rt = wrap(rt)
	}
	p, err := pool.New(rt, 0, poolOpts...)
	require.NoError(t, err)
	lb := &logBuffer{}
	path := filepath.Join(shortDir(t), "x.sock")
	ex, err := Listen(path, rt, append([]ListenOption{WithoutAnnounce(), WithLogger(lb.logger())}, exOpts...)...)
	require.NoError(t, err)
	pr := &producer{side: s, pool: p, ex: ex, path: path, log: lb}
	t.Cleanup(func() {
		// Tests close what they check; this only cleans up after a failure, without
		// waiting for consumers that will never release.
		ex.Close(ended())
		p.Close(ended(), pool.Force())
	})
	return pr
}

// publish allocates size bytes, fills them with fill on the producer's stream and
// publishes them under name.
func (pr *producer) publish(t testing.TB, name string, size uint64, fill byte) *pool.Buffer {
	t.Helper()
	ctx := testCtx(t)
	b, err := pr.pool.Alloc(ctx, size, pr.stream)
	require.NoError(t, err)
	require.NoError(t, pr.dev.MemsetAsync(pr.ord, b.Ptr(), fill, size, pr.stream))
	require.NoError(t, pr.ex.Publish(ctx, name, b, pr.stream))
	return b
}

// consumer is an importer in its own simulated process.
type testConsumer struct {
	*side
	imp *consumer.Importer
}

func newConsumer(t testing.TB, path string, ord int, opts ...consumer.DialOption) *testConsumer {
	t.Helper()
	s := newSide(t, ord)
	imp, err := consumer.Dial(testCtx(t), path, s.dev, ord, append([]consumer.DialOption{consumer.WithLogger(discardLogger)}, opts...)...)
	require.NoError(t, err)
	t.Cleanup(func() { imp.Close(context.Background()) })
	return &testConsumer{side: s, imp: imp}
}

// read copies a mapping's bytes to the host on the consumer's stream.
func (c *testConsumer) read(t testing.TB, m *consumer.Mapping) []byte {
	t.Helper()
	out := make([]byte, m.Size())
	require.NoError(t, c.dev.MemcpyDtoHAsync(c.ord, out, m.Ptr(), c.stream))
	return out
}

// allAre reports whether every byte of b is v.
func allAre(b []byte, v byte) bool {
	return len(b) > 0 && bytes.Count(b, []byte{v}) == len(b)
}

// waitFor polls cond until it holds. The polling is a hang guard's loop, not a timing
// assumption: the test fails only if cond never holds within hangGuard.
func waitFor(t testing.TB, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(hangGuard)
	for !cond() {
		require.False(t, time.Now().After(deadline), "gave up waiting for %s", what)
		time.Sleep(time.Millisecond)
	}
}
