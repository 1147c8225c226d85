package owner_test

import (
	"fmt"
	"net"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/cudapool/cudapool/cudart/cudarttest"
	"github.com/cudapool/cudapool/internal/proctest"
	"github.com/cudapool/cudapool/internal/testwait"
	"github.com/cudapool/cudapool/kv"
	"github.com/cudapool/cudapool/kv/internal/index"
	"github.com/cudapool/cudapool/kv/internal/kvwire"
	"github.com/cudapool/cudapool/kv/owner"
	"github.com/cudapool/cudapool/kv/replica"
)

// kept is a keeper and the page server over its slabs, both in this process: the
// page server is restarted as kvpoold's SIGKILL and start would (the index as its
// death leaves it, IndexNow; Close; the index put back; Listen again on the
// directory), and the keeper keeps the slabs and the host tiers' memory throughout.
// Every replica is this process, alive throughout, or a writer child of it.
type kept struct {
	t    *testing.T
	dir  string
	opts []owner.Option
	o    *owner.Owner
}

// keep starts a keeper of small and a page server over it, with an index and opts.
func keep(t *testing.T, opts ...owner.Option) *kept {
	t.Helper()
	dir, err := os.MkdirTemp("", "kvr")
	require.NoError(t, err)
	t.Cleanup(func() { os.RemoveAll(dir) })
	kdev := cudarttest.ForTest(t)
	kp, err := owner.Keep(dir, kdev, small)
	require.NoError(t, err)
	t.Cleanup(func() { assert.NoError(t, kp.Close(bound(t))) })
	k := &kept{t: t, dir: dir, opts: append([]owner.Option{owner.WithKeeper(nil),
		owner.WithIndex(filepath.Join(dir, owner.IndexFile))}, opts...)}
	k.start()
	return k
}

// start starts a page server over the keeper's slabs and returns what it took back.
func (k *kept) start() owner.Recovery {
	k.t.Helper()
	dev := cudarttest.ForTest(k.t)
	o, err := owner.Listen(k.dir, dev, small, k.opts...)
	require.NoError(k.t, err)
	k.o = o
	k.t.Cleanup(func() {
		if k.o == o {
			assert.NoError(k.t, o.Close(bound(k.t)))
		}
	})
	return o.Recovery()
}

// restart ends the page server as its process's death would, for the index and the
// replicas, and starts another.
func (k *kept) restart() owner.Recovery {
	k.t.Helper()
	b, err := owner.IndexNow(bound(k.t), k.o)
	require.NoError(k.t, err)
	require.NoError(k.t, k.o.Close(bound(k.t))) // it journals the connections' ends, which a death would not
	require.NoError(k.t, os.WriteFile(filepath.Join(k.dir, owner.IndexFile), b, 0o600))
	return k.start()
}

// windowWaits returns a channel that gets a value each time a request begins to wait
// for the reattach window, until the test ends.
func windowWaits(t *testing.T) <-chan struct{} {
	ch := make(chan struct{}, 16)
	t.Cleanup(owner.OnWindowWait(func() { ch <- struct{}{} }))
	return ch
}

// served makes a round trip on r: its admission is over, its attach in the index
// (the Welcome comes before).
func (r *raw) served() {
	r.send(kvwire.AppendEmpty(nil, kvwire.TypeStats, 2))
	h, _, err := r.next()
	require.NoError(r.t, err)
	require.Equal(r.t, kvwire.TypeStatsReply, h.Type)
}

// allocPages leases n pages on r and returns the lease's id and pages.
func (r *raw) allocPages(id uint32, n uint32) (uint64, []uint32) {
	r.send(kvwire.AppendU32(nil, kvwire.TypeAlloc, id, n))
	h, p, err := r.next()
	require.NoError(r.t, err)
	require.Equal(r.t, kvwire.TypeLeased, h.Type, "%v", kvwire.ParseError(h.Type, p))
	l, err := kvwire.DecodeLease(h.Type, p, nil)
	require.NoError(r.t, err)
	return l.ID, l.Pages
}

// chain is n hashes of seed, distinct from every other seed's.
func chain(seed byte, n int) []kv.Hash {
	hs := make([]kv.Hash, n)
	for i := range hs {
		hs[i] = kv.Hash{0xc4, seed, byte(i)}
	}
	return hs
}

