package export

import (
	"math/rand/v2"
	"testing"
)

// activeLeases reads the producer pool's lease count.
func (pr *producer) activeLeases(t testing.TB) int {
	t.Helper()
	s, err := pr.pool.Stats()
	if err != nil {
		t.Fatal(err)
	}
	return s.ActiveLeases
}

func TestStaleForeignAndForgedLeasesAreRefused(t *testing.T) {
	pr := newProducer(t, nil, nil)
	pr.publish(t, "buf", 1<<20, 1)
	a, b := admitted(t, pr.path), admitted(t, pr.path)

	l, ok := a.open(1, "buf").(*leaseMsg)
	if !ok {
		t.Fatal("open did not answer with a Lease")
	}
	if n := pr.activeLeases(t); n != 1 {
		t.Fatalf("%d active leases after one open, want 1", n)
	}

	wantError(t, b.release(2, l.LeaseID, 1), 2, ErrForeignLease)
	wantError(t, a.release(3, l.LeaseID^1<<63, 1), 3, ErrForgedLease)
	wantError(t, a.release(4, rand.Uint64(), 1), 4, ErrForgedLease)
	wantError(t, a.release(5, l.LeaseID, 2), 5, ErrBadRequest)
	if n := pr.activeLeases(t); n != 1 {
		t.Fatalf("refused releases changed the lease count to %d", n)
	}

	if m := a.release(6, l.LeaseID, 1); m.kind() != msgReleased {
		t.Fatalf("release answered %s", m.kind())
	}
	if n := pr.activeLeases(t); n != 0 {
		t.Fatalf("%d active leases after release, want 0", n)
	}
	wantError(t, a.release(7, l.LeaseID, 1), 7, ErrStaleLease) // replayed
	wantError(t, b.release(8, l.LeaseID, 1), 8, ErrForeignLease)

	// The connection survives every refusal.
	if _, ok := a.open(9, "buf").(*leaseMsg); !ok {
		t.Fatal("open after refusals did not answer with a Lease")
	}
	pr.checkClean(t)
}

func TestReopenOnOneConnectionGrantsTheSameLease(t *testing.T) {
	pr := newProducer(t, nil, nil)
	pr.publish(t, "buf", 1<<20, 1)
	a := admitted(t, pr.path)
	l1 := a.open(1, "buf").(*leaseMsg)
	l2 := a.open(2, "buf").(*leaseMsg)
	if l1.LeaseID != l2.LeaseID || l1.Record != l2.Record {
		t.Fatalf("second open got lease %#x, want the first's %#x", l2.LeaseID, l1.LeaseID)
	}
	if n := pr.activeLeases(t); n != 2 {
		t.Fatalf("%d pool leases for two grants, want 2", n)
	}
	if m := a.release(3, l1.LeaseID, 1); m.kind() != msgReleased {
		t.Fatalf("release answered %s", m.kind())
	}
	if n := pr.activeLeases(t); n != 1 {
		t.Fatalf("%d pool leases after one of two grants came back, want 1", n)
	}
	if m := a.release(4, l1.LeaseID, 1); m.kind() != msgReleased {
		t.Fatalf("release answered %s", m.kind())
	}
	wantError(t, a.release(5, l1.LeaseID, 1), 5, ErrStaleLease)
}

func TestFreedBufferIsNeverHandedOut(t *testing.T) {
	pr := newProducer(t, nil, nil)
	b := pr.publish(t, "buf", 1<<20, 1)
	if err := b.Free(pr.stream); err != nil {
		t.Fatal(err)
	}
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
	r.send(&helloMsg{Version: ProtocolVersion, PID: 1})
	if m := r.recv(); m.kind() != msgWelcome {
		t.Fatalf("handshake answered %s", m.kind())
	}
	wantError(t, r.open(1, "buf"), 1, ErrNoLeases)
}

// A violation must be seen: here the exporter is made to end a lease while the
// consumer still maps the buffer, and the producer then frees it.
func TestEndingALeaseEarlyIsCaught(t *testing.T) {
	pr := newProducer(t, nil, nil)
	b := pr.publish(t, "buf", 1<<20, 1)
	c := newConsumer(t, pr.path, 0)
	if _, err := c.imp.Open(testCtx(t), "buf", c.stream); err != nil {
		t.Fatal(err)
	}
	for _, p := range pr.ex.peerList() {
		p.mu.Lock()
		for _, g := range p.leases {
			for _, l := range g.grants {
				l.End(0) // the wrong order: the importer has not freed its import
			}
		}
		p.mu.Unlock()
	}
	b.Free(pr.stream)
	if err := pr.dev.Err(); err == nil {
		t.Fatal("freeing a buffer still imported went unnoticed")
	}
}
