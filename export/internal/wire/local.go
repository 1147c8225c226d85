package wire

import (
	"os"
	"reflect"
	"sync"
	"syscall"

	"github.com/cudapool/cudapool/cudart"
)

// The exporters of this process, by the socket file each listens on, with the runtime
// each shares memory through: an Importer dialing one of them on the same runtime is
// the process that made its pools and events, which CUDA does not import.
var local sync.Map // localKey -> struct{}

type localKey struct {
	dev, ino uint64
	rt       cudart.Runtime
}

// fileKey is the device and inode of a file, false where info has none.
func fileKey(info os.FileInfo) (dev, ino uint64, ok bool) {
	st, ok := info.Sys().(*syscall.Stat_t)
	if !ok {
		return 0, 0, false
	}
	return uint64(st.Dev), st.Ino, true
}

// AddLocal records that this process exports through rt on the socket file info
// describes, and returns what removes the record.
func AddLocal(info os.FileInfo, rt cudart.Runtime) (remove func()) {
	dev, ino, ok := fileKey(info)
	if !ok || rt == nil || !reflect.TypeOf(rt).Comparable() {
		return func() {}
	}
	k := localKey{dev, ino, rt}
	local.Store(k, struct{}{})
	return func() { local.Delete(k) }
}

// IsLocal reports whether the socket at path is one this process exports through rt.
func IsLocal(path string, rt cudart.Runtime) bool {
	if rt == nil || !reflect.TypeOf(rt).Comparable() {
		return false
	}
	info, err := os.Stat(path)
	if err != nil {
		return false
	}
	dev, ino, ok := fileKey(info)
	if !ok {
		return false
	}
	_, found := local.Load(localKey{dev, ino, rt})
	return found
}
