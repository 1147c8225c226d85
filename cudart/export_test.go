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

// ForceBatchPath makes MemcpyBatchAsync of rt, a loaded runtime, copy by path p on
// every device, so that a test can check each fallback on a GPU.
func ForceBatchPath(rt Runtime, p CopyPath) error {
	l, ok := rt.(*library)
	if !ok {
		return errors.New("cudart: ForceBatchPath needs a loaded runtime")
	}
	l.batchMu.Lock()
	defer l.batchMu.Unlock()
	l.forcePath, l.batch = p, nil
	return nil
}
