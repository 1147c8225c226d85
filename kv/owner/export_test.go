package owner

import (
	"net"
	"time"

	"github.com/cudapool/cudapool/cudart"
	"github.com/cudapool/cudapool/kv/internal/index"
	"github.com/cudapool/cudapool/kv/internal/kvwire"
)

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
