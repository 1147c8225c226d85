package producer

import (
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"io/fs"
	"net"
	"os"
	"path/filepath"
	"slices"

	"github.com/cudapool/cudapool/export"
	"github.com/cudapool/cudapool/export/internal/wire"
	"github.com/cudapool/cudapool/internal/session"
)

// socketFile is a listening Unix socket that only this user can connect to, and the
// identity of the file that names it, so that Close removes that file and never a
// successor's.
type socketFile struct {
	*net.UnixListener
	path string
	info os.FileInfo
	// unlocal takes the socket out of wire's record of this process's exporters.
	unlocal func()
}

// maxSocketPath is the longest path a Unix socket address holds: sun_path is 108
// bytes, the last one the terminating NUL.
const maxSocketPath = 107

// socketAccess is who may open the socket file: its mode, and its group (-1: left as
// created).
type socketAccess struct {
	mode fs.FileMode
	gid  int
}

// privateSocket is this user's alone.
var privateSocket = socketAccess{mode: 0o600, gid: -1}

// accessFor opens the socket to whom p admits: one group alone gets the group and
// 0660; any other uid or several groups, 0666 (the policy still decides).
func accessFor(p export.Policy) socketAccess {
	own := uint32(os.Getuid())
	othersUIDs := slices.ContainsFunc(p.AllowUIDs, func(u uint32) bool { return u != own })
	switch {
	case !othersUIDs && len(p.AllowGIDs) == 0:
		return privateSocket
	case !othersUIDs && len(p.AllowGIDs) == 1:
		return socketAccess{mode: 0o660, gid: int(p.AllowGIDs[0])}
	}
	return socketAccess{mode: 0o666, gid: -1}
}

// listenSocket creates a listening Unix socket at path with access's mode and group,
// whatever the umask. An existing socket file that refuses connections (its exporter
// died) is removed; one that a live exporter answers gives ErrAddressInUse; a path that
// is not a socket gives export.ErrNotSocket and is left alone; a path too long for a socket
// address gives ErrSocketPath. Errors name path, never the temporary name. On failure
// nothing is left behind.
func listenSocket(path string, access socketAccess) (*socketFile, error) {
	// Bind under a random name in the same directory, restrict it, then link it to
	// path: the socket is never reachable under path with the umask's mode, and the
	// link fails rather than replace a socket that appeared since the check.
	var r [6]byte
	rand.Read(r[:])
	tmp := filepath.Join(filepath.Dir(path), ".cudapool-"+hex.EncodeToString(r[:]))
	switch {
	case len(path) > maxSocketPath:
		return nil, fmt.Errorf("%w: %s is %d bytes", ErrSocketPath, path, len(path))
	case len(tmp) > maxSocketPath:
		return nil, fmt.Errorf("%w: %s leaves no room for the socket's temporary name in its directory (%d bytes with it); use a shorter directory", ErrSocketPath, path, len(tmp))
	}
	if err := clearStaleSocket(path); err != nil {
		return nil, err
	}
	l, err := net.ListenUnix("unix", &net.UnixAddr{Name: tmp, Net: "unix"})
	if err != nil {
		return nil, fmt.Errorf("producer: listen on %s: %w", path, wire.SyscallErr(err))
	}
	l.SetUnlinkOnClose(false)
	defer func() { _ = os.Remove(tmp) }() // best effort: a leftover file is harmless, and the first error is the one returned
	fail := func(err error) (*socketFile, error) {
		_ = l.Close() // cleanup: nothing is left to do if closing fails
		return nil, err
	}
	if access.gid >= 0 {
		if err := os.Chown(tmp, -1, access.gid); err != nil {
			return fail(fmt.Errorf("producer: give socket %s to group %d: %w", path, access.gid, wire.SyscallErr(err)))
		}
	}
	if err := os.Chmod(tmp, access.mode); err != nil {
		return fail(fmt.Errorf("producer: set socket %s to mode %v: %w", path, access.mode, wire.SyscallErr(err)))
	}
	if err := os.Link(tmp, path); err != nil {
		if errors.Is(err, fs.ErrExist) {
			return fail(fmt.Errorf("%w: %s appeared while this exporter started", ErrAddressInUse, path))
		}
		return fail(fmt.Errorf("producer: name socket %s: %w", path, wire.SyscallErr(err)))
	}
	info, err := os.Lstat(path)
	if err != nil {
		return fail(fmt.Errorf("producer: socket %s: %w", path, err))
	}
	return &socketFile{UnixListener: l, path: path, info: info}, nil
}

// clearStaleSocket leaves path free for a new socket, or says why it cannot.
func clearStaleSocket(path string) error {
	info, err := os.Lstat(path)
	if errors.Is(err, fs.ErrNotExist) {
		return nil
	}
	if err != nil {
		return fmt.Errorf("producer: socket path %s: %w", path, err)
	}
	if info.Mode().Type() != fs.ModeSocket {
		return fmt.Errorf("%w: %s is a %v", export.ErrNotSocket, path, info.Mode().Type())
	}
	live, err := session.Answers(path)
	if err != nil {
		return fmt.Errorf("producer: probe existing socket %s: %w", path, err)
	}
	if live {
		return fmt.Errorf("%w: %s", ErrAddressInUse, path)
	}
	if err := os.Remove(path); err != nil && !errors.Is(err, fs.ErrNotExist) {
		return fmt.Errorf("producer: remove stale socket %s: %w", path, err)
	}
	return nil
}

// remove closes the listener and removes the socket file if it is still the one this
// listener created.
func (s *socketFile) remove() error {
	if s.unlocal != nil {
		s.unlocal()
	}
	err := s.UnixListener.Close()
	if info, lerr := os.Lstat(s.path); lerr == nil && os.SameFile(info, s.info) {
		if rerr := os.Remove(s.path); rerr != nil {
			err = errors.Join(err, rerr)
		}
	}
	return err
}
