//go:build !linux

package unixfd

import "golang.org/x/sys/unix"

// recvFlags: the descriptors are made close-on-exec just after they arrive.
const recvFlags = 0

func recvmsg(fd int, p, oob []byte, flags int) (n, oobn, recvflags int, err error) {
	n, oobn, recvflags, _, err = unix.Recvmsg(fd, p, oob, flags)
	return n, oobn, recvflags, err
}
