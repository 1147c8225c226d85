package peercred

import "errors"

var (
	// ErrUnsupported means this system offers no peer credentials or process handles
	// that cudapool reads: without credentials no peer can be identified, so none should
	// be admitted; without process handles no peer's exit can be watched.
	ErrUnsupported = errors.New("peercred: not supported on this system")
	// ErrGone means the process asked for no longer exists: it has exited and been
	// reaped, so there is nothing left to watch.
	ErrGone = errors.New("peercred: no such process")
)
