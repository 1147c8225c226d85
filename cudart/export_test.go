package cudart

import "errors"

// CurrentDevice is the current device of the calling OS thread in the runtime rt
// loaded (cudaGetDevice), so that a test can check which calls change it. Lock the
// goroutine to its thread around the calls it checks.
func CurrentDevice(rt Runtime) (int, error) {
	l, ok := rt.(interface{ currentDevice() (int, error) })
	if !ok {
		return 0, errors.New("cudart: CurrentDevice needs a loaded runtime")
	}
	return l.currentDevice()
}
