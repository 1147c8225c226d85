package owner

import (
	"context"
	"net"
	"os"
	"sync/atomic"
	"time"

	"github.com/cudapool/cudapool/cudart"
	"github.com/cudapool/cudapool/kv/internal/index"
	"github.com/cudapool/cudapool/kv/internal/kvwire"
)

// GiveBack shrinks device dev's slab to keep chunks, as a give-back of memory does:
// the table gives back the pages past them, which must be free, and the chunks are
// unmapped, every replica told.
func GiveBack(o *Owner, dev, keep int) error {
	s := o.byDev[dev]
	s.grow.Lock()
	err := o.keepable(len(s.fds), keep)
	s.grow.Unlock()
	if err != nil {
		return err
	}
	o.mu.Lock()
	_, err = s.tab.Shrink(o.layout.MappedPages(keep))
	if err == nil {
		_, _, err = s.tab.Shrunk()
	}
	o.mu.Unlock()
	if err != nil {
		return err
	}
	return o.unmapChunks(s, keep)
}

// SetWrapListener makes the next Listens wrap their page socket's listener with f,
// until the returned func undoes it.
func SetWrapListener(f func(net.Listener) net.Listener) (undo func()) {
	wrapListener = f
	return func() { wrapListener = nil }
}

// SetWriteTimeout bounds the owners' writes to a replica by d instead of 10 s, until
// the returned func undoes it. Set it, and undo it, while no owner serves.
func SetWriteTimeout(d time.Duration) (undo func()) {
	old := writeTimeout
	writeTimeout = d
	return func() { writeTimeout = old }
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
