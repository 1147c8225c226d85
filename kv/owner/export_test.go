package owner

import (
	"net"
	"sync/atomic"

	"github.com/cudapool/cudapool/cudart"
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

// EncodeStats is the JSON of the Stats frame answering st.
var EncodeStats = encodeStats

// SlabStream is the owner's stream of device dev's slab: its set-up and the copies
// out of it.
func SlabStream(o *Owner, dev int) cudart.Stream { return o.byDev[dev].stream }

// Crash stops o's index as its process's death would: the records buffered are lost
// and nothing more is written, so that Close then ends the connections without a
// detach in the index. The caller closes o after.
func Crash(o *Owner) {
	o.mu.Lock()
	defer o.mu.Unlock()
	if o.j != nil && o.j.f != nil {
		_ = o.j.f.Close()
		o.j.f, o.j.buf = nil, nil
	}
}

// OnWindowWait makes every owner call f when a request begins to wait for the
// reattach window, until the returned func undoes it.
func OnWindowWait(f func()) (undo func()) {
	windowHook = f
	return func() { windowHook = nil }
}