// sealChain seals n fresh pages under chain(seed, n) through r (no bytes written: only
// the page table is looked at), visible when it returns.
func sealChain(t *testing.T, r *replica.Replica, seed byte, n int) {
	t.Helper()
	w, err := r.Alloc(bound(t), n)
	require.NoError(t, err)
	res, err := r.Seal(bound(t), w, chain(seed, n), 0, replica.WaitVisible())
	require.NoError(t, err)
	require.Equal(t, n, res.Visible)
}

// A Match that restores pages from the host tier waits for the reattach window, as an
// Alloc does: the pages of a write lease held across the restart are not taken before
// its writer re-declares it. (Before, the restore took them at once, and the writer's
// queued writes landed on pages another replica read.)
func TestRestoreWaitsForTheReattachWindow(t *testing.T) {
	k := keep(t, owner.WithHostBytes(128*owner.HostPageBytes(small)))
	a, err := replica.Dial(bound(t), k.dir, cudarttest.ForTest(t), 0)
	require.NoError(t, err)
	for seed := range byte(4) { // the slab's 64 pages; the 16 least recent are copied ahead
		sealChain(t, a, seed, 16)
		require.NoError(t, k.o.WaitSpills(bound(t)))
	}
	require.NoError(t, a.Close(bound(t))) // gone: the writer alone is awaited after the restart
	require.Eventually(t, func() bool { return len(k.o.Stats().Replicas) == 0 }, testwait.Bound, time.Millisecond, "the closed replica's connection to end")
	w := dialRaw(t, k.dir)
	w.hello()
	lease, pages := w.allocPages(2, 16) // evicts chain 0, whose host copies stay
	require.Equal(t, 16, k.o.Stats().Devices[0].Host.Sealed-k.o.Stats().Devices[0].Host.Twins, "chain 0 is in the host tier alone")

	waits := windowWaits(t)
	rec := k.restart()
	require.Equal(t, 1, rec.Replicas, "the writer is awaited: %v", rec)
	require.Equal(t, kv.RestartStats{Epoch: 2, Adopted: true, Keeper: os.Getpid(), Restored: 48, Replicas: 1, Awaiting: 1, Kept: 16}, *k.o.Stats().Restart,
		"Stats says what Recovery says")
	require.Equal(t, 1, rec.HostTiersKept)
	w = dialRaw(t, k.dir)
	w.hello()

	m, err := replica.Dial(bound(t), k.dir, cudarttest.ForTest(t), 0)
	require.NoError(t, err)
	t.Cleanup(func() { m.Close(bound(t)) })
	type result struct {
		l   *replica.Lease
		err error
	}
	matched := make(chan result, 1)
	go func() {
		l, err := m.Match(bound(t), chain(0, 16))
		matched <- result{l, err}
	}()
	var got result
	select {
	case <-waits: // the restore waits; the writer's re-declaration ends the window
		status, why := w.reattach(3, kvwire.Reattach{Lease: lease, Write: true, Pages: pages})
		assert.Equal(t, kvwire.ReattachKept, status, "the write lease: %s", why)
		status, _ = w.reattach(4, kvwire.Reattach{})
		assert.Equal(t, kvwire.ReattachKept, status)
		got = testwait.Recv(t, matched, "the match, once the window has ended")
	case got = <-matched:
		status, why := w.reattach(3, kvwire.Reattach{Lease: lease, Write: true, Pages: pages})
		assert.Equal(t, kvwire.ReattachKept, status, "the write lease, re-declared after a restore that did not wait: %s", why)
	}
	require.NoError(t, got.err)
	require.Len(t, got.l.Pages(), 16, "chain 0 is restored from the host tier")
	for _, p := range got.l.Pages() {
		assert.False(t, slices.Contains(pages, p), "the restore took page %d of the write lease %v held across the restart", p, pages)
	}
}

