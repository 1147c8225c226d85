package discover

import (
	"log/slog"
	"time"

	"github.com/cudapool/cudapool/export/internal/wire"
)

// QueryOption configures [QueryState].
type QueryOption func(*queryOptions)

type queryOptions struct {
	wire.SharedOptions
}

func newQueryOptions(opts []QueryOption) queryOptions {
	o := queryOptions{SharedOptions: wire.DefaultShared()}
	for _, opt := range opts {
		if opt != nil {
			opt(&o)
		}
	}
	return o
}

// WithLogger sets where [QueryState] logs what no call returns. The default discards
// it: the library writes nothing to its process's stderr unless given a logger.
func WithLogger(l *slog.Logger) QueryOption {
	return func(o *queryOptions) { o.SetLogger(l) }
}

// WithHandshakeTimeout bounds how long [QueryState] waits for the exporter's answer when
// ctx has no earlier deadline. The default is 30 s.
func WithHandshakeTimeout(d time.Duration) QueryOption {
	return func(o *queryOptions) { o.SetHandshakeTimeout(d) }
}
