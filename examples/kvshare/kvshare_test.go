package main

import (
	"bytes"
	"context"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/cudapool/cudapool/cudart/choose"
	"github.com/cudapool/cudapool/cudart/cudarttest"
	"github.com/cudapool/cudapool/export"
	"github.com/cudapool/cudapool/export/discover"
	"github.com/cudapool/cudapool/internal/proctest"
)

// TestMain lets the launcher test re-execute this binary as "producer" and "consumer",
// the way kvshare re-executes itself.
func TestMain(m *testing.M) {
	if len(os.Args) > 1 && (os.Args[1] == "producer" || os.Args[1] == "consumer") {
		os.Exit(Run(LaunchCommand, os.Args[1:]))
	}
	os.Exit(proctest.TrapAnnounceDir(m)) // the tests announce in directories of their own
}

// smallShape is an 8 MiB cache: enough for several host chunks' worth of pattern checks
// to cross chunk boundaries, small enough for -race.
var smallShape = Shape{Layers: 32, Tokens: 64, Heads: 8, HeadDim: 128}

// hangGuard bounds waits that only a bug could make long.
const hangGuard = time.Minute

// producer runs Produce on its own software device, as a separate process would, and
// stops it at the end of the test, checking that it stopped cleanly and that its device
// saw no broken rule.
type producerSide struct {
	pub  Published
	dev  *cudarttest.Device
	stop context.CancelFunc
	done chan error
}

func startProducer(t *testing.T, seed uint64, notify func(string)) *producerSide {
	t.Helper()
	t.Setenv(discover.DirEnv, t.TempDir())
	ctx, cancel := context.WithCancel(context.Background())
	p := &producerSide{dev: cudarttest.New(), stop: cancel, done: make(chan error, 1)}
	ready := make(chan Published, 1)
	cfg := ProducerConfig{Socket: filepath.Join(t.TempDir(), "kv.sock"), Name: "kv", Shape: smallShape, Seed: seed, Notify: notify}
	go func() { p.done <- Produce(ctx, p.dev, cfg, func(pub Published) { ready <- pub }) }()
	select {
	case p.pub = <-ready:
	case err := <-p.done:
		require.Fail(t, "producer failed before publishing", "Produce returned %v", err)
	case <-time.After(hangGuard):
		require.Fail(t, "producer did not publish", "within %v", hangGuard)
	}
	t.Cleanup(func() {
		p.stop()
		assert.NoError(t, p.wait(t), "producer")
		assert.NoError(t, p.dev.Err(), "producer's device saw broken rules")
	})
	return p
}

// wait returns what Produce returned, once; later calls return nil.
func (p *producerSide) wait(t *testing.T) error {
	select {
	case err, ok := <-p.done:
		if ok {
			close(p.done)
		}
		return err
	case <-time.After(hangGuard):
		require.Fail(t, "producer did not stop", "within %v", hangGuard)
		return nil
	}
}

// consume runs Consume on a software device of its own, as a separate process would, and
// checks that its device saw no broken rule.
func consume(t *testing.T, ctx context.Context, p *producerSide, cfg ConsumerConfig) (Result, error) {
	dev := cudarttest.New()
	defer func() { assert.NoError(t, dev.Err(), "consumer's device saw broken rules") }()
	cfg.Socket, cfg.Name = p.pub.Socket, p.pub.Name
	if cfg.Reps == 0 {
		cfg.Reps = 1
	}
	return Consume(ctx, dev, cfg)
}

// leases returns the leases the producer's pool holds now, asking as poolstat does.
func (p *producerSide) leases(t *testing.T) int {
	t.Helper()
	st, err := discover.QueryState(context.Background(), p.pub.Socket)
	require.NoError(t, err)
	n := 0
	for _, ps := range st.Pools {
		n += ps.ActiveLeases
	}
	return n
}

