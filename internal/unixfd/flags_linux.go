package unixfd

import "golang.org/x/sys/unix"

// recvFlags makes the descriptors a read brings close-on-exec as they arrive, as the
// runtime's own reads do, rather than just after.
const recvFlags = unix.MSG_CMSG_CLOEXEC
