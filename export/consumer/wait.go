package consumer

import (
	"context"
	"errors"
	"fmt"
	"net"
	"time"

	"github.com/cudapool/cudapool/cudart"
	"github.com/cudapool/cudapool/export/internal/wire"
)

// Backoff between tries: doubling from the first delay up to the last.
const (
	dialRetryFirst = 5 * time.Millisecond
	dialRetryMost  = 500 * time.Millisecond
	openRetryFirst = 1 * time.Millisecond
	openRetryMost  = 100 * time.Millisecond
)

// retry calls try until it succeeds, fails with an error not worth waiting on (again
// false), or ctx ends, waiting between calls with backoff from first to most. It
// returns try's last error, or, once ctx has ended (while waiting, or cutting a try
// short), the last error worth waiting on, and ctx's error. If ctx ended before any
// try got as far as an error worth waiting on (a loaded machine can run the first try
// after the deadline), that error is notYet: what the caller waited for never came,
// which is all a caller can say, and all it needs to.
func retry(ctx context.Context, first, most time.Duration, notYet error, try func() (again bool, err error)) (last, ctxErr error) {
	delay := first
	t := time.NewTimer(0)
	<-t.C
	defer t.Stop()
	waitedOn := notYet
	for {
		again, err := try()
		if again {
			waitedOn = err
		}
		if err != nil && ctx.Err() != nil {
			return waitedOn, ctx.Err()
		}
		if !again {
			return err, nil
		}
		t.Reset(delay)
		select {
		case <-t.C:
		case <-ctx.Done():
			return waitedOn, ctx.Err()
		}
		delay = min(2*delay, most)
	}
}

// dialWaiting is dialSocket that, with wait, tries again while nothing listens at path.
func dialWaiting(ctx context.Context, path string, wait bool) (net.Conn, error) {
	if !wait {
		return wire.DialSocket(ctx, path)
	}
	var nc net.Conn
	notYet := fmt.Errorf("%w: nothing answered at %s", ErrExporterGone, path)
	last, ctxErr := retry(ctx, dialRetryFirst, dialRetryMost, notYet, func() (bool, error) {
		var err error
		nc, err = wire.DialSocket(ctx, path)
		return errors.Is(err, ErrExporterGone), err
	})
	if ctxErr != nil {
		return nil, fmt.Errorf("%w (waited for an exporter until %w)", last, ctxErr)
	}
	return nc, last
}

// openWaiting is open that tries again while the name is not published.
func (imp *Importer) openWaiting(ctx context.Context, name string, s cudart.Stream) (*Mapping, error) {
	var m *Mapping
	notYet := fmt.Errorf("%w: %q: the exporter has not answered", ErrUnknownName, name)
	last, ctxErr := retry(ctx, openRetryFirst, openRetryMost, notYet, func() (bool, error) {
		var err error
		m, err = imp.open(ctx, name, s)
		return errors.Is(err, ErrUnknownName), err
	})
	if ctxErr != nil {
		return nil, fmt.Errorf("%w (waited for it to be published until %w)", last, ctxErr)
	}
	return m, last
}
