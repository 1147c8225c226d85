package proctest

import (
	"bufio"
	"fmt"
	"io"
	"iter"
	"os"
	"os/exec"
	"sync"
	"syscall"
	"testing"
	"time"
)

// lineTimeout bounds how long Next waits for a child's line. It only ends a test whose
// child hangs; no test depends on it passing.
const lineTimeout = time.Minute

// Child is a role started by Start and driven line by line: the test sends commands to
// the child's stdin with Send, and the child answers with lines on its stdout, which the
// test reads with Next or Expect. On the child's side, Commands reads the commands.
type Child struct {
	t     testing.TB
	name  string // role and arguments, for messages
	cmd   *exec.Cmd
	in    io.WriteCloser
	lines chan string // the child's stdout, line by line; closed when it ends
	// unread is closed once no more lines will be read (Wait, or the test's end), so
	// that the reader does not wait forever to hand one over.
	unread     chan struct{}
	stopReader sync.Once
}

// Start starts this test binary in role with args, its stdin and stdout connected to
// the returned Child and its stderr to the test's. A child still running when the test
// ends is killed and reaped. Start fails the test if the child cannot start.
func Start(t testing.TB, role string, args ...string) *Child {
	t.Helper()
	cmd := Command(t, role, args...)
	in, err := cmd.StdinPipe()
	if err != nil {
		t.Fatal(err)
	}
	out, err := cmd.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	c := &Child{t: t, name: fmt.Sprintf("child %s %q", role, args), cmd: cmd, in: in,
		lines: make(chan string), unread: make(chan struct{})}
	go c.read(out)
	t.Cleanup(c.dropLines)
	return c
}

func (c *Child) dropLines() { c.stopReader.Do(func() { close(c.unread) }) }

func (c *Child) read(out io.Reader) {
	defer close(c.lines)
	sc := bufio.NewScanner(out)
	for sc.Scan() {
		select {
		case c.lines <- sc.Text():
		case <-c.unread:
			return
		}
	}
}

// PID is the child's process id.
func (c *Child) PID() int { return c.cmd.Process.Pid }

// Send writes line to the child's stdin; the test fails if the child no longer reads.
func (c *Child) Send(line string) {
	c.t.Helper()
	if _, err := io.WriteString(c.in, line+"\n"); err != nil {
		c.t.Fatalf("proctest: send %q to %s: %v", line, c.name, err)
	}
}

// Next returns the child's next line. The test fails if the child ends first, or says
// nothing for a minute (a hang).
func (c *Child) Next() string {
	c.t.Helper()
	hang := time.NewTimer(lineTimeout)
	defer hang.Stop()
	select {
	case line, ok := <-c.lines:
		if ok {
			return line
		}
		c.t.Fatalf("proctest: %s ended without a word more: %v", c.name, c.Wait())
	case <-hang.C:
		c.t.Fatalf("proctest: %s said nothing for %v", c.name, lineTimeout)
	}
	return "" // not reached: Fatalf ends the test
}

// Expect fails the test unless the child's next line is want.
func (c *Child) Expect(want string) {
	c.t.Helper()
	if got := c.Next(); got != want {
		c.t.Fatalf("proctest: %s said %q, want %q", c.name, got, want)
	}
}

// Finish closes the child's stdin, which tells it to end, and waits for it to exit;
// the test fails unless it exits with status 0.
func (c *Child) Finish() {
	c.t.Helper()
	_ = c.in.Close() // cleanup: nothing is left to do if closing fails
	if err := c.Wait(); err != nil {
		c.t.Fatalf("proctest: %s: %v", c.name, err)
	}
}

// Kill sends the child SIGKILL and does not reap it: until Wait it is a zombie, which
// is how a dying process looks to everyone but its parent.
func (c *Child) Kill() {
	c.t.Helper()
	if err := c.cmd.Process.Signal(syscall.SIGKILL); err != nil {
		c.t.Fatalf("proctest: kill %s: %v", c.name, err)
	}
}

// Wait waits for the child to exit, reaps it and returns why it exited, nil for status
// 0. Lines it said that were not read are dropped. Call it once (Finish calls it).
func (c *Child) Wait() error {
	c.dropLines()
	return c.cmd.Wait()
}

// Commands yields, in a child started by Start, the lines the test sends (Child.Send),
// until the test closes the child's stdin (Child.Finish). Answers go back as lines on
// stdout, with fmt.Println.
func Commands() iter.Seq[string] {
	return func(yield func(string) bool) {
		in := bufio.NewScanner(os.Stdin)
		for in.Scan() {
			if !yield(in.Text()) {
				return
			}
		}
	}
}
