// Package testwait owns the bound on waits in cudapool's tests: a wait that does not
// end fails its test, saying what it waited for, instead of hanging the package until
// go test's timeout and hiding every later result.
package testwait

import (
	"testing"
	"time"
)

// Bound is how long a test waits for anything before it fails. It only ends a test
// that hangs; no test depends on it passing.
const Bound = 60 * time.Second

// Recv receives from ch, as the test's goroutine. If nothing comes (and ch is not
// closed) within Bound, it fails t with what, and returns the zero value.
func Recv[T any](t testing.TB, ch <-chan T, what string) T {
	t.Helper()
	return recvWithin(t, ch, what, Bound)
}

func recvWithin[T any](t testing.TB, ch <-chan T, what string, bound time.Duration) T {
	t.Helper()
	timer := time.NewTimer(bound)
	defer timer.Stop()
	select {
	case v := <-ch:
		return v
	case <-timer.C:
		t.Fatalf("gave up after %v waiting for %s", bound, what)
		panic("unreachable")
	}
}
