package kv

import (
	"bytes"
	"context"
	"errors"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/cudapool/cudapool/cudart/choose"
	"github.com/cudapool/cudapool/cudart/cudarttest"
	"github.com/cudapool/cudapool/export"
)

// TestMain lets the launcher test re-execute this binary as "producer" and "consumer",
// the way kvshare re-executes itself.
func TestMain(m *testing.M) {
	if len(os.Args) > 1 && (os.Args[1] == "producer" || os.Args[1] == "consumer") {
		os.Exit(Run(LaunchCommand, os.Args[1:]))
	}
	os.Exit(m.Run())
}

// smallShape is an 8 MiB cache: enough for several host chunks' worth of pattern checks
// to cross chunk boundaries, small enough for -race.
var smallShape = Shape{Layers: 32, Tokens: 64, Heads: 8, HeadDim: 128}

// hangGuard bounds waits that only a bug could make long.
const hangGuard = time.Minute

// producer runs Produce on its own software device, as a separate process would, and
// stops it at the end of the test, checking that it stopped cleanly and that its device
// saw no broken rule.
type producer struct {
	pub  Published
	dev  *cudarttest.Device
	stop context.CancelFunc
	done chan error
}

func startProducer(t *testing.T, seed uint64, notify func(string)) *producer {
	t.Helper()
	t.Setenv(export.DirEnv, t.TempDir())
	ctx, cancel := context.WithCancel(context.Background())
	p := &producer{dev: cudarttest.New(), stop: cancel, done: make(chan error, 1)}
	ready := make(chan Published, 1)
	cfg := ProducerConfig{Socket: filepath.Join(t.TempDir(), "kv.sock"), Name: "kv", Shape: smallShape, Seed: seed, Notify: notify}
	go func() { p.done <- Produce(ctx, p.dev, cfg, func(pub Published) { ready <- pub }) }()
	select {
	case p.pub = <-ready:
	case err := <-p.done:
		t.Fatalf("producer failed before publishing: %v", err)
	case <-time.After(hangGuard):
		t.Fatal("producer did not publish")
	}
	t.Cleanup(func() {
		p.stop()
		if err := p.wait(t); err != nil {
			t.Errorf("producer: %v", err)
		}
		if err := p.dev.Err(); err != nil {
			t.Errorf("producer's device saw broken rules: %v", err)
		}
	})
	return p
}

// wait returns what Produce returned, once; later calls return nil.
func (p *producer) wait(t *testing.T) error {
	select {
	case err, ok := <-p.done:
		if ok {
			close(p.done)
		}
		return err
	case <-time.After(hangGuard):
		t.Fatal("producer did not stop")
		return nil
	}
}

// consume runs Consume on a software device of its own, as a separate process would, and
// checks that its device saw no broken rule.
func consume(t *testing.T, ctx context.Context, p *producer, cfg ConsumerConfig) (Result, error) {
	dev := cudarttest.New()
	defer func() {
		if err := dev.Err(); err != nil {
			t.Errorf("consumer's device saw broken rules: %v", err)
		}
	}()
	cfg.Socket, cfg.Name = p.pub.Socket, p.pub.Name
	if cfg.Reps == 0 {
		cfg.Reps = 1
	}
	return Consume(ctx, dev, cfg)
}

// leases returns the leases the producer's pool holds now, asking as poolstat does.
func (p *producer) leases(t *testing.T) int {
	t.Helper()
	st, err := export.QueryState(context.Background(), p.pub.Socket)
	if err != nil {
		t.Fatal(err)
	}
	n := 0
	for _, ps := range st.Pools {
		n += ps.ActiveLeases
	}
	return n
}

func TestShare(t *testing.T) {
	p := startProducer(t, 1, nil)
	if p.pub.Size != smallShape.Bytes() {
		t.Fatalf("published %d bytes, want %d", p.pub.Size, smallShape.Bytes())
	}
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
		if errs[i] != nil {
			t.Errorf("consumer %d: %v", i, errs[i])
			continue
		}
		if r.Checksum != p.pub.Checksum || r.Size != p.pub.Size || r.Device != i%2 {
			t.Errorf("consumer %d: %+v; producer published %+v", i, r, p.pub)
		}
		if r.ImportRead <= 0 || r.LocalCopy <= 0 {
			t.Errorf("consumer %d measured nothing: %+v", i, r)
		}
	}
	if n := p.leases(t); n != 0 {
		t.Errorf("%d leases still held after every consumer returned", n)
	}
}

func TestWrongPatternIsCaught(t *testing.T) {
	p := startProducer(t, 1, nil)
	_, err := consume(t, context.Background(), p, ConsumerConfig{Seed: 2})
	if err == nil || !strings.Contains(err.Error(), "differ from the pattern, the first at byte offset 0") {
		t.Fatalf("consumer with another seed: %v, want every word to differ", err)
	}
	if n := p.leases(t); n != 0 {
		t.Errorf("a failed consumer left %d leases", n)
	}
}