func TestShare(t *testing.T) {
	p := startProducer(t, 1, nil)
	require.Equal(t, smallShape.Bytes(), p.pub.Size, "published bytes")
	results := make([]Result, 3)
	errs := make([]error, 3)
	var wg sync.WaitGroup
	for i := range results {
		// Consumers on both devices: device 1 reads device 0's pool as a peer.
		wg.Go(func() {
			results[i], errs[i] = consume(t, context.Background(), p, ConsumerConfig{Device: i % 2, Seed: 1, Reps: 2})
		})
	}
	wg.Wait()
	for i, r := range results {
		if !assert.NoError(t, errs[i], "consumer %d", i) {
			continue
		}
		assert.Equal(t, p.pub.Checksum, r.Checksum, "consumer %d: %+v; producer published %+v", i, r, p.pub)
		assert.Equal(t, p.pub.Size, r.Size, "consumer %d: %+v; producer published %+v", i, r, p.pub)
		assert.Equal(t, i%2, r.Device, "consumer %d: %+v; producer published %+v", i, r, p.pub)
		assert.Positive(t, r.ImportRead, "consumer %d measured nothing: %+v", i, r)
		assert.Positive(t, r.LocalCopy, "consumer %d measured nothing: %+v", i, r)
	}
	assert.Zero(t, p.leases(t), "leases still held after every consumer returned")
}

func TestWrongPatternIsCaught(t *testing.T) {
	p := startProducer(t, 1, nil)
	_, err := consume(t, context.Background(), p, ConsumerConfig{Seed: 2})
	require.ErrorContains(t, err, "differ from the pattern, the first at byte offset 0", "consumer with another seed: want every word to differ")
	assert.Zero(t, p.leases(t), "leases a failed consumer left")
}

func TestUnknownName(t *testing.T) {
	p := startProducer(t, 1, nil)
	p.pub.Name = "no-such-cache"
	_, err := consume(t, context.Background(), p, ConsumerConfig{Seed: 1})
	require.ErrorIs(t, err, export.ErrUnknownName, "opening an unpublished name")
}

func TestConsumerInterrupted(t *testing.T) {
	p := startProducer(t, 1, nil)
	ctx, cancel := context.WithCancel(context.Background())
	held := 0
	_, err := consume(t, ctx, p, ConsumerConfig{Seed: 1, Hold: func(ctx context.Context) error {
		held = p.leases(t)
		cancel() // Ctrl-C while the mapping is held
		return ctx.Err()
	}})
	require.ErrorIs(t, err, context.Canceled, "interrupted consumer")
	assert.Equal(t, 1, held, "leases the producer counted while the mapping was held")
	assert.Zero(t, p.leases(t), "leases the interrupted consumer left")
}

func TestProducerStopsWhileHeld(t *testing.T) {
	notes := make(chan string, 1)
	p := startProducer(t, 1, func(s string) { notes <- s })
	_, err := consume(t, context.Background(), p, ConsumerConfig{Seed: 1, Hold: func(ctx context.Context) error {
		p.stop() // Ctrl-C on the producer while this consumer holds the cache
		select {
		case note := <-notes:
			assert.Contains(t, note, "waiting", "the stopping producer should say it waits for 1 lease")
			assert.Contains(t, note, "release 1 lease", "the stopping producer should say it waits for 1 lease")
		case <-time.After(hangGuard):
			assert.Fail(t, "the producer never said it waits for the held lease", "within %v", hangGuard)
		}
		return nil
	}})
	require.NoError(t, err, "consumer")
	// Cleanup checks the rest: the producer stopped cleanly once released, and neither
	// device saw the cache freed while it was still mapped.
}

func TestLaunch(t *testing.T) {
	t.Setenv(discover.DirEnv, t.TempDir())
	// The runtime kvshare would pick: the software device here, the GPUs on a GPU host.
	picked, err := choose.Runtime(choose.Auto)
	require.NoError(t, err)
	var out, errOut bytes.Buffer
	code := LaunchCommand(context.Background(), []string{"-consumers", "3", "-tokens", "64", "-reps", "1"}, nil, &out, &errOut)
	require.Equal(t, 0, code, "kvshare's exit\nstdout:\n%s\nstderr:\n%s", &out, &errOut)
	lines := strings.Split(strings.TrimSpace(out.String()), "\n")
	assert.Equal(t, "kvshare: "+picked.Why, lines[0], "first line")
	rows := 0
	for _, l := range lines {
		if strings.HasSuffix(l, " ok") {
			rows++
		}
	}
	assert.Equal(t, 3, rows, "want 3 good rows and a closing line:\n%s", &out)
	assert.Contains(t, lines[len(lines)-1], "3 consumers read the producer's 8.0 MiB and checked every byte", "want 3 good rows and a closing line:\n%s", &out)
	if !picked.OnGPU {
		assert.Contains(t, out.String(), "not meaningful on the software device", "the software device's timings are not the GPU's:\n%s", &out)
	}
	entries, _ := os.ReadDir(os.Getenv(discover.DirEnv))
	assert.Empty(t, entries, "kvshare left files behind")
}

