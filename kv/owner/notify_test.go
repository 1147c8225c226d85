package owner_test

import (
	"math/rand/v2"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"golang.org/x/sys/unix"

	"github.com/cudapool/cudapool/internal/eventfdtest"
	"github.com/cudapool/cudapool/internal/testwait"
	"github.com/cudapool/cudapool/internal/unixfd"
	"github.com/cudapool/cudapool/kv"
	"github.com/cudapool/cudapool/kv/internal/kvwire"
	"github.com/cudapool/cudapool/kv/owner"
)

// notifier registers notifier id on r with descriptor fd (none if fd < 0).
func (r *raw) notifier(id uint32, fd int) {
	b, err := kvwire.Append(nil, kvwire.TypeNotifier, 0, kvwire.Notifier{ID: id})
	require.NoError(r.t, err)
	if fd < 0 {
		_, err = r.nc.Write(b)
	} else {
		err = unixfd.Send(r.nc, b, fd)
	}
	require.NoError(r.t, err)
}

// sealed expects the answers to the Seals of ids, in any order, each with visible
// pages.
func (r *raw) sealed(visible uint32, ids ...uint32) {
	want := map[uint32]bool{}
	for _, id := range ids {
		want[id] = true
	}
	for range ids {
		h, p, err := r.next()
		require.NoError(r.t, err)
		require.Equal(r.t, kvwire.TypeSealed, h.Type, "%v", kvwire.ParseError(h.Type, p))
		require.True(r.t, want[h.ID], "the answer to seal %d, not one of %v", h.ID, ids)
		delete(want, h.ID)
		m, err := kvwire.DecodeSealed(p)
		require.NoError(r.t, err)
		require.Equal(r.t, kvwire.Sealed{Visible: visible}, m, "seal %d", h.ID)
	}
}

// matched matches hashes and returns the read lease of the run it found (none:
// nothing), releasing it at once.
func (r *raw) matched(id uint32, hashes ...kv.Hash) []uint32 {
	r.send(kvwire.AppendMatch(nil, id, hashes))
	h, p, err := r.next()
	require.NoError(r.t, err)
	require.Equal(r.t, kvwire.TypeMatched, h.Type, "%v", kvwire.ParseError(h.Type, p))
	l, err := kvwire.DecodeLease(h.Type, p, nil)
	require.NoError(r.t, err)
	if l.ID != 0 {
		r.send(kvwire.AppendRelease(nil, id, kvwire.Now, []uint64{l.ID}))
		h, p, err := r.next()
		require.NoError(r.t, err)
		require.Equal(r.t, kvwire.TypeReleased, h.Type, "%v", kvwire.ParseError(h.Type, p))
	}
	return l.Pages
}

// Seals settle through their notifiers, each stream in its order and the streams
// independently: seals waiting on three notifiers (three points each), counted one
// stream at a time in a seeded order, become visible exactly as their stream's count
// reaches them (answered, with the wait flag, then) and not before; the owner has
// one notifier waiting per stream with a seal pending.
func TestSealsSettleThroughTheirNotifiersInOrder(t *testing.T) {
	o, dir := listen(t, small)
	r := dialRaw(t, dir)
	r.hello()
	const streams, points = 3, 3
	seed := uint64(29)
	t.Logf("seed %d", seed)
	rng := rand.New(rand.NewPCG(seed, 6))
	fds := make([]int, streams)
	hash := func(s, p int) kv.Hash { return kv.Hash{byte(s + 1), byte(p + 1)} }
	id := func(s, p int) uint32 { return uint32(100 + 10*s + p) }
	for s := range fds {
		fds[s] = eventfdtest.New(t)
		r.notifier(uint32(s+1), fds[s])
	}
	for s := range streams {
		for p := range points {
			l := r.alloc(2, 1)
			r.send(kvwire.AppendSeal(nil, id(s, p), true, l, kvwire.Point{Notifier: uint32(s + 1), Target: uint64(p + 1)}, []kv.Hash{hash(s, p)}))
		}
	}
	assert.Equal(t, streams, o.Pace().Waiting, "one notifier waiting per stream")
	reached := make([]int, streams)
	for left := streams * points; left > 0; {
		s := rng.IntN(streams)
		if reached[s] == points {
			continue
		}
		n := 1 + rng.IntN(points-reached[s])
		eventfdtest.Add(t, fds[s], uint64(n))
		var ids []uint32
		for p := reached[s]; p < reached[s]+n; p++ {
			ids = append(ids, id(s, p))
		}
		r.sealed(1, ids...)
		reached[s] += n
		left -= n
		for s := range streams {
			for p := range points {
				pages := r.matched(3, hash(s, p))
				assert.Equal(t, p < reached[s], len(pages) == 1, "stream %d point %d with %d counted", s, p, reached[s])
			}
		}
	}
	assert.Zero(t, o.Pace().Waiting, "nothing pending")
	assert.Equal(t, streams*points, o.Stats().Devices[0].Sealed)
}

