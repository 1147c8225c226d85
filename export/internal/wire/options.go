package wire

import (
	"log/slog"
	"time"
)

// SharedOptions are the settings every side takes (producer.WithLogger,
// consumer.WithLogger, discover.WithLogger, and WithHandshakeTimeout of each).
type SharedOptions struct {
	Log              *slog.Logger
	HandshakeTimeout time.Duration
}

// DefaultShared is every side's default: a logger that discards (the library writes
// nothing to its process's stderr unless given one) and 30 s.
func DefaultShared() SharedOptions {
	return SharedOptions{Log: slog.New(slog.DiscardHandler), HandshakeTimeout: 30 * time.Second}
}

// SetLogger sets o's logger; nil keeps it.
func (o *SharedOptions) SetLogger(l *slog.Logger) {
	if l != nil {
		o.Log = l
	}
}

// SetHandshakeTimeout sets o's handshake bound; d <= 0 keeps it.
func (o *SharedOptions) SetHandshakeTimeout(d time.Duration) {
	if d > 0 {
		o.HandshakeTimeout = d
	}
}
