package export

import (
	"log/slog"
	"os"
	"path/filepath"
	"time"

	"github.com/cudapool/cudapool/cudart"
	"github.com/cudapool/cudapool/internal/printable"
	"github.com/cudapool/cudapool/pool"
)

// Each side takes options of its own type, as gRPC's ServerOption and DialOption: an
// option given to a side it does not configure does not compile. An option that fits
// every side (WithLogger, WithHandshakeTimeout) is a SharedOption, which is all three.

// ListenOption configures Listen.
type ListenOption interface{ applyListen(*listenOptions) }

// DialOption configures Dial and DialConn.
type DialOption interface{ applyDial(*dialOptions) }

// QueryOption configures QueryState.
type QueryOption interface{ applyQuery(*queryOptions) }

// SharedOption configures every side: it is a ListenOption, a DialOption and a
// QueryOption.
type SharedOption interface {
	ListenOption
	DialOption
	QueryOption
}

// sharedOptions are the settings of every side.
type sharedOptions struct {
	log              *slog.Logger
	handshakeTimeout time.Duration
}

type listenOptions struct {
	sharedOptions
	policy      Policy
	announceDir string // "" with announce false: none
	announce    bool
	name        string
	retain      bool
	// socketFollowsPolicy: the socket's mode and group open it to whom the policy
	// admits; otherwise it is 0600.
	socketFollowsPolicy bool
	// handshakesTotal and handshakesPerUID cap the connections in their handshake.
	handshakesTotal, handshakesPerUID int
	// maxGrants caps the grants one connection holds.
	maxGrants int
}

type dialOptions struct {
	sharedOptions
	waitForExporter bool
	pushStream      cudart.Stream
	pushHandler     func(name string, m *Mapping)
}

type queryOptions struct {
	sharedOptions
}

// OpenOption configures Importer.Open.
type OpenOption interface{ applyOpen(*openOptions) }

type openOptions struct {
	waitForName bool
	// replica: copy the buffer into memory of the Importer's device, from replicaAlloc
	// (nil: the device's default pool), and give the lease back at once.
	replica      bool
	replicaAlloc pool.Allocator
}

type openOption func(*openOptions)

func (f openOption) applyOpen(o *openOptions) { f(o) }

func newOpenOptions(opts []OpenOption) openOptions {
	var o openOptions
	for _, opt := range opts {
		opt.applyOpen(&o)
	}
	return o
}

// PublishOption configures Exporter.Publish.
type PublishOption interface{ applyPublish(*publishOptions) }

type publishOptions struct {
	offset, length uint64 // length 0: to the end of the buffer
	meta           []byte
}

type publishOption func(*publishOptions)

func (f publishOption) applyPublish(o *publishOptions) { f(o) }

// Range publishes length bytes of the buffer from offset instead of all of it: a tensor
// inside a segment, a block of a slab. Consumers map the whole buffer once per
// process, and their Mapping is the range: Ptr is its start, Size its length. Ranges
// are not rounded to the granularity (the buffer is). Everything in the buffer's pool
// stays readable to them all the same: the pool is the unit of trust.
func Range(offset, length uint64) PublishOption {
	return publishOption(func(o *publishOptions) { o.offset, o.length = offset, length })
}

// WithMeta sends meta (at most MaxMetaLen bytes, copied) to every consumer of the
// publication with its lease: Mapping.Meta. A dtype and shape, say.
func WithMeta(meta []byte) PublishOption {
	return publishOption(func(o *publishOptions) { o.meta = append([]byte(nil), meta...) })
}

// WaitForName makes Open wait, until its ctx ends, for the name to be published: it
// asks again, with backoff from 1 ms up to 100 ms, while the exporter answers
// ErrUnknownName. Other errors end the wait at once. When ctx ends first, the error
// wraps ctx's error and ErrUnknownName.
func WaitForName() OpenOption {
	return openOption(func(o *openOptions) { o.waitForName = true })
}

func defaultShared() sharedOptions {
	return sharedOptions{log: slog.New(slog.DiscardHandler), handshakeTimeout: 30 * time.Second}
}

func newListenOptions(opts []ListenOption) listenOptions {
	o := listenOptions{sharedOptions: defaultShared(), announce: true, name: printable.Clean(filepath.Base(os.Args[0]), MaxExporterNameLen),
		handshakesTotal: defaultHandshakesTotal, handshakesPerUID: defaultHandshakesPerUID, maxGrants: defaultMaxGrants}
	for _, opt := range opts {
		opt.applyListen(&o)
	}
	return o
}

