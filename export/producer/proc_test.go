package producer_test

import (
	"strings"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/cudapool/cudapool/export/internal/exporttest"
	"github.com/cudapool/cudapool/internal/proctest"
	"github.com/cudapool/cudapool/internal/testwait"
	"github.com/cudapool/cudapool/pool"
)

func TestMain(m *testing.M) { proctest.Main(m, exporttest.Roles) }

// Real processes, real sockets, real descriptors: a producer here and several
// consumers in child processes, on both devices, each checking every byte.
func TestProcessesShareBuffers(t *testing.T) {
	pr := exporttest.NewProducer(t, nil, nil)
	pr.Publish(t, "a", 1<<20, 0x0a)
	pr.Publish(t, "b", 3<<20, 0x0b)
	var kids []*proctest.Child
	for _, spec := range []struct{ dev, name, fill string }{{"0", "a", "10"}, {"1", "a", "10"}, {"1", "b", "11"}, {"0", "b", "11"}} {
		kids = append(kids, proctest.Start(t, "consumer", "test", pr.Path, spec.dev, spec.name, spec.fill, "release"))
	}
	for _, k := range kids {
		k.Expect("ok")
		k.Finish()
	}
	exporttest.WaitFor(t, "the consumers to leave", func() bool { return len(pr.Ex.Peers()) == 0 })
	n := pr.ActiveLeases(t)
	require.EqualValues(t, 0, n, "%d leases after every consumer released", n)
	pr.CheckClean(t)
}

// freeWaitingOnChild publishes a buffer, has a consumer child hold it, and frees it: the
// free waits for the child's lease. It returns the producer, its pool's figures from
// before the buffer, and the child.
func freeWaitingOnChild(t *testing.T) (*exporttest.Producer, pool.Stats, *proctest.Child) {
	t.Helper()
	pr := exporttest.NewProducer(t, nil, nil)
	before, _ := pr.Pool.Stats()
	b := pr.Publish(t, "a", 1<<20, 0x0a)
	k := proctest.Start(t, "consumer", "test", pr.Path, "1", "a", "10", "hold")
	k.Expect("holding")
	require.NoError(t, b.Free(pr.Stream))
	s, _ := pr.Pool.Stats()
	require.EqualValues(t, 1, s.ActiveLeases, "free of a leased buffer not deferred: %+v", s)
	require.EqualValues(t, 1, s.DeferredFrees, "free of a leased buffer not deferred: %+v", s)
	return pr, before, k
}

// SIGKILL a consumer mid-lease: its socket closes while it is still exiting; once it
// has exited, a zombie its parent (this test) has not reaped yet, the exporter ends its
// lease and the free the producer asked for meanwhile proceeds, never while the
// consumer might still map the buffer.
func TestProcessConsumerKilled(t *testing.T) {
	pr, before, k := freeWaitingOnChild(t)
	k.Kill()
	exporttest.WaitFor(t, "the killed consumer's lease to end", func() bool { return len(pr.Ex.Peers()) == 0 })
	exporttest.KilledBySIGKILL(t, k)
	pr.PoolBackTo(t, before)
	pr.CheckClean(t)
}

// A consumer that hangs up without Bye and lives on still maps what it holds: its
// lease, and the producer's free waiting on it, last until it is killed and has exited,
// and Close waits for that. (When the exporter ended leases as soon as a connection
// closed, this freed the buffer at the hang-up, and the software device saw memory
// freed while a live process had it imported: what a SIGKILLed consumer risks in the
// moment between its socket closing and its exit.)
func TestProcessLostConsumerKeepsLeasesUntilExit(t *testing.T) {
	pr, before, k := freeWaitingOnChild(t)
	k.Send("hang-up")
	k.Expect("hung up")
	exporttest.WaitFor(t, "the exporter to see the hang-up", func() bool {
		return len(pr.Ex.Peers()) == 0 || strings.Contains(pr.Log.String(), "held until its process exits")
	})
	s, _ := pr.Pool.Stats()
	require.EqualValues(t, 1, s.ActiveLeases, "after a live consumer hung up the pool shows %+v, want its lease held and the free waiting", s)
	require.EqualValues(t, 1, s.DeferredFrees, "after a live consumer hung up the pool shows %+v, want its lease held and the free waiting", s)
	pr.CheckClean(t)
	ps := pr.Ex.Peers()
	require.False(t, len(ps) != 1 || ps[0].PID != k.PID() || !ps[0].AwaitingExit || ps[0].Leases != 1, "peers %+v, want pid %d awaiting its exit with its lease", ps, k.PID())
	closed := make(chan error, 1)
	go func() { closed <- pr.Ex.Close(exporttest.Ctx(t)) }()
	k.Kill()
	require.NoError(t, testwait.Recv(t, closed, "Close to return"), "Close, want nil: the lease ended when the consumer exited")
	exporttest.KilledBySIGKILL(t, k)
	require.Contains(t, pr.Log.String(), "process exited; ending its leases", "the exit is not logged:\n%s", pr.Log.String())
	pr.PoolBackTo(t, before)
	pr.CheckClean(t)
}
