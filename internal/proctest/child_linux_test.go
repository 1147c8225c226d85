package proctest

import (
	"bytes"
	"errors"
	"fmt"
	"os"
	"testing"

	"golang.org/x/sys/unix"
)

// A killed child stays a zombie until Wait reaps it.
func TestKillLeavesAZombieUntilWait(t *testing.T) {
	c := Start(t, "echo")
	c.Expect("ready ")
	c.Kill()
	// WNOWAIT: wait for the exit, reaping nothing.
	var info unix.Siginfo
	if err := unix.Waitid(unix.P_PID, c.PID(), &info, unix.WEXITED|unix.WNOWAIT, nil); err != nil {
		t.Fatal(err)
	}
	stat := fmt.Sprintf("/proc/%d/stat", c.PID())
	b, err := os.ReadFile(stat)
	if err != nil {
		t.Fatalf("killed child not left as a zombie: %v", err)
	}
	// The state follows the last ')': the command name may hold one.
	if i := bytes.LastIndexByte(b, ')'); i < 0 || i+2 >= len(b) || b[i+2] != 'Z' {
		t.Fatalf("killed child's state: %s, want Z", b)
	}
	if err := c.Wait(); err == nil {
		t.Fatal("Wait after SIGKILL = nil, want the signal")
	}
	if _, err := os.Stat(stat); !errors.Is(err, os.ErrNotExist) {
		t.Fatalf("after Wait %s: %v, want it gone", stat, err)
	}
}
