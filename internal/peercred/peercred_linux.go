package peercred

import (
	"fmt"
	"net"

	"golang.org/x/sys/unix"
)

// Get returns the credentials of the process that connected c, as the kernel recorded
// them at connect (or socketpair) time. On failure Cred is zero and the error says why;
// c is left open either way.
func Get(c *net.UnixConn) (Cred, error) {
	raw, err := c.SyscallConn()
	if err != nil {
		return Cred{}, fmt.Errorf("peercred: %w", err)
	}
	var ucred *unix.Ucred
	var sockErr error
	if err := raw.Control(func(fd uintptr) {
		ucred, sockErr = unix.GetsockoptUcred(int(fd), unix.SOL_SOCKET, unix.SO_PEERCRED)
	}); err != nil {
		return Cred{}, fmt.Errorf("peercred: %w", err)
	}
	if sockErr != nil {
		return Cred{}, fmt.Errorf("peercred: SO_PEERCRED: %w", sockErr)
	}
	return Cred{PID: int(ucred.Pid), UID: ucred.Uid, GID: ucred.Gid}, nil
}
