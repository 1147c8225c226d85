//go:build !cgo || !linux

package cudart

import "runtime"

// load cannot open a C library in this build: the binding is cgo on Linux.
func load(*loadConfig) (Runtime, error) {
	why := "cudapool was built without cgo (CGO_ENABLED=0), which the CUDA binding needs"
	if runtime.GOOS != "linux" {
		why = "the CUDA binding supports only Linux, not " + runtime.GOOS
	}
	return nil, &LoadError{Tried: []string{why}}
}