// writer is a replica process of raw frames on the page socket of dir (args[0]),
// driven by lines, each answered by one line:
//
//	alloc N           lease N pages for writing: "leased ID P,P,..."
//	reattach ID P,..  on a new connection, re-declare write lease ID of pages P and
//	                  end the list: "status S why"
//	bye               say Bye (the leases held end) and close: "bye"
func writer(args []string) int {
	var nc *net.UnixConn
	rd := kvwire.NewReader()
	ask := func(b []byte, err error) (kvwire.Header, []byte, error) {
		if err != nil {
			return kvwire.Header{}, nil, err
		}
		if _, err := nc.Write(b); err != nil {
			return kvwire.Header{}, nil, err
		}
		for { // past the slab's chunks: a plain read drops their descriptors
			h, p, err := rd.Next(nc)
			if err != nil || h.Type != kvwire.TypeGrow {
				return h, p, err
			}
		}
	}
	dial := func() error {
		var err error
		if nc, err = net.DialUnix("unix", nil, &net.UnixAddr{Name: filepath.Join(args[0], owner.PageSocket), Net: "unix"}); err != nil {
			return err
		}
		rd = kvwire.NewReader()
		h, p, err := ask(kvwire.AppendHello(nil, 1, kvwire.Hello{Version: kvwire.Version, PID: uint32(os.Getpid())}))
		if err == nil && h.Type != kvwire.TypeWelcome {
			err = kvwire.ParseError(h.Type, p)
		}
		return err
	}
	for line := range proctest.Commands() {
		f := strings.Fields(line)
		var err error
		switch f[0] {
		case "alloc":
			n, _ := strconv.Atoi(f[1])
			if err = dial(); err != nil {
				break
			}
			var h kvwire.Header
			var p []byte
			if h, p, err = ask(kvwire.AppendU32(nil, kvwire.TypeAlloc, 2, uint32(n))); err != nil {
				break
			}
			var l kvwire.Lease
			if l, err = kvwire.DecodeLease(h.Type, p, nil); err != nil {
				err = kvwire.ParseError(h.Type, p)
				break
			}
			fmt.Println("leased", l.ID, joinPages(l.Pages))
		case "reattach":
			id, _ := strconv.ParseUint(f[1], 10, 64)
			if err = dial(); err != nil {
				break
			}
			var h kvwire.Header
			var p []byte
			if h, p, err = ask(kvwire.AppendReattach(nil, 3, kvwire.Reattach{Lease: id, Write: true, Pages: splitPages(f[2])})); err != nil {
				break
			}
			pr := kvwire.NewParser(h.Type, p)
			status, why := pr.U32(), pr.Text()
			if _, _, err = ask(kvwire.AppendReattach(nil, 4, kvwire.Reattach{})); err != nil {
				break
			}
			fmt.Println("status", status, why)
		case "bye":
			b, _ := kvwire.AppendEmpty(nil, kvwire.TypeBye, 0)
			if _, err = nc.Write(b); err == nil {
				_, _, _ = rd.Next(nc) // the owner closes the connection once its releases settled: an EOF
			}
			fmt.Println("bye")
		}
		if err != nil {
			fmt.Println("error:", err)
			return 1
		}
	}
	return 0
}

func joinPages(ps []uint32) string {
	s := make([]string, len(ps))
	for i, p := range ps {
		s[i] = strconv.Itoa(int(p))
	}
	return strings.Join(s, ",")
}

func splitPages(s string) []uint32 {
	var ps []uint32
	for _, f := range strings.Split(s, ",") {
		p, _ := strconv.Atoi(f)
		ps = append(ps, uint32(p))
	}
	return ps
}

// startWriter starts a writer process on dir that leases n pages, and returns it with
// its lease's id and pages.
func startWriter(t *testing.T, dir string, n int) (*proctest.Child, uint64, []uint32) {
	t.Helper()
	w := proctest.Start(t, "writer", dir)
	w.Send(fmt.Sprintf("alloc %d", n))
	f := strings.Fields(w.Next())
	require.Len(t, f, 3, "the writer's lease: %v", f)
	id, err := strconv.ParseUint(f[1], 10, 64)
	require.NoError(t, err)
	return w, id, splitPages(f[2])
}

// awaited waits until the owner awaits no replica of before its restart.
func awaited(t *testing.T, o *owner.Owner) {
	t.Helper()
	require.Eventually(t, func() bool { return o.Stats().Restart.Awaiting == 0 }, testwait.Bound, time.Millisecond, "the reattach window to end")
}

