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
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { p.Close() })
	return p
}

// Wait returns once the process has exited, before it is reaped, and only then.
func TestWaitReturnsWhenTheProcessExits(t *testing.T) {
	c := proctest.Start(t, "idle")
	c.Expect("idle")
	p := openProcess(t, c.PID())
	if p.PID() != c.PID() {
		t.Fatalf("PID = %d, want %d", p.PID(), c.PID())
	}
	// The child waits on its stdin, so it is running: Wait must give up with ctx.
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	if err := p.Wait(ctx); !errors.Is(err, context.Canceled) {
		t.Fatalf("Wait on a running process with an ended ctx = %v, want context.Canceled", err)
	}
	ctx, cancel = context.WithCancel(context.Background())
	waited := make(chan error, 1)
	go func() { waited <- p.Wait(ctx) }()
	cancel()
	if err := <-waited; !errors.Is(err, context.Canceled) {
		t.Fatalf("Wait on a running process whose ctx ended meanwhile = %v, want context.Canceled", err)
	}

	// Killed and not reaped, a zombie: it has exited. A Wait after a cancelled one
	// still waits.
	c.Kill()
	ctx, cancel = context.WithTimeout(context.Background(), hangGuard)
	defer cancel()
	if err := p.Wait(ctx); err != nil {
		t.Fatalf("Wait on a killed process = %v, want nil", err)
	}
	// Its parent reaps it now, and learns it was killed: Wait reaped nothing.
	var exit *exec.ExitError
	if err := c.Wait(); !errors.As(err, &exit) || exit.Sys().(syscall.WaitStatus).Signal() != syscall.SIGKILL {
		t.Fatalf("reaping the child: %v, want killed by SIGKILL", err)
	}
	if err := p.Wait(ctx); err != nil {
		t.Fatalf("Wait after the process was reaped = %v, want nil", err)
	}
}

func TestOpenProcessRefusesWhatCannotBeWatched(t *testing.T) {
	c := proctest.Start(t, "idle")
	c.Expect("idle")
	c.Finish()
	if _, err := OpenProcess(c.PID()); !errors.Is(err, ErrGone) && !errors.Is(err, ErrUnsupported) {
		t.Fatalf("OpenProcess of a reaped child = %v, want ErrGone", err)
	}
	if _, err := OpenProcess(0); err == nil {
		t.Fatal("OpenProcess(0) succeeded")
	}
}

func TestCloseEndsAWait(t *testing.T) {
	p := openProcess(t, os.Getpid())
	waited := make(chan error, 1)
	go func() { waited <- p.Wait(context.Background()) }()
	p.Close()
	if err := <-waited; err == nil {
		t.Fatal("Wait on our own process returned nil after Close")
	}
}
