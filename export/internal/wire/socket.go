package wire

import (
	"errors"
	"io/fs"
	"net"
	"syscall"
	"time"
)

// staleProbeTimeout bounds the connect that tells a live exporter's socket from a stale
// one. A live listener answers a local connect at once; this only guards against a hang.
const staleProbeTimeout = 2 * time.Second

// SyscallErr is the system's error inside err, without the path or address it names:
// the temporary name means nothing to the caller, who is told the real path instead.
func SyscallErr(err error) error {
	var errno syscall.Errno
	if errors.As(err, &errno) {
		return errno
	}
	return err
}

// SocketAnswers reports whether a listener accepts connections on path. A refused or
// vanished socket is not live; any other failure is returned, as it proves nothing.
func SocketAnswers(path string) (bool, error) {
	c, err := net.DialTimeout("unix", path, staleProbeTimeout)
	if err == nil {
		_ = c.Close() // cleanup: nothing is left to do if closing fails
		return true, nil
	}
	if errors.Is(err, syscall.ECONNREFUSED) || errors.Is(err, fs.ErrNotExist) {
		return false, nil
	}
	return false, err
}