func newDialOptions(opts []DialOption) dialOptions {
	o := dialOptions{sharedOptions: defaultShared()}
	for _, opt := range opts {
		opt.applyDial(&o)
	}
	return o
}

func newQueryOptions(opts []QueryOption) queryOptions {
	o := queryOptions{sharedOptions: defaultShared()}
	for _, opt := range opts {
		opt.applyQuery(&o)
	}
	return o
}

type listenOption func(*listenOptions)

func (f listenOption) applyListen(o *listenOptions) { f(o) }

type dialOption func(*dialOptions)

func (f dialOption) applyDial(o *dialOptions) { f(o) }

type sharedOption func(*sharedOptions)

func (f sharedOption) applyListen(o *listenOptions) { f(&o.sharedOptions) }
func (f sharedOption) applyDial(o *dialOptions)     { f(&o.sharedOptions) }
func (f sharedOption) applyQuery(o *queryOptions)   { f(&o.sharedOptions) }

// WithPolicy sets who may connect. The default admits this user's processes.
func WithPolicy(p Policy) ListenOption {
	return listenOption(func(o *listenOptions) { o.policy = p })
}

// WithLogger sets where events no call returns are logged: connections refused or
// closed for malformed input, cleanup that failed. The default discards them: the
// library writes nothing to its process's stderr unless given a logger
// (slog.Default() logs where the program's log package does).
func WithLogger(l *slog.Logger) SharedOption {
	return sharedOption(func(o *sharedOptions) {
		if l != nil {
			o.log = l
		}
	})
}

// WithAnnounce makes Listen announce the exporter in dir instead of DefaultDir().
func WithAnnounce(dir string) ListenOption {
	return listenOption(func(o *listenOptions) { o.announce, o.announceDir = true, dir })
}

// WithRetainedImports lets local consumers keep a buffer's import mapped after they
// release it, so that leasing the same memory again (a buffer recycled through its
// pool's cache, pool.WithCache) costs a message and a stream wait: no import, no free.
// The exporter revokes such imports (the consumer frees them) before their memory
// goes back to the driver; see the package docs.
func WithRetainedImports() ListenOption {
	return listenOption(func(o *listenOptions) { o.retain = true })
}

// WithoutAnnounce makes Listen write no announcement.
func WithoutAnnounce() ListenOption {
	return listenOption(func(o *listenOptions) { o.announce = false })
}

// MaxExporterNameLen is the longest exporter name (WithName), in bytes.
const MaxExporterNameLen = 128

// WithName sets the process name the exporter gives in its announcement and State.
// The default is the program's base name, with each character that does not show as
// itself replaced by '?' and cut to MaxExporterNameLen bytes. Listen refuses, with
// ErrBadName, a name that is empty, longer than MaxExporterNameLen bytes, not UTF-8,
// or holds a control or bidirectional control character or a line or paragraph
// separator.
func WithName(name string) ListenOption {
	return listenOption(func(o *listenOptions) { o.name = name })
}

// WithHandshakeTimeout bounds the handshake: how long a connecting peer may take to
// say Hello (Listen), and how long Dial, DialConn and QueryState wait for the
// exporter's answer when ctx has no earlier deadline. It only guards against peers
// that hang; the default is 30 s.
func WithHandshakeTimeout(d time.Duration) SharedOption {
	return sharedOption(func(o *sharedOptions) {
		if d > 0 {
			o.handshakeTimeout = d
		}
	})
}

// WaitForExporter makes Dial wait, until its ctx ends, for an exporter to listen at the
// path: it dials again, with backoff from 5 ms up to 500 ms, while nothing listens
// there (a missing socket, or one nobody accepts on). A refusal or a failed handshake
// ends the wait at once. When ctx ends first, the error wraps ctx's error and
// ErrExporterGone. DialConn, given a connection made already, has nothing to wait for.
func WaitForExporter() DialOption {
	return dialOption(func(o *dialOptions) { o.waitForExporter = true })
}

