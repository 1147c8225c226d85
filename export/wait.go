package export

import (
	"context"
	"errors"
	"fmt"
	"net"
	"time"
)

// Replicas start together: a consumer may dial before its exporter listens, or open a
// name before it is published. WaitForExporter and WaitForName make Dial and Open wait
// for those, polling with backoff, so that no user writes that retry loop.

// Backoff between tries: doubling from the first delay up to the last.
const (
	dialRetryFirst = 5 * time.Millisecond
	dialRetryMost  = 500 * time.Millisecond
	openRetryFirst = 1 * time.Millisecond
	openRetryMost  = 100 * time.Millisecond
)

// retry calls try until it returns false (done) or ctx ends, waiting between calls with
// backoff from first to most. It returns try's last error, and ctx's error if ctx
// ended while waiting. A try that fails as ctx ends (a dial cut short) counts as the
// end of the wait, with the last error worth waiting on as try's.
func retry(ctx context.Context, first, most time.Duration, try func() (again bool, err error)) (last, ctxErr error) {
	delay := first
	t := time.NewTimer(0)
	<-t.C
	defer t.Stop()
	var waitedOn error // the last error a try asked to wait on
	for {
		again, err := try()
		if again {
			waitedOn = err
		}
		if err != nil && waitedOn != nil && ctx.Err() != nil {
			return waitedOn, ctx.Err()
		}
		if !again {
			return err, nil
		}
		t.Reset(delay)
		select {
		case <-t.C:
		case <-ctx.Done():
			return err, ctx.Err()
		}
		delay = min(2*delay, most)
	}
}

// dialWaiting is dialSocket that, with wait, tries again while nothing listens at path.
func dialWaiting(ctx context.Context, path string, wait bool) (net.Conn, error) {
	var nc net.Conn
	last, ctxErr := retry(ctx, dialRetryFirst, dialRetryMost, func() (bool, error) {
		var err error
		nc, err = dialSocket(ctx, path)
		return wait && errors.Is(err, ErrExporterGone), err
	})
	if ctxErr != nil {
		return nil, fmt.Errorf("%w (waited for an exporter until %w)", last, ctxErr)
	}
	return nc, last
}
