package consumer

import (
	"log/slog"
	"time"

	"github.com/cudapool/cudapool/cudart"
	"github.com/cudapool/cudapool/export/internal/wire"
	"github.com/cudapool/cudapool/pool"
)

// DialOption configures [Dial] and [DialConn].
type DialOption func(*dialOptions)

type dialOptions struct {
	wire.SharedOptions
	waitForExporter bool
	pushStream      cudart.Stream
	pushHandler     func(name string, m *Mapping)
}

// OpenOption configures [Importer.Open].
type OpenOption func(*openOptions)

type openOptions struct {
	waitForName bool
	// local copy: copy the buffer into memory of the Importer's device, from localCopyAlloc
	// (nil: the device's default pool), and release the lease at once.
	localCopy      bool
	localCopyAlloc pool.Allocator
}

func newOpenOptions(opts []OpenOption) openOptions {
	var o openOptions
	for _, opt := range opts {
		if opt != nil {
			opt(&o)
		}
	}
	return o
}

// WaitForName makes Open wait, until its ctx ends, for the name to be published: it
// asks again, with backoff from 1 ms up to 100 ms, while the exporter answers
// [export.ErrUnknownName]. Other errors end the wait at once. When ctx ends first, the error
// wraps ctx's error and export.ErrUnknownName.
func WaitForName() OpenOption {
	return func(o *openOptions) { o.waitForName = true }
}

func newDialOptions(opts []DialOption) dialOptions {
	o := dialOptions{SharedOptions: wire.DefaultShared()}
	for _, opt := range opts {
		if opt != nil {
			opt(&o)
		}
	}
	return o
}

// WaitForExporter makes [Dial] wait, until its ctx ends, for an exporter to listen at the
// path: it dials again, with backoff from 5 ms up to 500 ms, while nothing listens
// there (a missing socket, or one nobody accepts on). A refusal or a failed handshake
// ends the wait at once. When ctx ends first, the error wraps ctx's error and
// [export.ErrExporterGone]. [DialConn], given a connection made already, has nothing to wait for.
func WaitForExporter() DialOption {
	return func(o *dialOptions) { o.waitForExporter = true }
}

// WithPushes accepts buffers the exporter pushes: each is imported, s is made to wait
// for the producer's writes, and handler is called with the name and the [Mapping],
// which it owns and must Release. Handlers run one at a time, in arrival order, on a
// goroutine of their own, so they may call Open. Without WithPushes, pushed leases are
// handed back at once.
func WithPushes(handler func(name string, m *Mapping), s cudart.Stream) DialOption {
	return func(o *dialOptions) { o.pushStream, o.pushHandler = s, handler }
}

// WithLocalCopy makes Open copy the buffer into memory of the [Importer]'s own device and
// release the lease as soon as the copy is queued: the [Mapping] then holds no lease
// and its memory is this process's own, so it outlives its producer on any GPU. Use it
// for consumers on another GPU than the producer's that read the buffer more than
// once: a local read is faster than one over NVLink, and such a consumer's mapping
// would otherwise be lost with its producer ([ErrMappingLost], FACTS 14).
//
// The copy runs on a stream of the exporter's device, never the consumer's (FACTS 14):
// the Importer makes it at the first local copy (and with it this process's CUDA context
// on that device, if it had none) and keeps it. That stream waits for the work queued
// on s before Open's return (the producer's writes, the local copy's allocation), and s
// waits for the copy: work queued on s after Open sees the local copy filled, and the
// import is freed after the copy. On the exporter's own device (or one this process
// does not see: another host's, over FABRIC) the copy runs on s.
//
// The local copy is taken from a; nil is a pool the Importer makes on its device, one per
// exporter's device, which keeps the memory of released local copies for the next ones and
// is destroyed with the last local copy once the Importer is closed (pass an allocator to
// bound that memory). The exporter's device writes the local copy, so a's pool must grant
// it read-write access ([pool.WithPeerAccess]): a [pool.Pool] that does not is refused with
// an error wrapping [pool.ErrNoPeerAccess], before anything is allocated; an allocator
// that does not say its pool (no Handle method) fails the copy instead. Each Open with
// WithLocalCopy makes its own local copy, and its Release frees it after the work queued on
// s.
func WithLocalCopy(a pool.Allocator) OpenOption {
	return func(o *openOptions) { o.localCopy, o.localCopyAlloc = true, a }
}

// WithLogger sets where events no call returns are logged: connections closed for
// malformed input, cleanup that failed. The default discards them: the
// library writes nothing to its process's stderr unless given a logger
// ([slog.Default] logs where the program's log package does).
func WithLogger(l *slog.Logger) DialOption {
	return func(o *dialOptions) { o.SetLogger(l) }
}

// WithHandshakeTimeout bounds how long [Dial] and [DialConn] wait for the exporter's
// answer when ctx has no earlier deadline. It only guards against exporters that hang;
// the default is 30 s.
func WithHandshakeTimeout(d time.Duration) DialOption {
	return func(o *dialOptions) { o.SetHandshakeTimeout(d) }
}
