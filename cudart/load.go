package cudart

import (
	"os"
	"strings"
	"sync"
)

// LibraryEnv names the environment variable that, when set, is the one CUDA runtime
// library Load tries instead of its default search. WithLibrary wins over it.
const LibraryEnv = "CUDAPOOL_CUDART"

// DefaultLibraries are the CUDA runtime libraries Load tries, in order, when neither
// WithLibrary nor CUDAPOOL_CUDART names one.
var DefaultLibraries = []string{"libcudart.so.13", "libcudart.so.12"}

// DefaultDriverLibrary is the CUDA driver library Load opens when WithDriverLibrary
// names none. It provides what the runtime API lacks: allocation granularity and UUIDs.
const DefaultDriverLibrary = "libcuda.so.1"

// LoadOption changes where Load looks for the CUDA libraries.
type LoadOption func(*loadConfig)

type loadConfig struct {
	library       string
	driverLibrary string
}

// WithLibrary makes Load try only the CUDA runtime library at path (a file name the
// dynamic loader searches for, or a path with a slash).
func WithLibrary(path string) LoadOption {
	return func(c *loadConfig) { c.library = path }
}

// WithDriverLibrary makes Load open the CUDA driver library at path instead of
// libcuda.so.1.
func WithDriverLibrary(path string) LoadOption {
	return func(c *loadConfig) { c.driverLibrary = path }
}

// runtimeCandidates lists the runtime libraries to try, in order.
func (c *loadConfig) runtimeCandidates() []string {
	if c.library != "" {
		return []string{c.library}
	}
	if env := os.Getenv(LibraryEnv); env != "" {
		return []string{env}
	}
	return DefaultLibraries
}

func (c *loadConfig) driverCandidate() string {
	if c.driverLibrary != "" {
		return c.driverLibrary
	}
	return DefaultDriverLibrary
}

// Load opens the CUDA runtime and driver libraries and resolves every symbol cudapool
// uses, so that a missing one is reported here rather than at its first call.
//
// The runtime library is the one WithLibrary names, else the one CUDAPOOL_CUDART names,
// else the first of libcudart.so.13 and libcudart.so.12 that opens with every symbol;
// the driver library is the one WithDriverLibrary names, else libcuda.so.1.
//
// On success the Runtime is the process's one for that pair of libraries: a later Load
// that finds the same libraries returns the same Runtime, and libraries are never
// unloaded. On failure the error is a *LoadError, wrapping ErrNoRuntime, that names
// every library tried and why each failed (the loader's message, or the missing
// symbols); nothing stays loaded. A build without cgo, or for an OS other than Linux,
// always fails so.
//
// A program that should run without a GPU too, on the cudarttest software device, calls
// choose.Runtime (package cudart/choose) instead: it calls Load, and falls back with
// one line saying why.
func Load(opts ...LoadOption) (Runtime, error) {
	var c loadConfig
	for _, o := range opts {
		if o != nil {
			o(&c)
		}
	}
	key := strings.Join(c.runtimeCandidates(), "\x00") + "\x00\x00" + c.driverCandidate()
	v, _ := loads.LoadOrStore(key, new(loadOnce))
	l := v.(*loadOnce)
	l.once.Do(func() { l.rt, l.err = load(&c) })
	return l.rt, l.err
}

// loads maps the libraries a Load looked for to the outcome of looking, so that each
// set of libraries is opened once per process.
var loads sync.Map

type loadOnce struct {
	once sync.Once
	rt   Runtime
	err  error
}
