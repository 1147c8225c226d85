package producer_test

import (
	"context"
	"errors"
	"fmt"
	rand "math/rand/v2"
	"net"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/cudapool/cudapool/export/discover"
	"github.com/cudapool/cudapool/export/internal/exporttest"
	"github.com/cudapool/cudapool/export/internal/wire"
	"github.com/cudapool/cudapool/export/producer"
	"github.com/cudapool/cudapool/internal/proctest"
	"github.com/cudapool/cudapool/internal/session"
)

// reliabilityReport collects the run's rows: what was done, and what came of it.
type reliabilityReport struct {
	mu   sync.Mutex
	rows [][2]string
}

func (r *reliabilityReport) add(t *testing.T, what, result string) {
	t.Logf("reliability: %s: %s", what, result)
	r.mu.Lock()
	defer r.mu.Unlock()
	r.rows = append(r.rows, [2]string{what, result})
}

func (r *reliabilityReport) markdown() string {
	var b strings.Builder
	b.WriteString("| what | result |\n|---|---|\n")
	for _, row := range r.rows {
		fmt.Fprintf(&b, "| %s | %s |\n", row[0], row[1])
	}
	return b.String()
}

func TestReliability(t *testing.T) {
	if os.Getenv("CUDAPOOL_RELIABILITY") != "1" {
		t.Skip("set CUDAPOOL_RELIABILITY=1 (scripts/reliability.sh) to run the reliability run")
	}
	r := &reliabilityReport{}
	t.Run("fd-exhaustion", func(t *testing.T) { reliabilityFDExhaustion(t, r) })
	t.Run("handshakes", func(t *testing.T) { reliabilityHandshakes(t, r) })
	t.Run("consumer-kills", func(t *testing.T) { reliabilityConsumerKills(t, r) })
	t.Run("producer-kills", func(t *testing.T) { reliabilityProducerKills(t, r) })
	t.Run("hostile-close", func(t *testing.T) { reliabilityHostileClose(t, r) })
	if path := os.Getenv("CUDAPOOL_RELIABILITY_REPORT"); path != "" {
		require.NoError(t, os.WriteFile(path, []byte(r.markdown()), 0o644))
	}
	t.Log("\n" + r.markdown())
}

// The exporter's process runs out of descriptors while another process keeps
// connecting; then descriptors come back. Connections made meanwhile wait in the
// backlog (none is admitted: there is no descriptor to accept them with), and the
// exporter accepts again within its backoff once descriptors are free.
func reliabilityFDExhaustion(t *testing.T, r *reliabilityReport) {
	pr := exporttest.NewProducer(t, nil, nil)
	pr.Publish(t, "a", 1<<20, 7)
	const attempts = 20
	dialer := proctest.Start(t, "dialer", pr.Path, strconv.Itoa(attempts), "100")
	dialer.Expect("ready")
	exporttest.LowerFDLimit(t, 64)
	release := exporttest.ExhaustFDs(t, 0)
	dialer.Send("go")
	var admitted, failed int
	_, err := fmt.Sscanf(dialer.Next(), "admitted %d failed %d", &admitted, &failed)
	require.NoError(t, err)
	freed := time.Now()
	release()
	var recovered time.Duration
	for {
		ctx, cancel := context.WithTimeout(context.Background(), time.Second)
		_, err := discover.QueryState(ctx, pr.Path, discover.WithLogger(exporttest.DiscardLogger))
		cancel()
		if err == nil {
			recovered = time.Since(freed)
			break
		}
		require.Less(t, time.Since(freed), 10*time.Second, "the exporter did not accept again: %v", err)
	}
	dialer.Send("go")
	var after int
	_, err = fmt.Sscanf(dialer.Next(), "admitted %d failed %d", &after, new(int))
	require.NoError(t, err)
	dialer.Finish()
	assert.Equal(t, attempts, after, "every handshake after the recovery is admitted")
	assert.Less(t, recovered, 2*session.AcceptBackoffMax, "recovery within the accept backoff")
	r.add(t, fmt.Sprintf("%d handshakes from another process while the exporter had no free descriptor (100 ms each)", attempts),
		fmt.Sprintf("%d admitted, %d timed out (waiting in the backlog)", admitted, failed))
	r.add(t, "descriptors freed: first handshake admitted after", recovered.Round(time.Millisecond).String())
	r.add(t, fmt.Sprintf("%d handshakes from the other process after recovery", attempts), fmt.Sprintf("%d admitted", after))
}

