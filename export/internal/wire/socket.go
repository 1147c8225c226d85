package wire

import (
	"errors"
	"syscall"
)

// SyscallErr is the system's error inside err, without the path or address it names:
// the temporary name means nothing to the caller, who is told the real path instead.
func SyscallErr(err error) error {
	var errno syscall.Errno
	if errors.As(err, &errno) {
		return errno
	}
	return err
}