func TestLaunchOneConsumer(t *testing.T) {
	t.Setenv(discover.DirEnv, t.TempDir())
	var out, errOut bytes.Buffer
	code := LaunchCommand(context.Background(), []string{"-consumers", "1", "-tokens", "64", "-reps", "1"}, nil, &out, &errOut)
	require.Equal(t, 0, code, "kvshare's exit\nstdout:\n%s\nstderr:\n%s", &out, &errOut)
	assert.NotContains(t, out.String(), "1 consumers", "grammar:\n%s", &out)
	assert.Contains(t, out.String(), "1 consumer maps it instead", "grammar:\n%s", &out)
	assert.Contains(t, out.String(), "1 consumer read the producer's", "grammar:\n%s", &out)
}

func TestCacheSentence(t *testing.T) {
	// The software device's default is small; the sentence says what a GPU gets with
	// the same flags, and nothing when the flags fix every dimension.
	assert.Equal(t, "a 64 MiB KV cache (small for the software device; a GPU gets 4.0 GiB)", cacheSentence(Shape{}, false))
	assert.Equal(t, "a 32 MiB KV cache (small for the software device; a GPU gets 2.0 GiB)", cacheSentence(Shape{Heads: 4}, false))
	assert.Equal(t, "a 4.0 MiB KV cache", cacheSentence(Shape{Tokens: 64, Heads: 4}, false))
	assert.Equal(t, "a 4.0 GiB KV cache", cacheSentence(Shape{}, true))
}

func TestLaunchInterrupted(t *testing.T) {
	t.Setenv(discover.DirEnv, t.TempDir())
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	testHookPublished = cancel // Ctrl-C once the producer serves the cache
	defer func() { testHookPublished = func() {} }()
	var out, errOut bytes.Buffer
	code := LaunchCommand(ctx, []string{"-tokens", "64"}, nil, &out, &errOut)
	assert.Equal(t, ExitInterrupted, code, "interrupted kvshare's exit\nstdout:\n%s\nstderr:\n%s", &out, &errOut)
	assert.Contains(t, out.String(), "interrupted; the producer and the consumers stopped", "stderr:\n%s", &errOut)
	entries, _ := os.ReadDir(os.Getenv(discover.DirEnv))
	assert.Empty(t, entries, "the interrupted run left files behind")
}

func TestLaunchBadUsage(t *testing.T) {
	for _, args := range [][]string{{"-consumers", "-1"}, {"-reps", "0"}, {"extra"}, {"-no-such-flag"}} {
		var out, errOut bytes.Buffer
		code := LaunchCommand(context.Background(), args, nil, &out, &errOut)
		assert.Equal(t, 2, code, "kvshare %q's exit", args)
	}
	// A count given as 0 is as wrong as one given as -5, and the message names the flag
	// given; left out, each has its default.
	for _, args := range [][]string{
		{"-consumers", "0"}, {"-consumers", "-5"}, {"-reps", "0"}, {"-tokens", "0"}, {"-tokens", "-5"},
		{"-layers", "0"}, {"-heads", "0"}, {"-head-dim", "-1"},
	} {
		var out, errOut bytes.Buffer
		code := LaunchCommand(context.Background(), args, nil, &out, &errOut)
		assert.Equal(t, 2, code, "kvshare %q's exit", args)
		assert.Contains(t, errOut.String(), "flag "+args[0]+": must be positive", "kvshare %q names its flag", args)
		assert.Equal(t, 1, strings.Count(errOut.String(), " must be"), "kvshare %q names only the flag given: %s", args, &errOut)
	}
	var out, errOut bytes.Buffer
	code := LaunchCommand(context.Background(), []string{"-runtime", "tpu"}, nil, &out, &errOut)
	assert.Equal(t, 1, code, "kvshare -runtime tpu's exit: %s", &errOut)
	assert.Contains(t, errOut.String(), "unknown runtime preference")
}