func TestUnknownName(t *testing.T) {
	p := startProducer(t, 1, nil)
	p.pub.Name = "no-such-cache"
	if _, err := consume(t, context.Background(), p, ConsumerConfig{Seed: 1}); !errors.Is(err, export.ErrUnknownName) {
		t.Fatalf("opening an unpublished name: %v, want ErrUnknownName", err)
	}
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
	if !errors.Is(err, context.Canceled) {
		t.Fatalf("interrupted consumer returned %v, want context.Canceled", err)
	}
	if held != 1 {
		t.Errorf("while holding the mapping the producer counted %d leases, want 1", held)
	}
	if n := p.leases(t); n != 0 {
		t.Errorf("the interrupted consumer left %d leases", n)
	}
}

func TestProducerStopsWhileHeld(t *testing.T) {
	notes := make(chan string, 1)
	p := startProducer(t, 1, func(s string) { notes <- s })
	_, err := consume(t, context.Background(), p, ConsumerConfig{Seed: 1, Hold: func(ctx context.Context) error {
		p.stop() // Ctrl-C on the producer while this consumer holds the cache
		select {
		case note := <-notes:
			if !strings.Contains(note, "waiting") || !strings.Contains(note, "release 1 lease") {
				t.Errorf("the stopping producer says %q, want that it waits for 1 lease", note)
			}
		case <-time.After(hangGuard):
			t.Error("the producer never said it waits for the held lease")
		}
		return nil
	}})
	if err != nil {
		t.Fatalf("consumer: %v", err)
	}
	// Cleanup checks the rest: the producer stopped cleanly once released, and neither
	// device saw the cache freed while it was still mapped.
}

func TestLaunch(t *testing.T) {
	t.Setenv(export.DirEnv, t.TempDir())
	// The runtime kvshare would pick: the software device here, the GPUs on a GPU host.
	picked, err := choose.Runtime(choose.Auto)
	why := picked.Why
	if err != nil {
		t.Fatal(err)
	}
	var out, errOut bytes.Buffer
	code := LaunchCommand(context.Background(), []string{"-consumers", "3", "-tokens", "64", "-reps", "1"}, nil, &out, &errOut)
	if code != 0 {
		t.Fatalf("kvshare exited %d\nstdout:\n%s\nstderr:\n%s", code, &out, &errOut)
	}
	lines := strings.Split(strings.TrimSpace(out.String()), "\n")
	if lines[0] != "kvshare: "+why {
		t.Errorf("first line %q, want %q", lines[0], "kvshare: "+why)
	}
	rows := 0
	for _, l := range lines {
		if strings.HasSuffix(l, " ok") {
			rows++
		}
	}
	if rows != 3 || !strings.Contains(lines[len(lines)-1], "3 consumers read the producer's 8.0 MiB and checked every byte") {
		t.Errorf("want 3 good rows and a closing line:\n%s", &out)
	}
	if entries, _ := os.ReadDir(os.Getenv(export.DirEnv)); len(entries) != 0 {
		t.Errorf("kvshare left %v behind", entries)
	}
}

func TestLaunchInterrupted(t *testing.T) {
	t.Setenv(export.DirEnv, t.TempDir())
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	testHookPublished = cancel // Ctrl-C once the producer serves the cache
	defer func() { testHookPublished = func() {} }()
	var out, errOut bytes.Buffer
	code := LaunchCommand(ctx, []string{"-tokens", "64"}, nil, &out, &errOut)
	if code != ExitInterrupted || !strings.Contains(out.String(), "interrupted; the producer and the consumers stopped") {
		t.Errorf("interrupted kvshare exited %d\nstdout:\n%s\nstderr:\n%s", code, &out, &errOut)
	}
	if entries, _ := os.ReadDir(os.Getenv(export.DirEnv)); len(entries) != 0 {
		t.Errorf("the interrupted run left %v behind", entries)
	}
}

func TestLaunchBadUsage(t *testing.T) {
	for _, args := range [][]string{{"-consumers", "-1"}, {"-reps", "0"}, {"extra"}, {"-no-such-flag"}} {
		var out, errOut bytes.Buffer
		if code := LaunchCommand(context.Background(), args, nil, &out, &errOut); code != 2 {
			t.Errorf("kvshare %q exited %d, want 2", args, code)
		}
	}
	var out, errOut bytes.Buffer
	if code := LaunchCommand(context.Background(), []string{"-runtime", "tpu"}, nil, &out, &errOut); code != 1 ||
		!strings.Contains(errOut.String(), "unknown runtime preference") {
		t.Errorf("kvshare -runtime tpu exited %d: %s", code, &errOut)
	}
}
