//go:build !linux

package cudarttest

import (
	"errors"
	"runtime"
)

// memfdCreate fails: the software device's memory is memfds, which only Linux has. The
// package builds elsewhere so that code importing it compiles; a Device there cannot
// create a pool.
func memfdCreate(string) (int, error) {
	return -1, errors.New("cudarttest: the software device needs Linux (memfd_create), not " + runtime.GOOS)
}

// punchHole does nothing: no region exists to give pages back from.
func punchHole(int, int64, int64) {}
