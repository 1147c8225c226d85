package peercred

import (
	"context"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"syscall"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/cudapool/cudapool/internal/proctest"
)

func TestMain(m *testing.M) {
	proctest.Main(m, map[string]func([]string) int{"idle": idleRole})
}

// idleRole says "idle" and waits for the end of its stdin.
func idleRole([]string) int {
	fmt.Println("idle")
	for range proctest.Commands() {
	}
	return 0
}

// hangGuard bounds waits that only a bug makes long.
const hangGuard = time.Minute

func openProcess(t *testing.T, pid int) *Process {
	t.Helper()
	p, err := OpenProcess(pid)
	if errors.Is(err, ErrUnsupported) {
		t.Skip(err)
	}
	require.NoError(t, err)
	t.Cleanup(func() { _ = p.Close() }) // test cleanup
	return p
}

// Wait returns once the process has exited, before it is reaped, and only then.
func TestWaitReturnsWhenTheProcessExits(t *testing.T) {
	c := proctest.Start(t, "idle")
	c.Expect("idle")
	p := openProcess(t, c.PID())
	require.Equal(t, c.PID(), p.PID())
	// The child waits on its stdin, so it is running: Wait must give up with ctx.
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	require.ErrorIs(t, p.Wait(ctx), context.Canceled, "Wait on a running process with an ended ctx")
	ctx, cancel = context.WithCancel(context.Background())
	waited := make(chan error, 1)
	go func() { waited <- p.Wait(ctx) }()
	cancel()
	require.ErrorIs(t, receive(t, waited), context.Canceled, "Wait on a running process whose ctx ended meanwhile")

	// Killed and not reaped, a zombie: it has exited. A Wait after a cancelled one
	// still waits.
	c.Kill()
	ctx, cancel = context.WithTimeout(context.Background(), hangGuard)
	defer cancel()
	require.NoError(t, p.Wait(ctx), "Wait on a killed process")
	// Its parent reaps it now, and learns it was killed: Wait reaped nothing.
	var exit *exec.ExitError
	err := c.Wait()
	require.ErrorAs(t, err, &exit, "reaping the child, want killed by SIGKILL")
	require.Equal(t, syscall.SIGKILL, exit.Sys().(syscall.WaitStatus).Signal(), "reaping the child: %v", err)
	require.NoError(t, p.Wait(ctx), "Wait after the process was reaped")
}

func TestOpenProcessRefusesWhatCannotBeWatched(t *testing.T) {
	c := proctest.Start(t, "idle")
	c.Expect("idle")
	c.Finish()
	_, err := OpenProcess(c.PID())
	if !errors.Is(err, ErrUnsupported) {
		require.ErrorIs(t, err, ErrGone, "OpenProcess of a reaped child")
	}
	_, err = OpenProcess(0)
	require.Error(t, err, "OpenProcess(0)")
}

func TestCloseEndsAWait(t *testing.T) {
	p := openProcess(t, os.Getpid())
	waited := make(chan error, 1)
	go func() { waited <- p.Wait(context.Background()) }()
	_ = p.Close() // test cleanup
	require.Error(t, receive(t, waited), "Wait on our own process returned nil after Close")
}

// receive takes what a Wait returned, failing the test if it does not return.
func receive(t *testing.T, waited <-chan error) error {
	t.Helper()
	select {
	case err := <-waited:
		return err
	case <-time.After(hangGuard):
		t.Fatal("Wait did not return")
		return nil
	}
}
