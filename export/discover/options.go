package discover

import (
	"log/slog"
	"time"

	"github.com/cudapool/cudapool/export/internal/wire"
)

// QueryOption configures QueryState.
type QueryOption interface{ applyQuery(*queryOptions) }

type queryOptions struct {
	wire.SharedOptions
}

type queryOption func(*queryOptions)

func (f queryOption) applyQuery(o *queryOptions) { f(o) }

func newQueryOptions(opts []QueryOption) queryOptions {
	o := queryOptions{SharedOptions: wire.DefaultShared()}
	for _, opt := range opts {
		opt.applyQuery(&o)
	}
	return o
}

// WithLogger sets where QueryState logs what no call returns. The default discards
// it: the library writes nothing to its process's stderr unless given a logger.
func WithLogger(l *slog.Logger) QueryOption {
	return queryOption(func(o *queryOptions) { o.SetLogger(l) })
}

// WithHandshakeTimeout bounds how long QueryState waits for the exporter's answer when
// ctx has no earlier deadline. The default is 30 s.
func WithHandshakeTimeout(d time.Duration) QueryOption {
	return queryOption(func(o *queryOptions) { o.SetHandshakeTimeout(d) })
}
