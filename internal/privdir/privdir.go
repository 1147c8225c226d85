// Package privdir owns one check: that a directory where sockets and announcements go
// is private to this user, so that no other user can plant or remove files in it.
// export applies it to its announce directory, when it writes there (Check) and when it
// reads there (Inspect: a directory another user made first, under a name this user
// would have used, is theirs to fill); the examples, to the directory they put their
// sockets in.
package privdir

import (
	"errors"
	"fmt"
	"os"
	"syscall"
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