// No page of a write lease from before a restart is handed to anyone else while the
// process it was granted to lives, the reattach grace over or not: a writer that
// re-declares it late keeps it (its pages were never reused), another process cannot
// take it, and the pages come back when the writer exits, whether it re-declared the
// lease (then its connection's) or not. (Before,
// once the grace was over the pages were allocated again, and the late writer's
// Reattach was answered as the pages happened to be.)
func TestWriteLeasesOfBeforeStayTheirWritersWhileTheyLive(t *testing.T) {
	k := keep(t, owner.WithReattachGrace(time.Nanosecond))
	late, lateID, latePages := startWriter(t, k.dir, 16)
	dies, _, diesPages := startWriter(t, k.dir, 8)
	k.restart()
	awaited(t, k.o) // the grace is over
	require.Equal(t, 24, k.o.Stats().Restart.Kept, "the writers' pages are kept for them")

	r, err := replica.Dial(bound(t), k.dir, cudarttest.ForTest(t), 0)
	require.NoError(t, err)
	t.Cleanup(func() { r.Close(bound(t)) })
	all, err := r.Alloc(bound(t), small.Pages-24)
	require.NoError(t, err, "the pages no writer holds")
	for _, p := range all.Pages() {
		require.False(t, slices.Contains(latePages, p) || slices.Contains(diesPages, p), "page %d of a write lease of a live writer was allocated again", p)
	}
	_, err = r.Alloc(bound(t), 1)
	require.ErrorIs(t, err, kv.ErrNoSpace, "the writers' pages are theirs")
	assert.ErrorContains(t, err, "24 kept for the writers of before the restart")

	forger := dialRaw(t, k.dir)
	forger.hello()
	status, why := forger.reattach(2, kvwire.Reattach{Lease: lateID, Write: true, Pages: latePages})
	assert.Equal(t, kvwire.ReattachLost, status, "another process's write lease")
	assert.Contains(t, why, "granted to another process")

	late.Send(fmt.Sprintf("reattach %d %s", lateID, joinPages(latePages)))
	late.Expect(fmt.Sprintf("status %d ", kvwire.ReattachKept))
	dies.Kill()
	require.Eventually(t, func() bool { return k.o.Stats().Devices[0].Free == 8 }, testwait.Bound, time.Millisecond,
		"the pages of the writer that died to be free: %+v", k.o.Stats().Devices[0])
	late.Kill() // re-declared, the lease is its connection's: it ends with the process (issue 29: LEASED after its death)
	require.Eventually(t, func() bool { return k.o.Stats().Devices[0].Free == 24 }, testwait.Bound, time.Millisecond,
		"the pages of the lease re-declared to end with its process: %+v", k.o.Stats().Devices[0])
	require.NoError(t, r.Release(bound(t), all, 0))
}

// A writer whose replicas were given up at one restart's grace, and whose write leases
// are kept through the next restart, gets them back only one by one, or all at its
// exit: the end of one connection's list cannot vouch for its other replicas, which
// the index no longer counts. (Before, that one end freed the pages of every lease of
// the process, the other replica's too.)
func TestKeptPagesOfAProcessOfUnknownReplicasWaitForItsExit(t *testing.T) {
	k := keep(t, owner.WithReattachGrace(time.Nanosecond))
	w, first, firstPages := startWriter(t, k.dir, 4)
	w.Send("alloc 4") // a second connection of the same process
	require.Len(t, strings.Fields(w.Next()), 3)
	k.restart()
	awaited(t, k.o) // its two replicas are given up
	k.restart()
	require.Equal(t, 8, k.o.Stats().Restart.Kept)
	w.Send(fmt.Sprintf("reattach %d %s", first, joinPages(firstPages)))
	w.Expect(fmt.Sprintf("status %d ", kvwire.ReattachKept))
	assert.Equal(t, 4, k.o.Stats().Restart.Kept, "the other lease's pages, still kept for the writer")
	w.Kill()
	require.Eventually(t, func() bool { return k.o.Stats().Devices[0].Free == small.Pages }, testwait.Bound, time.Millisecond,
		"every page of the writer to be free once it has exited: %+v", k.o.Stats().Devices[0])
}

