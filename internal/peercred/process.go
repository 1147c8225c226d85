package peercred

import (
	"context"
	"errors"
	"fmt"
	"os"
	"syscall"
	"time"

	"golang.org/x/sys/unix"
)

// Process is a handle on one process, made by OpenProcess, that tells when it has
// exited. It stays bound to that process: a pid reused by a later process does not
// confuse it.
type Process struct {
	pid int
	f   *os.File // a pidfd, non-blocking, so that the runtime's poller waits on it
	rc  syscall.RawConn
}

// PID is the pid the process had when the handle was opened.
func (p *Process) PID() int { return p.pid }

// Wait blocks until the process has exited or ctx ends. A process has exited once none
// of its threads runs: a zombie that its parent has not reaped yet has exited, since it
// holds nothing but its pid any more. Wait reaps nothing. It returns nil once the
// process has exited, an error wrapping ctx's if ctx ended first, and otherwise the
// reason it cannot tell (the handle was closed, for instance). It waits in the
// runtime's poller, not by polling. Waits on one Process must not overlap.
func (p *Process) Wait(ctx context.Context) error {
	if err := ctx.Err(); err != nil {
		return fmt.Errorf("peercred: wait for pid %d: %w", p.pid, err)
	}
	rc, err := p.f.SyscallConn()
	if err != nil {
		return fmt.Errorf("peercred: wait for pid %d: %w", p.pid, err)
	}
	fired := make(chan struct{})
	stop := context.AfterFunc(ctx, func() {
		_ = p.f.SetReadDeadline(time.Unix(1, 0)) // wakes the wait below
		close(fired)
	})
	defer func() {
		if !stop() {
			<-fired                              // else it could set the deadline after it is cleared
			_ = p.f.SetReadDeadline(time.Time{}) // it fails only on a closed connection, which the next read or write reports
		}
	}()
	var exited bool
	var pollErr error
	err = rc.Read(func(fd uintptr) bool {
		exited, pollErr = hasExited(int(fd))
		return exited || pollErr != nil
	})
	switch {
	case pollErr != nil:
		return fmt.Errorf("peercred: wait for pid %d: %w", p.pid, pollErr)
	case exited:
		return nil
	case ctx.Err() != nil:
		return fmt.Errorf("peercred: wait for pid %d: %w", p.pid, ctx.Err())
	}
	return fmt.Errorf("peercred: wait for pid %d: %w", p.pid, err)
}

// Exited reports, without blocking, whether the process has exited (a zombie has). An
// error says the handle cannot tell (it was closed, for instance).
func (p *Process) Exited() (bool, error) {
	var exited bool
	var pollErr error
	if err := p.rc.Control(func(fd uintptr) { exited, pollErr = hasExited(int(fd)) }); err != nil {
		return false, fmt.Errorf("peercred: pid %d: %w", p.pid, err)
	}
	if pollErr != nil {
		return false, fmt.Errorf("peercred: pid %d: %w", p.pid, pollErr)
	}
	return exited, nil
}

// hasExited asks the pidfd fd, without blocking, whether its process has exited: it
// reads as ready from then on.
func hasExited(fd int) (bool, error) {
	pfd := []unix.PollFd{{Fd: int32(fd), Events: unix.POLLIN}}
	n, err := unix.Poll(pfd, 0)
	switch {
	case errors.Is(err, unix.EINTR):
		return false, nil // asked again at the next wake-up
	case err != nil:
		return false, fmt.Errorf("poll: %w", err)
	case n == 0:
		return false, nil
	case pfd[0].Revents&unix.POLLNVAL != 0:
		return false, errors.New("poll: the process handle is not open")
	}
	return true, nil
}

// Close releases the handle. A Wait in progress returns with an error.
func (p *Process) Close() error { return p.f.Close() }
