package export

import (
	"log/slog"
	"os"
	"path/filepath"
	"time"

	"github.com/cudapool/cudapool/cudart"
)

// Option configures Listen or Dial. Each option says which side it is for; the other
// side ignores it.
type Option func(*options)

type options struct {
	policy      Policy
	log         *slog.Logger
	announceDir string // "" with announce false: none
	announce    bool
	name        string
	handshake   time.Duration
	pushStream  cudart.Stream
	pushHandler func(name string, m *Mapping)
}

func defaultOptions() options {
	return options{
		log:       slog.Default(),
		announce:  true,
		name:      filepath.Base(os.Args[0]),
		handshake: 30 * time.Second,
	}
}

func applyOptions(opts []Option) options {
	o := defaultOptions()
	for _, opt := range opts {
		opt(&o)
	}
	return o
}

// WithPolicy sets who may connect (Listen). The default admits this user's processes.
func WithPolicy(p Policy) Option { return func(o *options) { o.policy = p } }

// WithLogger sets where connections refused or closed for malformed input, and other
// events no call returns, are logged (Listen and Dial). The default is slog.Default().
func WithLogger(l *slog.Logger) Option {
	return func(o *options) {
		if l != nil {
			o.log = l
		}
	}
}

// WithAnnounce makes Listen announce the exporter in dir instead of DefaultDir().
func WithAnnounce(dir string) Option {
	return func(o *options) { o.announce, o.announceDir = true, dir }
}

// WithoutAnnounce makes Listen write no announcement.
func WithoutAnnounce() Option { return func(o *options) { o.announce = false } }

// WithName sets the process name the exporter gives in its announcement and State
// (Listen). The default is the program's base name.
func WithName(name string) Option { return func(o *options) { o.name = name } }

// WithHandshakeTimeout bounds how long a connecting peer may take to say Hello (Listen)
// and how long Dial waits for the exporter's answer when ctx has no deadline. It only
// guards against peers that hang; the default is 30 s.
func WithHandshakeTimeout(d time.Duration) Option {
	return func(o *options) {
		if d > 0 {
			o.handshake = d
		}
	}
}

// WithPushes accepts buffers the exporter pushes (Dial): each is imported, s is made to
// wait for the producer's writes, and handler is called with the name and the Mapping,
// which it owns and must Release. Handlers run one at a time, in arrival order, on a
// goroutine of their own, so they may call Open. Without WithPushes, pushed leases are
// handed back at once.
func WithPushes(s cudart.Stream, handler func(name string, m *Mapping)) Option {
	return func(o *options) { o.pushStream, o.pushHandler = s, handler }
}