// A replica's end of its list of leases re-declared is answered once the index no
// longer awaits it as a replica of before: a restart right after the answer awaits
// only its new connection. (Before, the answer came while the record was queued; a
// SIGKILL then left the index awaiting both, and the next restart waited for a ghost
// until the grace: cmd/kvpoold's TestTwoRestarts failed so, once in a loaded run.)
func TestEndOfListIsAnsweredOnceJournaled(t *testing.T) {
	k := keep(t)
	before := dialRaw(t, k.dir)
	before.hello()
	before.served()
	gt := newGate()
	t.Cleanup(owner.SetIndexOptions(index.BeforeWrite(gt.before)))
	require.Equal(t, 1, k.restart().Replicas)
	r := dialRaw(t, k.dir)
	r.hello()
	r.served()

	gt.close()
	waits := make(chan struct{}, 1)
	t.Cleanup(owner.OnJournaledWait(func() {
		select {
		case waits <- struct{}{}:
		default:
		}
	}))
	attached := make(chan int, 1)
	go func() {
		status, _ := r.reattach(3, kvwire.Reattach{})
		assert.Equal(t, kvwire.ReattachKept, status)
		st, err := index.Load(filepath.Join(k.dir, owner.IndexFile), shapeOf(small, 0))
		assert.NoError(t, err)
		attached <- len(st.Attached) // read at the answer, from the disk
	}()
	var n int
	select {
	case <-waits: // the answer waits for the index's writer, held: let it go
		gt.reopen()
		n = testwait.Recv(t, attached, "the end of the list answered")
	case n = <-attached: // answered with the writer held
		gt.reopen()
	}
	assert.Equal(t, 1, n, "the replicas the index awaits when the end of the list is answered")
}

// No page of a read lease from before a restart is evicted while the process it was
// granted to lives, the reattach grace over or not: every lease is journaled when
// granted, and the restarted owner holds the pages of a read lease not re-declared
// until its process re-declares it (then the lease is its connection's, kept), ends
// its lists without it, or exits. (Before, past the grace its pages were evictable,
// and a reader still reading them read what the next writer wrote.)
func TestReadLeasesOfBeforeStayTheirReadersWhileTheyLive(t *testing.T) {
	k := keep(t, owner.WithReattachGrace(time.Nanosecond))
	r, err := replica.Dial(bound(t), k.dir, cudarttest.ForTest(t), 0)
	require.NoError(t, err)
	sealChain(t, r, 1, 8)
	r.Close(bound(t))
	reader := dialRaw(t, k.dir)
	reader.hello()
	reader.send(kvwire.AppendMatch(nil, 2, chain(1, 8)))
	h, p, err := reader.next()
	require.NoError(t, err)
	require.Equal(t, kvwire.TypeMatched, h.Type, "%v", kvwire.ParseError(h.Type, p))
	l, err := kvwire.DecodeLease(h.Type, p, nil)
	require.NoError(t, err)
	require.Len(t, l.Pages, 8)

	k.restart()
	awaited(t, k.o) // the grace is over
	w, err := replica.Dial(bound(t), k.dir, cudarttest.ForTest(t), 0)
	require.NoError(t, err)
	t.Cleanup(func() { w.Close(bound(t)) })
	all, err := w.Alloc(bound(t), small.Pages-8) // every page but the read lease's
	require.NoError(t, err)
	for _, p := range all.Pages() {
		require.False(t, slices.Contains(l.Pages, p), "page %d of a read lease of a live reader was evicted and allocated", p)
	}
	_, err = w.Alloc(bound(t), 1)
	require.ErrorIs(t, err, kv.ErrNoSpace, "the reader's pages are its own")

	back := dialRaw(t, k.dir)
	back.hello()
	status, why := back.reattach(3, kvwire.Reattach{Lease: l.ID, Pages: l.Pages, Hashes: chain(1, 8)})
	require.Equal(t, kvwire.ReattachKept, status, "the read lease, re-declared past the grace: %s", why)
	st := k.o.Stats()
	assert.Equal(t, 8, st.Devices[0].Leased, "its pages are leased")
}