// A release's pages are not reused before its point: a write lease of every page
// released behind a point leaves them settling; an Alloc then waits for them, and is
// answered, with those pages, only once the notifier has counted the point.
func TestReleasedPagesWaitForTheirPoint(t *testing.T) {
	o, r, _ := listenPages(t, 4)
	fd := eventfdtest.New(t)
	r.notifier(7, fd)
	l := r.alloc(2, 4)
	r.send(kvwire.AppendRelease(nil, 3, kvwire.Point{Notifier: 7, Target: 1}, []uint64{l}))
	h, _, err := r.next()
	require.NoError(t, err)
	require.Equal(t, kvwire.TypeReleased, h.Type)
	assert.Equal(t, 4, o.Stats().Devices[0].Settling, "the released pages settle until their point")
	r.send(kvwire.AppendU32(nil, kvwire.TypeAlloc, 4, 1))
	require.Eventually(t, func() bool { return o.Pace().AllocWaits == 1 }, testwait.Bound, time.Millisecond, "the Alloc to wait for the settling pages")
	assert.Equal(t, 4, o.Stats().Devices[0].Settling, "still settling: the point was not counted")
	eventfdtest.Add(t, fd, 1)
	h, p, err := r.next()
	require.NoError(t, err)
	require.Equal(t, kvwire.TypeLeased, h.Type, "%v", kvwire.ParseError(h.Type, p))
	assert.Equal(t, uint32(4), h.ID)
	assert.Zero(t, o.Stats().Devices[0].Settling)
}

// A replica that names a notifier it never registered is refused and keeps its lease;
// one that names a target its stream never reaches (whatever it counts short of it)
// holds only its own pages: another replica is served with the rest, and sees nothing
// of them. (Its pages come back when its process exits: TestWriterKilledPublishesNothing
// in kv/replica.)
func TestBogusPointsHoldOnlyTheirOwnPages(t *testing.T) {
	o, bad, dir := listenPages(t, 8)
	l := bad.alloc(2, 3)
	bad.send(kvwire.AppendSeal(nil, 3, false, l, kvwire.Point{Notifier: 77, Target: 1}, []kv.Hash{{1}, {2}, {3}}))
	err := bad.refused(3, kv.ErrGeometry, "a seal naming a notifier never registered")
	assert.ErrorContains(t, err, "never registered")
	fd := eventfdtest.New(t)
	bad.notifier(1, fd)
	bad.send(kvwire.AppendSeal(nil, 4, false, l, kvwire.Point{Notifier: 1, Target: 1 << 40}, []kv.Hash{{1}, {2}, {3}}))
	h, p, err := bad.next()
	require.NoError(t, err)
	require.Equal(t, kvwire.TypeSealed, h.Type, "the lease was kept by the refused seal: %v", kvwire.ParseError(h.Type, p))
	eventfdtest.Add(t, fd, 5)
	require.Eventually(t, func() bool { return o.Pace().Wakes == 1 }, testwait.Bound, time.Millisecond, "the owner to read the count")
	assert.Equal(t, 3, o.Stats().Devices[0].Sealing, "a target never reached")

	good := dialRaw(t, dir)
	good.hello()
	good.alloc(2, 5)
	good.send(kvwire.AppendU32(nil, kvwire.TypeAlloc, 3, 1))
	good.refused(3, kv.ErrNoSpace, "the bad replica's pages are its own")
	assert.Empty(t, good.matched(4, kv.Hash{1}), "nothing of the bad replica's is visible")
}

