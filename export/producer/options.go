package producer

import (
	"log/slog"
	"os"
	"path/filepath"
	"time"

	"github.com/cudapool/cudapool/export"
	"github.com/cudapool/cudapool/export/internal/wire"
	"github.com/cudapool/cudapool/internal/printable"
	"github.com/cudapool/cudapool/internal/session"
)

// ListenOption configures [Listen].
type ListenOption func(*listenOptions)

type listenOptions struct {
	wire.SharedOptions
	policy      export.Policy
	announceDir string // "": discover.DefaultDir()
	announce    bool
	name        string
	retain      bool
	// socketFollowsPolicy: the socket's mode and group open it to whom the policy
	// admits; otherwise it is 0600.
	socketFollowsPolicy bool
	// caps are the session server's caps (WithHandshakeLimit, WithConnLimit); its
	// handshake timeout is SharedOptions'.
	caps session.Limits
	// maxGrants caps the grants one connection holds.
	maxGrants int
}

// PublishOption configures [Exporter.Publish].
type PublishOption func(*publishOptions)

type publishOptions struct {
	offset, length uint64 // length 0: to the end of the buffer
	meta           []byte
}

// Range publishes length bytes of the buffer from offset instead of all of it: a tensor
// inside a segment, a block of a slab. Consumers map the whole buffer once per
// process, and their Mapping is the range: Ptr is its start, Size its length. Ranges
// are not rounded to the granularity (the buffer is). Everything in the buffer's pool
// stays readable to them all the same: the pool is the unit of trust.
func Range(offset, length uint64) PublishOption {
	return func(o *publishOptions) { o.offset, o.length = offset, length }
}

// WithMeta sends meta (at most [export.MaxMetaLen] bytes, copied) to every consumer of the
// publication with its lease: consumer.Mapping.Meta. A dtype and shape, say.
func WithMeta(meta []byte) PublishOption {
	return func(o *publishOptions) { o.meta = append([]byte(nil), meta...) }
}

func newListenOptions(opts []ListenOption) listenOptions {
	o := listenOptions{SharedOptions: wire.DefaultShared(), announce: true, name: printable.Clean(filepath.Base(os.Args[0]), MaxExporterNameLen),
		maxGrants: defaultMaxGrants}
	for _, opt := range opts {
		if opt != nil {
			opt(&o)
		}
	}
	return o
}

// WithPolicy sets who may connect. The default admits this user's processes.
func WithPolicy(p export.Policy) ListenOption {
	return func(o *listenOptions) { o.policy = p }
}

// WithLogger sets where events no call returns are logged: connections refused or
// closed for malformed input, cleanup that failed. The default discards them: the
// library writes nothing to its process's stderr unless given a logger
// ([slog.Default] logs where the program's log package does).
func WithLogger(l *slog.Logger) ListenOption {
	return func(o *listenOptions) { o.SetLogger(l) }
}

// WithAnnounceDir sets where [Listen] announces the exporter; the default (and "") is
// [discover.DefaultDir]. [WithoutAnnounce] wins over it, whatever their order, as in
// kv/owner.
func WithAnnounceDir(dir string) ListenOption {
	return func(o *listenOptions) { o.announceDir = dir }
}

// WithRetainedImports lets local consumers keep a buffer's import mapped after they
// release it, so that leasing the same memory again (a buffer recycled through its
// pool's cache, [pool.WithCache]) costs a message and a stream wait: no import, no free.
// The exporter revokes such imports (the consumer frees them) before their memory
// goes back to the driver; see the package docs.
func WithRetainedImports() ListenOption {
	return func(o *listenOptions) { o.retain = true }
}

// WithoutAnnounce makes [Listen] write no announcement.
func WithoutAnnounce() ListenOption {
	return func(o *listenOptions) { o.announce = false }
}

// MaxExporterNameLen is the longest exporter name ([WithName]), in bytes.
const MaxExporterNameLen = 128

// WithName sets the process name the exporter gives in its announcement and State.
// The default is the program's base name, with each character that does not show as
// itself replaced by '?' and cut to [MaxExporterNameLen] bytes. [Listen] refuses, with
// [export.ErrBadName], a name that is empty, longer than MaxExporterNameLen bytes, not UTF-8,
// or holds a control or bidirectional control character or a line or paragraph
// separator.
func WithName(name string) ListenOption {
	return func(o *listenOptions) { o.name = name }
}

// WithHandshakeTimeout bounds how long a connection may take from its accept to its
// admission: past it, the exporter closes it. It only guards against peers that hang;
// the default (and d <= 0) is 30 s.
func WithHandshakeTimeout(d time.Duration) ListenOption {
	return func(o *listenOptions) { o.SetHandshakeTimeout(d) }
}

// SocketFollowsPolicy opens the socket to whom the Policy admits, instead of this user
// alone (mode 0600): to one group, mode 0660 and that group (the exporter's process
// must belong to it); to other users or several groups, mode 0666. The kernel's
// credentials and the Policy still decide who is admitted: the mode only lets the
// others connect to be asked. Without it, a Policy that admits others admits nobody
// new, as they cannot open the socket.
func SocketFollowsPolicy() ListenOption {
	return func(o *listenOptions) { o.socketFollowsPolicy = true }
}

// WithHandshakeLimit caps the connections still in their handshake (connected, not yet
// admitted): total in all, perUID from any one user (the peers on byte streams of one
// host count as one user). A connection past a cap is closed at once, without a word, and logged, so
// that no local user can hold all the handshakes. The defaults are 1024 and 128; a
// value below 1 keeps the default.
func WithHandshakeLimit(total, perUID int) ListenOption {
	return func(o *listenOptions) { o.caps.Handshakes, o.caps.HandshakesPerUID = total, perUID }
}

// WithConnLimit caps the admitted connections, peers and observers alike: total in
// all, perProcess from any one process (the peers on byte streams of one host count as
// one process).
// A connection past a cap is refused: its Dial fails with an error wrapping
// [export.ErrRefused] that names the cap. The defaults are 4096 and 64; a value below 1
// keeps the default.
func WithConnLimit(total, perProcess int) ListenOption {
	return func(o *listenOptions) { o.caps.Conns, o.caps.ConnsPerProcess = total, perProcess }
}

// limits are the session server's limits.
func (o *listenOptions) limits() session.Limits {
	l := o.caps
	l.HandshakeTimeout = o.HandshakeTimeout
	return l
}

// defaultMaxGrants is WithMaxGrants's default: far more than a consumer needs (one per
// Open it has not released), few enough that one connection's bookkeeping stays a few
// megabytes.
const defaultMaxGrants = 1 << 16

// WithMaxGrants caps the grants one connection may hold at once (each Open or Push of a
// buffer is one, until released). An Open past it fails with [export.ErrTooManyGrants] and
// holds nothing more; a Push past it fails the same way. The default is 65536; a value
// below 1 keeps it.
func WithMaxGrants(n int) ListenOption {
	return func(o *listenOptions) {
		if n > 0 {
			o.maxGrants = n
		}
	}
}
