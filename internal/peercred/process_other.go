//go:build !linux

package peercred

import "fmt"

// OpenProcess fails with ErrUnsupported: only Linux's pidfds are used.
func OpenProcess(pid int) (*Process, error) {
	return nil, fmt.Errorf("%w: no process handle for pid %d", ErrUnsupported, pid)
}

// Lookup fails with ErrUnsupported: only Linux's /proc is read.
func Lookup(pid int) (Info, error) {
	return Info{}, fmt.Errorf("%w: no process information for pid %d", ErrUnsupported, pid)
}
