package cudarttest

import (
	"fmt"

	"golang.org/x/sys/unix"
)

// memfdCreate creates an empty memfd named name, closed on exec.
func memfdCreate(name string) (int, error) {
	fd, err := unix.MemfdCreate(name, unix.MFD_CLOEXEC)
	if err != nil {
		return -1, fmt.Errorf("memfd_create: %w", err)
	}
	return fd, nil
}

// punchHole gives the pages of n bytes at off of fd back to the kernel, keeping the
// file's size. It is best effort: pages it cannot give back only cost memory.
func punchHole(fd int, off, n int64) {
	_ = unix.Fallocate(fd, unix.FALLOC_FL_PUNCH_HOLE|unix.FALLOC_FL_KEEP_SIZE, off, n) // best effort, as above
}
