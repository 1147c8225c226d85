package owner

import (
	"context"
	"net"
	"os"
	"sync/atomic"

	"github.com/cudapool/cudapool/cudart"
	"github.com/cudapool/cudapool/kv"
	"github.com/cudapool/cudapool/kv/internal/index"
	"github.com/cudapool/cudapool/kv/internal/kvwire"
)

// SetWrapListener makes the next Listens wrap their page socket's listener with f,
// until the returned func undoes it.
func SetWrapListener(f func(net.Listener) net.Listener) (undo func()) {
	wrapListener = f
	return func() { wrapListener = nil }
}

// PanicOn makes every owner's handler panic on a request of type t, until the
// returned func undoes it.
func PanicOn(t kvwire.Type) (undo func()) {
	frameHook = func(got kvwire.Type) {
		if got == t {
			panic("kv/owner test: a handler made to panic")
		}
	}
	return func() { frameHook = nil }
}

// PanicLockedOn makes the next owner's handler of a request of type t panic while it
// holds the owner's lock, once, until the returned func undoes it.
func PanicLockedOn(t kvwire.Type) (undo func()) {
	var done atomic.Bool
	lockedHook = func(got kvwire.Type) {
		if got == t && !done.Swap(true) {
			panic("kv/owner test: a handler made to panic under the owner's lock")
		}
	}
	return func() { lockedHook = nil }
}

// SetIndexOptions adds opts to the options of every index the next Listens open,
// until the returned func undoes it.
func SetIndexOptions(opts ...index.Option) (undo func()) {
	indexOptions = opts
	return func() { indexOptions = nil }
}

// EncodeStats is the JSON of the Stats frame answering st.
var EncodeStats = encodeStats

// SlabStream is the owner's stream of device dev's slab: its set-up and the copies
// out of it.
func SlabStream(o *Owner, dev int) cudart.Stream { return o.byDev[dev].stream }

// OnJournaledWait makes every owner call f as a reply begins to wait for its records
// to be in the index, until the returned func undoes it.
func OnJournaledWait(f func()) (undo func()) {
	journaledHook.Store(&f)
	return func() { journaledHook.Store(nil) }
}

// IndexNow is what o's index file holds once every record queued so far is written:
// what its process's death would leave now. A test closes o, puts the bytes back and
// starts another owner, as a SIGKILL and a restart would.
func IndexNow(ctx context.Context, o *Owner) ([]byte, error) {
	if err := o.ix.Wait(ctx, o.ix.Queued()); err != nil {
		return nil, err
	}
	return os.ReadFile(o.opts.Index)
}

// OnWindowWait makes every owner call f when a request begins to wait for the
// reattach window, until the returned func undoes it.
func OnWindowWait(f func()) (undo func()) {
	windowHook = f
	return func() { windowHook = nil }
}

// SetTierPeerUID makes k see the peers of dir/tier.sock as uid.
func SetTierPeerUID(k *Keeper, uid uint32) { k.tiers.peerUID.Store(&uid) }

// HostTakes makes a host tier of len(pins) host pages over a slab of as many pages,
// host page i sealed, the twin of GPU page i, read by pins[i] restores, GPU page i
// leased by readers[i] replicas, host page 0 the least recent; and returns the host
// pages its take gives, one after another, until it has none.
func HostTakes(pins, readers []uint32) []uint32 {
	n := len(pins)
	s := newSlab(0, n)
	t := &hostTier{s: s, pages: make([]hostPage, n), index: map[kv.Hash]uint32{}, head: none, tail: none, twin: make([]uint32, n), mark: none}
	s.tier = t
	for i := range n {
		s.free = s.free[:len(s.free)-1]
		s.pages[i].state, s.pages[i].hash, s.pages[i].readers = pageSealed, kv.Hash{byte(i + 1)}, readers[i]
		s.index[s.pages[i].hash] = uint32(i)
		t.pages[i] = hostPage{prev: none, next: none, gpu: none}
		t.seal(uint32(i), kv.Hash{byte(i + 1)}, uint32(i))
		t.pages[i].pins = pins[i]
	}
	var took []uint32
	for {
		p, ok := t.take()
		if !ok {
			return took
		}
		took = append(took, p)
	}
}
