package unixfd

import (
	"syscall"
	"unsafe"

	"golang.org/x/sys/unix"
)

// recvFlags makes the descriptors a read brings close-on-exec as they arrive, as the
// runtime's own reads do, rather than just after.
const recvFlags = unix.MSG_CMSG_CLOEXEC

// recvmsg is recvmsg(2) without the sender's address, which unix.Recvmsg and the net
// package decode, and allocate, for every read.
func recvmsg(fd int, p, oob []byte, flags int) (n, oobn, recvflags int, err error) {
	var iov unix.Iovec
	if len(p) > 0 {
		iov.Base = &p[0]
		iov.SetLen(len(p))
	}
	var msg unix.Msghdr
	msg.Iov = &iov
	msg.SetIovlen(1)
	if len(oob) > 0 {
		msg.Control = &oob[0]
		msg.SetControllen(len(oob))
	}
	r, _, e := syscall.Syscall(unix.SYS_RECVMSG, uintptr(fd), uintptr(unsafe.Pointer(&msg)), uintptr(flags))
	if e != 0 {
		return 0, 0, 0, e
	}
	return int(r), int(msg.Controllen), int(msg.Flags), nil
}
