package producer

import (
	"context"
	"fmt"
	"os"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/cudapool/cudapool/export/internal/wire"
	"github.com/cudapool/cudapool/internal/proctest"
	"github.com/cudapool/cudapool/pool"
)

// Close whose context ends while a live consumer maps a buffer abandons it: nothing is
// freed under the reader, the error says what was left, and the buffer goes back to
// the pool once the consumer releases it. (Close used to end such leases, and the
// producer then freed memory a living process mapped.)
func TestCloseAbandonsWhatALiveConsumerMaps(t *testing.T) {
	pr := newProducer(t, nil, nil)
	before, err := pr.pool.Stats()
	require.NoError(t, err)
	b := pr.publish(t, "a", 1<<20, 0x42)
	c := newConsumer(t, pr.path, 0)
	ctx := testCtx(t)
	m, err := c.imp.Open(ctx, "a", c.stream)
	require.NoError(t, err)
	require.NoError(t, b.Free(pr.stream))

	short, cancel := context.WithTimeout(ctx, 20*time.Millisecond)
	defer cancel()
	err = pr.ex.Close(short)
	require.ErrorIs(t, err, context.DeadlineExceeded)
	assert.ErrorIs(t, err, ErrAbandoned)
	assert.Contains(t, err.Error(), "pid ")
	pr.checkClean(t)
	assert.True(t, allAre(c.read(t, m), 0x42), "the consumer still reads what it maps")
	s, err := pr.pool.Stats()
	require.NoError(t, err)
	assert.Equal(t, 1, s.ActiveLeases, "the lease is kept")
	assert.Equal(t, 1, s.DeferredFrees, "the free still waits for the consumer")

	require.NoError(t, m.Release(ctx, c.stream))
	require.Eventually(t, func() bool {
		s, _ := pr.pool.Stats()
		return s.ActiveLeases == 0 && s.DeferredFrees == 0
	}, 5*time.Second, time.Millisecond, "the release after Close frees the buffer")
	pr.poolBackTo(t, before)
	require.NoError(t, c.imp.Close(ctx))
	pr.checkClean(t)
	c.checkClean(t)
}

// A consumer that stalls (stops reading) while the exporter writes to it may already
// have said Release and Bye: a send that fails then must not throw those away. The
// exporter reads what the peer sent before it gives up on the connection, so the
// lease ends at once instead of staying pinned until the consumer's process exits.
func TestReleaseAndByeBehindAFailedSendAreRead(t *testing.T) {
	pr := newProducer(t, nil, nil)
	pr.publish(t, "a", 1<<20, 1)
	pr.publish(t, "b", 1<<20, 2)
	pr.publish(t, "c", 1<<20, 3)
	r := admitted(t, pr.path)
	la, ok := r.open(1, "a").(*wire.LeaseMsg)
	require.True(t, ok)
	lb, ok := r.open(2, "b").(*wire.LeaseMsg)
	require.True(t, ok)
	// From here r reads nothing. Push until a push stalls on the full socket.
	ctx := testCtx(t)
	stalled := make(chan error, 1)
	for stall := false; !stall; {
		done := make(chan error, 1)
		go func() {
			pctx, cancel := context.WithTimeout(ctx, 3*time.Second)
			defer cancel()
			done <- pr.ex.Push(pctx, "c", os.Getpid()) // r is this process's one peer
		}()
		select {
		case err := <-done:
			require.NoError(t, err)
		case <-time.After(time.Second):
			// A push that has not returned in a second waits on the full socket: a
			// push that merely ran slowly (a loaded host) returns in milliseconds.
			stall = true
			go func() { stalled <- <-done }()
		}
	}
	// The serve loop takes the first Release and blocks on its answer; the second and
	// the Bye wait in the socket until the push's context ends and its send fails.
	r.send(&wire.ReleaseMsg{ReqID: 3, LeaseID: la.LeaseID, Count: 1})
	r.send(&wire.ReleaseMsg{ReqID: 4, LeaseID: lb.LeaseID, Count: 1})
	r.send(&wire.ByeMsg{})
	require.Error(t, <-stalled, "the stalled push fails when its context ends")
	require.Eventually(t, func() bool { return len(pr.ex.Peers()) == 0 }, 5*time.Second, time.Millisecond,
		"the peer's Release and Bye were read: it holds nothing and is gone, %+v", pr.ex.Peers())
	assert.NotContains(t, pr.log.String(), "held until its process exits")
	pr.checkClean(t)
}

// A consumer process that retains imports and stops answering keeps them through a
// Close that runs out of time; once its process is killed they end and their memory
// goes back, as they do without the Close.
func TestRetentionsEndWhenAbandonedConsumerIsKilled(t *testing.T) {
	pr := newProducer(t, []pool.Option{pool.WithCache(64 << 20)}, []ListenOption{WithRetainedImports()})
	const n = 16
	var names []string
	var bufs []*pool.Buffer
	for i := range n {
		name := fmt.Sprintf("b%d", i)
		names = append(names, name)
		bufs = append(bufs, pr.publish(t, name, 1<<20, 7))
	}
	c := proctest.Start(t, "consumer", "test", pr.path, "0", strings.Join(names, ","), "7", "retain")
	c.Expect("retained")
	require.Equal(t, n, poolStats(t, pr.pool).Retentions, "the consumer's retained imports")
	require.NoError(t, syscall.Kill(c.PID(), syscall.SIGSTOP)) // it answers no revoke now
	for i, b := range bufs {
		require.NoError(t, pr.ex.Unpublish(names[i]))
		require.NoError(t, b.Free(pr.stream))
	}
	require.NoError(t, pr.pool.Trim()) // revokes: they wait for the stopped consumer
	ctx, cancel := context.WithTimeout(testCtx(t), 100*time.Millisecond)
	defer cancel()
	require.ErrorIs(t, pr.ex.Close(ctx), ErrAbandoned, "Close of an exporter whose consumer retains imports")
	assert.Equal(t, n, poolStats(t, pr.pool).Retentions, "retentions ended under a living consumer")
	c.Kill()
	c.Wait()
	waitFor(t, "the killed consumer's retentions to end", func() bool { return poolStats(t, pr.pool).Retentions == 0 })
	require.NoError(t, pr.pool.Trim())
	waitFor(t, "their memory to go back", func() bool {
		s := poolStats(t, pr.pool)
		return s.UsedCurrent == 0 && s.CachedBytes == 0
	})
	pr.checkClean(t)
}