// WithPushes accepts buffers the exporter pushes: each is imported, s is made to wait
// for the producer's writes, and handler is called with the name and the Mapping,
// which it owns and must Release. Handlers run one at a time, in arrival order, on a
// goroutine of their own, so they may call Open. Without WithPushes, pushed leases are
// handed back at once.
func WithPushes(s cudart.Stream, handler func(name string, m *Mapping)) DialOption {
	return dialOption(func(o *dialOptions) { o.pushStream, o.pushHandler = s, handler })
}

// WithReplica makes Open copy the buffer into memory of the Importer's own device and
// give the lease back as soon as the copy is queued: the Mapping then holds no lease
// and its memory is this process's own, so it outlives its producer on any GPU. Use it
// for consumers on another GPU than the producer's that read the buffer more than
// once: a local read is about 5x faster than one over NVLink (FACTS), and such a
// consumer's mapping would otherwise be lost with its producer (ErrMappingLost,
// FACTS 14).
//
// The copy runs on a stream of the exporter's device, which the Importer makes at the
// first replica (and with it this process's CUDA context on that device, if it had
// none) and keeps, never on the consumer's: measured on the GPU host, 2026-11-30,
// TestGPUPeerConsumerOfKilledProducer (2x H200), copies of a GPU-0 buffer into GPU-1
// memory on a GPU-0 stream all succeeded while the producer was SIGKILLed, and read
// the right bytes after its death; on a GPU-1 stream they failed with
// cudaErrorContained and the consumer's whole context was lost. That stream waits
// for the work queued on s before Open's return (the producer's writes, the
// replica's allocation), and s waits for the copy: work queued on s after Open sees
// the replica filled, and the import is freed after the copy. A producer killed
// while the copy runs does not harm it; one killed before the writes Publish
// ordered had completed leaves what it had written, as for any reader (a stream's
// wait on a killed producer's event ends at the kill). On the exporter's own device
// (or one this process does not see: another host's, over FABRIC) the copy runs on s.
//
// The replica is taken from a (nil: a pool the Importer makes on its device, one per
// exporter's device, which grants that device access, keeps the memory of released
// replicas for the next ones, and is destroyed with the last replica once the
// Importer is closed; pass an allocator to bound that memory). The exporter's device
// writes the replica, so
// a's pool must grant it read-write access (pool.WithPeerAccess): a pool.Pool that
// does not is refused with an error wrapping pool.ErrNoPeerAccess, before anything is
// allocated; an allocator that does not say its pool (no Handle method) fails the
// copy instead. A replica is not shared: each Open with WithReplica makes its own,
// and its Release frees it after the work queued on s.
func WithReplica(a pool.Allocator) OpenOption {
	return openOption(func(o *openOptions) { o.replica, o.replicaAlloc = true, a })
}

// SocketFollowsPolicy opens the socket to whom the Policy admits, instead of this user
// alone (mode 0600): to one group, mode 0660 and that group (the exporter's process
// must belong to it); to other users or several groups, mode 0666. The kernel's
// credentials and the Policy still decide who is admitted: the mode only lets the
// others connect to be asked. Without it, a Policy that admits others admits nobody
// new, as they cannot open the socket.
func SocketFollowsPolicy() ListenOption {
	return listenOption(func(o *listenOptions) { o.socketFollowsPolicy = true })
}

// WithHandshakeLimit caps the connections still in their handshake (connected, not yet
// admitted): total in all, perUID from any one user (peers on a byte stream count as
// one user). A connection past a cap is closed at once, and the log says so, so that
// no local user can hold all the handshakes. The defaults are 1024 and 128; a value
// below 1 keeps the default.
func WithHandshakeLimit(total, perUID int) ListenOption {
	return listenOption(func(o *listenOptions) {
		if total > 0 {
			o.handshakesTotal = total
		}
		if perUID > 0 {
			o.handshakesPerUID = perUID
		}
	})
}

// defaultMaxGrants is WithMaxGrants's default: far more than a consumer needs (one per
// Open it has not released), few enough that one connection's bookkeeping stays a few
// megabytes.
const defaultMaxGrants = 1 << 16

// WithMaxGrants caps the grants one connection may hold at once (each Open or Push of a
// buffer is one, until released). An Open past it fails with ErrTooManyGrants and
// holds nothing more; a Push past it fails the same way. The default is 65536; a value
// below 1 keeps it.
func WithMaxGrants(n int) ListenOption {
	return listenOption(func(o *listenOptions) {
		if n > 0 {
			o.maxGrants = n
		}
	})
}
