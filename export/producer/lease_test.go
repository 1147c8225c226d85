package producer_test

import (
	rand "math/rand/v2"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/cudapool/cudapool/cudart/cudarttest"
	"github.com/cudapool/cudapool/export"
	"github.com/cudapool/cudapool/export/internal/exporttest"
	"github.com/cudapool/cudapool/export/internal/wire"
)

func TestStaleLeasesAreRefusedSayingWhy(t *testing.T) {
	pr := exporttest.NewProducer(t, nil, nil)
	pr.Publish(t, "buf", 1<<20, 1)
	a, b := admitted(t, pr.Path), admitted(t, pr.Path)

	l, ok := a.Open(1, "buf").(*wire.LeaseMsg)
	require.True(t, ok, "open did not answer with a Lease")
	n := pr.ActiveLeases(t)
	require.EqualValues(t, 1, n, "%d active leases after one open, want 1", n)

	wantStale(t, b.Release(2, l.LeaseID, 1), 2, staleForeign)
	wantStale(t, a.Release(3, l.LeaseID^1<<63, 1), 3, staleForged)
	wantStale(t, a.Release(4, rand.Uint64(), 1), 4, staleForged)
	wantError(t, a.Release(5, l.LeaseID, 2), 5, export.ErrBadRequest)
	n = pr.ActiveLeases(t)
	require.EqualValues(t, 1, n, "refused releases changed the lease count to %d", n)

	m := a.Release(6, l.LeaseID, 1)
	require.EqualValues(t, wire.MsgReleased, m.Kind(), "release answered %s", m.Kind())
	n = pr.ActiveLeases(t)
	require.EqualValues(t, 0, n, "%d active leases after release, want 0", n)
	wantStale(t, a.Release(7, l.LeaseID, 1), 7, staleReleased) // replayed
	wantStale(t, b.Release(8, l.LeaseID, 1), 8, staleForeign)

	// The connection survives every refusal.
	_, ok = a.Open(9, "buf").(*wire.LeaseMsg)
	require.True(t, ok, "open after refusals did not answer with a Lease")
	pr.CheckClean(t)
}

func TestReopenOnOneConnectionGrantsTheSameLease(t *testing.T) {
	pr := exporttest.NewProducer(t, nil, nil)
	pr.Publish(t, "buf", 1<<20, 1)
	a := admitted(t, pr.Path)
	l1 := a.Open(1, "buf").(*wire.LeaseMsg)
	l2 := a.Open(2, "buf").(*wire.LeaseMsg)
	require.EqualValues(t, l2.LeaseID, l1.LeaseID, "second open got lease %#x, want the first's %#x", l2.LeaseID, l1.LeaseID)
	require.EqualValues(t, l2.Record, l1.Record, "second open got lease %#x, want the first's %#x", l2.LeaseID, l1.LeaseID)
	n := pr.ActiveLeases(t)
	require.EqualValues(t, 2, n, "%d pool leases for two grants, want 2", n)
	m := a.Release(3, l1.LeaseID, 1)
	require.EqualValues(t, wire.MsgReleased, m.Kind(), "release answered %s", m.Kind())
	n = pr.ActiveLeases(t)
	require.EqualValues(t, 1, n, "%d pool leases after one of two grants came back, want 1", n)
	m = a.Release(4, l1.LeaseID, 1)
	require.EqualValues(t, wire.MsgReleased, m.Kind(), "release answered %s", m.Kind())
	wantStale(t, a.Release(5, l1.LeaseID, 1), 5, staleReleased)
}

func TestFreedBufferIsNeverHandedOut(t *testing.T) {
	pr := exporttest.NewProducer(t, nil, nil)
	b := pr.Publish(t, "buf", 1<<20, 1)
	require.NoError(t, b.Free(pr.Stream))
	a := admitted(t, pr.Path)
	wantError(t, a.Open(1, "buf"), 1, export.ErrBufferGone)
	// Retired: the name is gone now.
	wantError(t, a.Open(2, "buf"), 2, export.ErrUnknownName)
	wantError(t, a.Open(3, "never"), 3, export.ErrUnknownName)
}

func TestStateOnlyConnectionCannotLease(t *testing.T) {
	pr := exporttest.NewProducer(t, nil, nil)
	pr.Publish(t, "buf", 1<<20, 1)
	r := exporttest.DialRaw(t, pr.Path)
	r.Send(&wire.HelloMsg{Version: export.ProtocolVersion, PID: 1})
	m := r.Recv()
	require.EqualValues(t, wire.MsgWelcome, m.Kind(), "handshake answered %s", m.Kind())
	wantError(t, r.Open(1, "buf"), 1, export.ErrNoLeases)
}

// A violation must be seen: here the exporter is made to end a lease while the
// consumer still maps the buffer, and the producer then frees it.
func TestEndingALeaseEarlyIsCaught(t *testing.T) {
	pr := exporttest.NewProducer(t, nil, nil)
	b := pr.Publish(t, "buf", 1<<20, 1)
	c := exporttest.NewConsumer(t, pr.Path, 0)
	_, err := c.Imp.Open(exporttest.Ctx(t), "buf", c.Stream)
	require.NoError(t, err)
	for _, p := range pr.Ex.PeerList() {
		p.EndGrantsEarly() // the wrong order: the importer has not freed its import
	}
	require.NoError(t, b.Free(pr.Stream))
	vs := pr.Dev.Violations()
	require.Len(t, vs, 1, "violations after freeing a buffer still imported: %v", vs)
	require.Equal(t, cudarttest.ViolationExporterFreedWhileImported, vs[0].Kind, "violation %v", vs[0])
}