// Handshakes as fast as four connectors go, for a few seconds, with id spaces of
// 1024 connections (2^24-1 in production), so that the run crosses many of them: the
// rate must not drop past the first space, and leases of every space stay apart.
func reliabilityHandshakes(t *testing.T, r *reliabilityReport) {
	const space = 1024
	producer.SetConnIDLimit(t, space)
	// The handshakes below are one process's connections, closed one after another:
	// the exporter may not have seen the last ones end when the next are admitted, so
	// the per-process cap is set to the total's.
	pr := exporttest.NewProducer(t, nil, []producer.ListenOption{producer.WithConnLimit(0, 4096)})
	pr.Publish(t, "a", 1<<20, 1)
	first := admitted(t, pr.Path)
	l, ok := first.Open(1, "a").(*wire.LeaseMsg)
	require.True(t, ok)
	var count atomic.Int64
	var firstSpace time.Duration
	start := time.Now()
	deadline := start.Add(4 * time.Second)
	var wg sync.WaitGroup
	for range 4 {
		wg.Go(func() {
			for time.Now().Before(deadline) {
				nc, err := net.Dial("unix", pr.Path)
				if err != nil {
					t.Errorf("dial: %v", err)
					return
				}
				c := wire.NewConn(nc, true)
				err = c.Send(context.Background(), exporttest.LeasingHello(), -1)
				var m wire.Message
				if err == nil {
					m, _, err = c.Recv()
				}
				nc.Close()
				if err != nil || m.Kind() != wire.MsgWelcome {
					t.Errorf("handshake %d: %v %v", count.Load(), m, err)
					return
				}
				if count.Add(1) == space {
					firstSpace = time.Since(start)
				}
			}
		})
	}
	wg.Wait()
	total := time.Since(start)
	n := count.Load()
	require.Greater(t, n, int64(3*space), "the run crossed at least three id spaces")
	last := admitted(t, pr.Path)
	wantStale(t, last.Release(1, l.LeaseID, 1), 1, staleForeign)
	assert.Equal(t, wire.MsgReleased, first.Release(2, l.LeaseID, 1).Kind(), "a lease of the first id space is still its connection's")
	rateFirst := float64(space) / firstSpace.Seconds()
	rateAll := float64(n) / total.Seconds()
	assert.Greater(t, rateAll, rateFirst/2, "the rate held past the first id space")
	r.add(t, fmt.Sprintf("handshakes (4 connectors, %v, id spaces of %d)", total.Round(time.Millisecond), space),
		fmt.Sprintf("%d, %.0f/s overall, %.0f/s in the first space; %d id spaces crossed; a first-space lease still told foreign from its own", n, rateAll, rateFirst, n/space))
}

// Consumer processes are SIGKILLed at random moments (opening, holding) while the
// producer frees the buffer they hold: no byte is freed while a living process maps
// it, and every buffer goes back.
func reliabilityConsumerKills(t *testing.T, r *reliabilityReport) {
	pr := exporttest.NewProducer(t, nil, nil)
	before, err := pr.Pool.Stats()
	require.NoError(t, err)
	const rounds, perRound = 8, 4
	start := time.Now()
	for i := range rounds {
		name := fmt.Sprint("r", i)
		b := pr.Publish(t, name, 1<<20, byte(i+1))
		var kids []*proctest.Child
		for range perRound {
			kids = append(kids, proctest.Start(t, "consumer", "test", pr.Path, "0", name, strconv.Itoa(i+1), "hold"))
		}
		require.NoError(t, b.Free(pr.Stream))
		for _, k := range kids {
			time.Sleep(time.Duration(rand.IntN(20)) * time.Millisecond)
			k.Kill()
			k.Wait()
		}
		exporttest.WaitFor(t, "the killed consumers' leases to end", func() bool { return len(pr.Ex.Peers()) == 0 })
	}
	pr.PoolBackTo(t, before)
	violations := len(pr.Dev.Violations())
	assert.Zero(t, violations)
	r.add(t, fmt.Sprintf("%d consumer processes SIGKILLed at random (opening or holding) while the producer freed their buffer", rounds*perRound),
		fmt.Sprintf("bytes freed under a living reader: %d violations; %d buffers all back in the pool, no lease left (%v)", violations, rounds, time.Since(start).Round(time.Millisecond)))
}