// A Notifier is refused with its connection closed when it comes without its
// eventfd, with a descriptor that is no eventfd, with an id registered already, of id
// 0, or when its descriptor came with another frame; a replica beside it is served on.
func TestMalformedNotifiersCloseTheirConnection(t *testing.T) {
	_, dir := listen(t, small)
	pipe := make([]int, 2)
	require.NoError(t, unix.Pipe2(pipe, unix.O_CLOEXEC))
	t.Cleanup(func() { unix.Close(pipe[0]); unix.Close(pipe[1]) })
	notifierFrame := func(id uint32) []byte {
		b, err := kvwire.Append(nil, kvwire.TypeNotifier, 0, kvwire.Notifier{ID: id})
		require.NoError(t, err)
		return b
	}
	for _, c := range []struct {
		name string
		send func(r *raw)
	}{
		{"no eventfd", func(r *raw) { r.notifier(1, -1) }},
		{"a pipe", func(r *raw) { r.notifier(1, pipe[1]) }},
		{"an id twice", func(r *raw) { r.notifier(1, eventfdtest.New(t)); r.notifier(1, eventfdtest.New(t)) }},
		{"id 0", func(r *raw) { require.NoError(t, unixfd.Send(r.nc, notifierFrame(0), eventfdtest.New(t))) }},
		{"two descriptors", func(r *raw) {
			require.NoError(t, unixfd.Send(r.nc, notifierFrame(1), eventfdtest.New(t), eventfdtest.New(t)))
		}},
		{"its eventfd with a Stats frame", func(r *raw) {
			b, err := kvwire.AppendEmpty(nil, kvwire.TypeStats, 5)
			require.NoError(t, err)
			require.NoError(t, unixfd.Send(r.nc, b, eventfdtest.New(t)))
			h, _, err := r.next()
			require.NoError(t, err)
			require.Equal(t, kvwire.TypeStatsReply, h.Type)
			r.notifier(1, -1)
		}},
	} {
		t.Run(c.name, func(t *testing.T) {
			r := dialRaw(t, dir)
			r.hello()
			c.send(r)
			r.closed(c.name)
			good := dialRaw(t, dir)
			good.hello()
			good.alloc(2, 1)
		})
	}
}

// The notifiers one connection registers are capped (WithMaxNotifiers): one past the
// cap is dropped, and a seal or release naming it is refused with kv.ErrLimit naming
// the cap; the notifiers registered before serve on.
func TestNotifiersAreCapped(t *testing.T) {
	_, dir := listenWith(t, owner.WithMaxNotifiers(2))
	r := dialRaw(t, dir)
	r.hello()
	fds := []int{eventfdtest.New(t), eventfdtest.New(t), eventfdtest.New(t)}
	for i, fd := range fds {
		r.notifier(uint32(i+1), fd)
	}
	l := r.alloc(2, 1)
	r.send(kvwire.AppendRelease(nil, 3, kvwire.Point{Notifier: 3, Target: 1}, []uint64{l}))
	assert.ErrorContains(t, r.refused(3, kv.ErrLimit, "the third notifier"), "MaxNotifiers")
	eventfdtest.Add(t, fds[1], 1)
	r.send(kvwire.AppendRelease(nil, 4, kvwire.Point{Notifier: 2, Target: 1}, []uint64{l}))
	h, _, err := r.next()
	require.NoError(t, err)
	assert.Equal(t, kvwire.TypeReleased, h.Type, "the second notifier serves")
}

// listenPages is listen of a slab of pages pages, with a replica connection to it.
func listenPages(t *testing.T, pages int) (*owner.Owner, *raw, string) {
	t.Helper()
	g := small
	g.Pages = pages
	o, dir := listen(t, g)
	require.Equal(t, pages, o.Stats().Devices[0].Free, "the slab's pages")
	r := dialRaw(t, dir)
	r.hello()
	return o, r, dir
}

// A replica of version 2 (IPC events, not notifiers) is refused, with a reason that
// names its version and the owner's.
func TestAnEventReplicaIsRefused(t *testing.T) {
	_, dir := listen(t, small)
	r := dialRaw(t, dir)
	err := r.helloRefused(kvwire.Hello{Version: 2, PID: 1}, kv.ErrRefused)
	assert.ErrorContains(t, err, "protocol version 2; this owner speaks 4")
	r.closed("after Refused")
}

// A replica of version 3, which imports the slab as pool segments from slab.sock, is
// refused naming both versions and what changed.
func TestASegmentReplicaIsRefused(t *testing.T) {
	_, dir := listen(t, small)
	r := dialRaw(t, dir)
	err := r.helloRefused(kvwire.Hello{Version: 3, PID: 1}, kv.ErrRefused)
	assert.ErrorContains(t, err, "protocol version 3 (the slab as pool segments on slab.sock); this owner speaks 4 (the slab's chunks on kv.sock, the VMM route)")
	r.closed("after Refused")
}

// helloRefused says Hello m and expects Refused, with an error wrapping want, which it
// returns.
func (r *raw) helloRefused(m kvwire.Hello, want error) error {
	r.send(kvwire.AppendHello(nil, 4, m))
	h, p, err := r.next()
	require.NoError(r.t, err)
	require.Equal(r.t, kvwire.TypeRefused, h.Type)
	err = kvwire.ParseError(h.Type, p)
	assert.ErrorIs(r.t, err, want)
	return err
}
