// Package privdir owns one check: that a directory where sockets and announcements go
// is private to this user, so that no other user can plant or remove files in it.
// export applies it to its announce directory, when it writes there (Check) and when it
// reads there (Inspect: a directory another user made first, under a name this user
// would have used, is theirs to fill); the examples, to the directory they put their
// sockets in. ReadRegular reads a file found in such a directory without following a
// link or blocking on a FIFO another process put there.
package privdir

import (
	"errors"
	"fmt"
	"io"
	"os"
	"syscall"

	"golang.org/x/sys/unix"
)

// Check creates dir with mode 0700 if it is missing, and checks that it is a directory
// (not a link to one) owned by this user and writable by nobody else. reason says why
// dir is not private, "" if it is; err, why it could not be created or examined.
func Check(dir string) (reason string, err error) {
	if err := os.MkdirAll(dir, 0o700); err != nil {
		return "", fmt.Errorf("create %s: %w", dir, err)
	}
	return Inspect(dir)
}

// Inspect is Check without the creation: a missing dir is an error wrapping
// fs.ErrNotExist.
func Inspect(dir string) (reason string, err error) {
	info, err := os.Lstat(dir)
	if err != nil {
		return "", err
	}
	if !info.IsDir() {
		return fmt.Sprintf("%s is a %v, not a directory", dir, info.Mode().Type()), nil
	}
	if st, ok := info.Sys().(*syscall.Stat_t); ok && int(st.Uid) != os.Getuid() {
		return fmt.Sprintf("%s is owned by uid %d, not %d", dir, st.Uid, os.Getuid()), nil
	}
	if perm := info.Mode().Perm(); perm&0o022 != 0 {
		return fmt.Sprintf("%s has mode %v: group or others can write to it", dir, perm), nil
	}
	return "", nil
}

// Ensure is Check with the reason as an error.
func Ensure(dir string) error {
	reason, err := Check(dir)
	if err == nil && reason != "" {
		err = errors.New("directory is not private: " + reason)
	}
	return err
}

// ReadRegular reads the file at path if it is a regular file of at most limit bytes.
// It opens path without following a link and without blocking (a FIFO would wait for
// a writer), and reports false, reading nothing, for anything but a regular file.
func ReadRegular(path string, limit int64) ([]byte, bool, error) {
	fd, err := unix.Open(path, unix.O_RDONLY|unix.O_NONBLOCK|unix.O_NOFOLLOW|unix.O_CLOEXEC|unix.O_NOCTTY, 0)
	switch {
	case errors.Is(err, unix.ELOOP):
		return nil, false, nil // a symbolic link
	case err != nil:
		return nil, true, err
	}
	f := os.NewFile(uintptr(fd), path)
	defer func() { _ = f.Close() }() // read only: a failed close loses nothing
	info, err := f.Stat()
	switch {
	case err != nil:
		return nil, true, err
	case !info.Mode().IsRegular():
		return nil, false, nil
	case info.Size() > limit:
		return nil, true, fmt.Errorf("%d bytes, more than %d", info.Size(), limit)
	}
	body, err := io.ReadAll(io.LimitReader(f, limit+1))
	if err == nil && int64(len(body)) > limit {
		err = fmt.Errorf("more than %d bytes", limit)
	}
	return body, true, err
}
