package peercred

import (
	"errors"
	"fmt"
	"os"
	"strconv"
	"time"

	"golang.org/x/sys/unix"
)

// OpenProcess returns a handle on the process pid, which the caller must Close. It
// fails with ErrGone if no process has that pid (it exited and was reaped), with
// ErrUnsupported where the kernel has no pollable pidfds (before Linux 5.3, or a
// sandbox that forbids them), and with the kernel's reason otherwise. A pid of 0, what
// SO_PEERCRED gives for a peer in a pid namespace this process cannot see, is refused.
func OpenProcess(pid int) (*Process, error) {
	if pid <= 0 {
		return nil, fmt.Errorf("peercred: pid %d names no process this one can see", pid)
	}
	fd, err := unix.PidfdOpen(pid, 0)
	switch {
	case errors.Is(err, unix.ESRCH):
		return nil, fmt.Errorf("%w: pid %d", ErrGone, pid)
	case errors.Is(err, unix.ENOSYS):
		return nil, fmt.Errorf("%w: pidfd_open: %w", ErrUnsupported, err)
	case err != nil:
		return nil, fmt.Errorf("peercred: pidfd_open %d: %w", pid, err)
	}
	// Non-blocking, so that os.NewFile hands the pidfd to the runtime's poller, which
	// reports it readable when the process exits.
	if err := unix.SetNonblock(fd, true); err != nil {
		_ = unix.Close(fd) // cleanup: the descriptor is ours and unused
		return nil, fmt.Errorf("peercred: pidfd of %d: %w", pid, err)
	}
	f := os.NewFile(uintptr(fd), "pidfd:"+strconv.Itoa(pid))
	if err := f.SetReadDeadline(time.Time{}); err != nil {
		_ = f.Close() // not pollable: Wait could not be woken by ctx
		return nil, fmt.Errorf("%w: the pidfd of %d cannot be polled: %w", ErrUnsupported, pid, err)
	}
	rc, err := f.SyscallConn()
	if err != nil {
		_ = f.Close() // cleanup: nothing is left to do if closing fails
		return nil, fmt.Errorf("peercred: pidfd of %d: %w", pid, err)
	}
	return &Process{pid: pid, f: f, rc: rc}, nil
}
