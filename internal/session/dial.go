package session

import (
	"context"
	"errors"
	"fmt"
	"io/fs"
	"net"
	"os"
	"syscall"
	"time"
)

// DialBackoffMin and DialBackoffMax bound the backoff of a dial that waits for a
// server: it tries again after 5 ms, doubling to 500 ms.
const (
	DialBackoffMin = 5 * time.Millisecond
	DialBackoffMax = 500 * time.Millisecond
)

// ErrNoListener means nothing listens at a socket's path: the file is missing, or no
// process accepts on it.
var ErrNoListener = errors.New("nothing listens")

// ErrNotSocket means the file at a socket's path is something else.
var ErrNotSocket = errors.New("not a socket")

// Dial connects to the Unix socket at path. Where nothing listens there it fails with
// an error wrapping [ErrNoListener], or, with wait, tries again with backoff
// (DialBackoffMin to DialBackoffMax) until ctx ends; the error is then ctx's, joined
// with the last dial's. A file that is no socket fails it with [ErrNotSocket], and any
// other error of the connect as it is, without a wait.
func Dial(ctx context.Context, path string, wait bool) (*net.UnixConn, error) {
	var nc *net.UnixConn
	dial := func() (bool, error) {
		var d net.Dialer
		c, err := d.DialContext(ctx, "unix", path)
		if err == nil {
			nc = c.(*net.UnixConn)
			return false, nil
		}
		if !errors.Is(err, syscall.ECONNREFUSED) && !errors.Is(err, syscall.ENOENT) {
			return false, err
		}
		// A connect to a file that is no socket is refused too: say what is there.
		if info, serr := os.Stat(path); serr == nil && info.Mode().Type() != fs.ModeSocket {
			return false, fmt.Errorf("%w: %s (mode %v)", ErrNotSocket, path, info.Mode())
		}
		return wait, fmt.Errorf("%w at %s: %w", ErrNoListener, path, err)
	}
	last, ctxErr := Retry(ctx, DialBackoffMin, DialBackoffMax, fmt.Errorf("%w at %s: no dial was tried before the deadline", ErrNoListener, path), dial)
	if ctxErr != nil {
		return nil, errors.Join(ctxErr, last)
	}
	return nc, last
}

// ProbeTimeout bounds the connect of Answers. A live listener answers a local connect
// at once; this only guards against a hang.
const ProbeTimeout = 2 * time.Second

// Answers reports whether a listener accepts connections on the Unix socket at path:
// a path where nothing listens (no file, a socket nobody accepts on, a file that is no
// socket) is not live; any other failure (a full backlog, a path too long, no right to
// connect) is returned, as it proves nothing either way.
func Answers(path string) (bool, error) {
	ctx, cancel := context.WithTimeout(context.Background(), ProbeTimeout)
	defer cancel()
	nc, err := Dial(ctx, path, false)
	switch {
	case err == nil:
		_ = nc.Close() // cleanup: nothing is left to do if closing fails
		return true, nil
	case errors.Is(err, ErrNoListener) || errors.Is(err, ErrNotSocket):
		return false, nil
	}
	return false, err
}

// Retry calls try until it succeeds, fails with an error not worth waiting on (again
// false), or ctx ends, waiting between calls with backoff from first to most. It
// returns try's last error, or, once ctx has ended (while waiting, or cutting a try
// short), the last error worth waiting on, and ctx's error. If ctx ended before any
// try got as far as an error worth waiting on (a loaded machine can run the first try
// after the deadline), that error is notYet: what the caller waited for never came,
// which is all a caller can say, and all it needs to.
func Retry(ctx context.Context, first, most time.Duration, notYet error, try func() (again bool, err error)) (last, ctxErr error) {
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
