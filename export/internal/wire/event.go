package wire

import (
	"github.com/cudapool/cudapool/cudart"
)

// Completed reports whether the work captured by e, an event of this process or an
// IPC event of another, has completed already. Both sides ask before making a stream
// wait on the other process's event: the wait is then needless, and each one left out
// is a dependency between two processes' GPU work that the driver would otherwise have
// to resolve before later work on that stream, such as the frees an Open of a record
// released earlier has to wait for. The last record of the event covers the work the
// caller needs ordered (it was recorded before the message that led here was sent), so
// a completed query covers it too. An error counts as not completed: the caller then
// waits, as it would have.
func Completed(rt cudart.Runtime, dev int, e cudart.Event) bool {
	done, err := rt.EventQuery(dev, e)
	return err == nil && done
}
