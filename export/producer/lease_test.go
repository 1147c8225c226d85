package producer

import (
	"math/rand/v2"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/cudapool/cudapool/cudart/cudarttest"
	"github.com/cudapool/cudapool/export/internal/wire"
)

// activeLeases reads the producer pool's lease count.
func (pr *producer) activeLeases(t testing.TB) int {
	t.Helper()
	s, err := pr.pool.Stats()
	require.NoError(t, err)
	return s.ActiveLeases
}

func TestStaleLeasesAreRefusedSayingWhy(t *testing.T) {
	pr := newProducer(t, nil, nil)
	pr.publish(t, "buf", 1<<20, 1)
	a, b := admitted(t, pr.path), admitted(t, pr.path)

	l, ok := a.open(1, "buf").(*wire.LeaseMsg)
	require.True(t, ok, "open did not answer with a Lease")
	n := pr.activeLeases(t)
	require.EqualValues(t, 1, n, "%d active leases after one open, want 1", n)

	wantStale(t, b.release(2, l.LeaseID, 1), 2, staleForeign)
	wantStale(t, a.release(3, l.LeaseID^1<<63, 1), 3, staleForged)
	wantStale(t, a.release(4, rand.Uint64(), 1), 4, staleForged)
	wantError(t, a.release(5, l.LeaseID, 2), 5, ErrBadRequest)
	n = pr.activeLeases(t)
	require.EqualValues(t, 1, n, "refused releases changed the lease count to %d", n)

	m := a.release(6, l.LeaseID, 1)
	require.EqualValues(t, wire.MsgReleased, m.Kind(), "release answered %s", m.Kind())
	n = pr.activeLeases(t)
	require.EqualValues(t, 0, n, "%d active leases after release, want 0", n)
	wantStale(t, a.release(7, l.LeaseID, 1), 7, staleReleased) // replayed
	wantStale(t, b.release(8, l.LeaseID, 1), 8, staleForeign)

	// The connection survives every refusal.
	_, ok = a.open(9, "buf").(*wire.LeaseMsg)
	require.True(t, ok, "open after refusals did not answer with a Lease")
	pr.checkClean(t)
}

func TestReopenOnOneConnectionGrantsTheSameLease(t *testing.T) {
	pr := newProducer(t, nil, nil)
	pr.publish(t, "buf", 1<<20, 1)
	a := admitted(t, pr.path)
	l1 := a.open(1, "buf").(*wire.LeaseMsg)
	l2 := a.open(2, "buf").(*wire.LeaseMsg)
	require.EqualValues(t, l2.LeaseID, l1.LeaseID, "second open got lease %#x, want the first's %#x", l2.LeaseID, l1.LeaseID)
	require.EqualValues(t, l2.Record, l1.Record, "second open got lease %#x, want the first's %#x", l2.LeaseID, l1.LeaseID)
	n := pr.activeLeases(t)
	require.EqualValues(t, 2, n, "%d pool leases for two grants, want 2", n)
	m := a.release(3, l1.LeaseID, 1)
	require.EqualValues(t, wire.MsgReleased, m.Kind(), "release answered %s", m.Kind())
	n = pr.activeLeases(t)
	require.EqualValues(t, 1, n, "%d pool leases after one of two grants came back, want 1", n)
	m = a.release(4, l1.LeaseID, 1)
	require.EqualValues(t, wire.MsgReleased, m.Kind(), "release answered %s", m.Kind())
	wantStale(t, a.release(5, l1.LeaseID, 1), 5, staleReleased)
}

func TestFreedBufferIsNeverHandedOut(t *testing.T) {
	pr := newProducer(t, nil, nil)
	b := pr.publish(t, "buf", 1<<20, 1)
	require.NoError(t, b.Free(pr.stream))
	a := admitted(t, pr.path)
	wantError(t, a.open(1, "buf"), 1, ErrBufferGone)
	// Retired: the name is gone now.
	wantError(t, a.open(2, "buf"), 2, ErrUnknownName)
	wantError(t, a.open(3, "never"), 3, ErrUnknownName)
}

func TestStateOnlyConnectionCannotLease(t *testing.T) {
	pr := newProducer(t, nil, nil)
	pr.publish(t, "buf", 1<<20, 1)
	r := dialRaw(t, pr.path)
	r.send(&wire.HelloMsg{Version: wire.ProtocolVersion, PID: 1})
	m := r.recv()
	require.EqualValues(t, wire.MsgWelcome, m.Kind(), "handshake answered %s", m.Kind())
	wantError(t, r.open(1, "buf"), 1, wire.ErrNoLeases)
}

// A violation must be seen: here the exporter is made to end a lease while the
// consumer still maps the buffer, and the producer then frees it.
func TestEndingALeaseEarlyIsCaught(t *testing.T) {
	pr := newProducer(t, nil, nil)
	b := pr.publish(t, "buf", 1<<20, 1)
	c := newConsumer(t, pr.path, 0)
	_, err := c.imp.Open(testCtx(t), "buf", c.stream)
	require.NoError(t, err)
	for _, p := range pr.ex.peerList() {
		p.mu.Lock()
		for _, g := range p.leases {
			for _, l := range g.grants {
				l.End(0) // the wrong order: the importer has not freed its import
			}
		}
		p.mu.Unlock()
	}
	require.NoError(t, b.Free(pr.stream))
	vs := pr.dev.Violations()
	require.Len(t, vs, 1, "violations after freeing a buffer still imported: %v", vs)
	require.Equal(t, cudarttest.ViolationExporterFreedWhileImported, vs[0].Kind, "violation %v", vs[0])
}