// Producer processes are SIGKILLed under readers on both GPUs: readers on the
// producer's GPU go on reading the right bytes; readers on the other GPU are told and
// release without losing their context; no rule is broken on either side.
func reliabilityProducerKills(t *testing.T, r *reliabilityReport) {
	const rounds = 5
	var reads, wrong, told, lost, violations int
	var toldIn time.Duration
	for i := range rounds {
		path := filepath.Join(exporttest.ShortDir(t), "p.sock")
		fill := 100 + i
		k := proctest.Start(t, "producer", "test", path, "default", fmt.Sprintf("a=1048576:%d", fill))
		k.Expect("ready")
		owner, peer := exporttest.NewConsumer(t, path, 0), exporttest.NewConsumer(t, path, 1)
		ctx := exporttest.Ctx(t)
		mo, err := owner.Imp.Open(ctx, "a", owner.Stream)
		require.NoError(t, err)
		mp, err := peer.Imp.Open(ctx, "a", peer.Stream)
		require.NoError(t, err)
		time.Sleep(time.Duration(rand.IntN(10)) * time.Millisecond)
		killed := time.Now()
		exporttest.KillProducer(t, k)
		select {
		case <-mp.Context().Done():
			told++
			toldIn = max(toldIn, time.Since(killed))
		case <-time.After(exporttest.Promptly):
		}
		for range 10 {
			reads++
			if !exporttest.AllAre(owner.Read(t, mo), byte(fill)) {
				wrong++
			}
		}
		require.NoError(t, mo.Release(ctx, owner.Stream))
		require.NoError(t, mp.Release(ctx, peer.Stream))
		require.NoError(t, owner.Imp.Close(ctx))
		require.NoError(t, peer.Imp.Close(ctx))
		if peer.Dev.ContextLost() {
			lost++
		}
		violations += len(owner.Dev.Violations()) + len(peer.Dev.Violations())
	}
	assert.Zero(t, wrong)
	assert.Equal(t, rounds, told)
	assert.Zero(t, lost)
	assert.Zero(t, violations)
	r.add(t, fmt.Sprintf("%d producer processes SIGKILLed under a reader on their GPU and one on another", rounds),
		fmt.Sprintf("%d reads on the owner GPU after the kill, %d wrong; other-GPU readers told %d of %d (the slowest %v after the kill, reaping included), contexts lost %d; violations %d",
			reads, wrong, told, rounds, toldIn.Round(time.Microsecond), lost, violations))
}

// Close with peers that never said Hello and peers that hold leases, never release and
// stopped reading (their sockets full of pushes): it returns by its context, frees
// nothing under them, and says what it abandoned.
func reliabilityHostileClose(t *testing.T, r *reliabilityReport) {
	pr := exporttest.NewProducer(t, nil, nil)
	b := pr.Publish(t, "a", 1<<20, 1)
	const silent, stalled = 20, 10
	for range silent {
		nc, err := net.Dial("unix", pr.Path)
		require.NoError(t, err)
		t.Cleanup(func() { nc.Close() })
	}
	for range stalled {
		p := admitted(t, pr.Path)
		_, ok := p.Open(1, "a").(*wire.LeaseMsg)
		require.True(t, ok)
	}
	// They read nothing: fill their sockets with pushes until they stall.
	for i := range 2000 {
		ctx, cancel := context.WithTimeout(context.Background(), 20*time.Millisecond)
		err := pr.Ex.Push(ctx, "a", os.Getpid())
		cancel()
		if errors.Is(err, context.DeadlineExceeded) {
			t.Logf("a push stalled after %d", i)
			break
		}
	}
	require.NoError(t, b.Free(pr.Stream))
	const budget = 300 * time.Millisecond
	ctx, cancel := context.WithTimeout(context.Background(), budget)
	defer cancel()
	start := time.Now()
	err := pr.Ex.Close(ctx)
	took := time.Since(start)
	require.ErrorIs(t, err, producer.ErrAbandoned)
	assert.Less(t, took, budget+500*time.Millisecond, "Close returns by its context")
	s, _ := pr.Pool.Stats()
	pr.CheckClean(t)
	r.add(t, fmt.Sprintf("Close (ctx %v) with %d peers silent before Hello and %d holding leases, never releasing and not reading (sockets full)", budget, silent, stalled),
		fmt.Sprintf("returned in %v; the peers' %d grants abandoned, their buffer kept (%d free deferred), 0 bytes freed under them", took.Round(time.Millisecond), s.ActiveLeases, s.DeferredFrees))
}
