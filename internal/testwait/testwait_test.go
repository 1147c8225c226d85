package testwait

import (
	"fmt"
	"testing"

	"github.com/stretchr/testify/require"
)

func TestRecv(t *testing.T) {
	ch := make(chan int, 1)
	ch <- 7
	require.Equal(t, 7, Recv(t, ch, "a value"))
	done := make(chan struct{})
	close(done)
	require.Equal(t, struct{}{}, Recv(t, done, "a closed channel"))
}

// A wait that never ends fails its test with what it waited for. The bound is
// shortened through a fake TB whose Fatalf records the message.
func TestRecvFailsSaying(t *testing.T) {
	ft := &fatalTB{TB: t}
	done := make(chan struct{})
	go func() {
		defer close(done)
		defer func() { _ = recover() }() // Fatalf's stand-in stops the goroutine with a panic
		recvWithin(ft, make(chan int), "the answer", 0)
	}()
	Recv(t, done, "the failing wait to end")
	require.Contains(t, ft.msg, "waiting for the answer")
}

// fatalTB records Fatalf's message and stops the goroutine, as testing's Fatalf does.
type fatalTB struct {
	testing.TB
	msg string
}

func (f *fatalTB) Helper() {}

func (f *fatalTB) Fatalf(format string, args ...any) {
	f.msg = fmt.Sprintf(format, args...)
	panic(f.msg)
}
