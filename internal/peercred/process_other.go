//go:build !linux

package peercred

import "fmt"

// OpenProcess fails with ErrUnsupported: only Linux's pidfds are used.
func OpenProcess(pid int) (*Process, error) {
	return nil, fmt.Errorf("%w: no process handle for pid %d", ErrUnsupported, pid)
}
