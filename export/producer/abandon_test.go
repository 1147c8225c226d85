package producer_test

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

	"github.com/cudapool/cudapool/export/internal/exporttest"
	"github.com/cudapool/cudapool/export/internal/wire"
	"github.com/cudapool/cudapool/export/producer"
	"github.com/cudapool/cudapool/internal/proctest"
	"github.com/cudapool/cudapool/internal/testwait"
	"github.com/cudapool/cudapool/pool"
)

// A consumer that stalls (stops reading) while the exporter writes to it may already
// have said Release and Bye: a send that fails then must not throw those away. The
// exporter reads what the peer sent before it gives up on the connection, so the
// lease ends at once instead of staying pinned until the consumer's process exits.
func TestReleaseAndByeBehindAFailedSendAreRead(t *testing.T) {
	pr := exporttest.NewProducer(t, nil, nil)
	pr.Publish(t, "a", 1<<20, 1)
	pr.Publish(t, "b", 1<<20, 2)
	pr.Publish(t, "c", 1<<20, 3)
	r := admitted(t, pr.Path)
	la, ok := r.Open(1, "a").(*wire.LeaseMsg)
	require.True(t, ok)
	lb, ok := r.Open(2, "b").(*wire.LeaseMsg)
	require.True(t, ok)
	// From here r reads nothing. Push until a push stalls on the full socket.
	ctx := exporttest.Ctx(t)
	stalled := make(chan error, 1)
	for stall := false; !stall; {
		done := make(chan error, 1)
		go func() {
			pctx, cancel := context.WithTimeout(ctx, 3*time.Second)
			defer cancel()
			done <- pr.Ex.Push(pctx, "c", os.Getpid()) // r is this process's one peer
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
	// the Bye wait in the socket until a send fails: the push's, when its context ends,
	// if it holds the connection's writes; else (a loaded host, where the push had not
	// begun to write within its second) the Release's answer's, at the exporter's
	// write bound (10 s). Either way the exporter then reads them.
	r.Send(&wire.ReleaseMsg{ReqID: 3, LeaseID: la.LeaseID, Count: 1})
	r.Send(&wire.ReleaseMsg{ReqID: 4, LeaseID: lb.LeaseID, Count: 1})
	r.Send(&wire.ByeMsg{})
	require.Error(t, <-stalled, "the stalled push fails when its context ends")
	require.Eventually(t, func() bool { return len(pr.Ex.Peers()) == 0 }, testwait.Bound, time.Millisecond,
		"the peer's Release and Bye were read: it holds nothing and is gone, %+v", pr.Ex.Peers())
	assert.NotContains(t, pr.Log.String(), "held until its process exits")
	pr.CheckClean(t)
}

// A consumer process that retains imports and stops answering keeps them through a
// Close that runs out of time; once its process is killed they end and their memory
// goes back, as they do without the Close.
func TestRetentionsEndWhenAbandonedConsumerIsKilled(t *testing.T) {
	pr := exporttest.NewProducer(t, []pool.Option{pool.WithCache(64 << 20)}, []producer.ListenOption{producer.WithRetainedImports()})
	const n = 16
	var names []string
	var bufs []*pool.Buffer
	for i := range n {
		name := fmt.Sprintf("b%d", i)
		names = append(names, name)
		bufs = append(bufs, pr.Publish(t, name, 1<<20, 7))
	}
	c := proctest.Start(t, "consumer", "test", pr.Path, "0", strings.Join(names, ","), "7", "retain")
	c.Expect("retained")
	require.Equal(t, n, exporttest.PoolStats(t, pr.Pool).Retentions, "the consumer's retained imports")
	require.NoError(t, syscall.Kill(c.PID(), syscall.SIGSTOP)) // it answers no revoke now
	for i, b := range bufs {
		require.NoError(t, pr.Ex.Unpublish(names[i]))
		require.NoError(t, b.Free(pr.Stream))
	}
	require.NoError(t, pr.Pool.Trim()) // revokes: they wait for the stopped consumer
	ctx, cancel := context.WithTimeout(exporttest.Ctx(t), 100*time.Millisecond)
	defer cancel()
	require.ErrorIs(t, pr.Ex.Close(ctx), producer.ErrAbandoned, "Close of an exporter whose consumer retains imports")
	assert.Equal(t, n, exporttest.PoolStats(t, pr.Pool).Retentions, "retentions ended under a living consumer")
	c.Kill()
	c.Wait()
	exporttest.WaitFor(t, "the killed consumer's retentions to end", func() bool { return exporttest.PoolStats(t, pr.Pool).Retentions == 0 })
	require.NoError(t, pr.Pool.Trim())
	exporttest.WaitFor(t, "their memory to go back", func() bool {
		s := exporttest.PoolStats(t, pr.Pool)
		return s.UsedCurrent == 0 && s.CachedBytes == 0
	})
	pr.CheckClean(t)
}
