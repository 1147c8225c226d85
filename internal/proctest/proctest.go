// Package proctest owns cudapool's multi-process test harness: a test binary re-executes
// itself as a child in a named role, so tests exchange real file descriptors over real
// sockets between real processes, and drives each child step by step with lines on its
// stdin and stdout.
package proctest

import (
	"os"
	"os/exec"
	"path/filepath"
	"testing"
)

// roleEnv names the role a re-executed test binary plays.
const roleEnv = "CUDAPOOL_PROCTEST_ROLE"

// Main is called from TestMain. When this process was started by Command it runs the
// named role with the arguments Command was given and exits with the role's status;
// otherwise it runs the tests, with the announce directory trapped (see TrapAnnounceDir).
// A role name that is not in roles exits with status 2.
func Main(m *testing.M, roles map[string]func(args []string) int) {
	role, ok := os.LookupEnv(roleEnv)
	if !ok {
		os.Exit(TrapAnnounceDir(m))
	}
	run, ok := roles[role]
	if !ok {
		_, _ = os.Stderr.WriteString("proctest: unknown role " + role + "\n") // nowhere else to report it
		os.Exit(2)
	}
	os.Exit(run(os.Args[1:]))
}

// announceDirEnv is discover.DirEnv, which overrides the default announce directory
// (proctest cannot import discover: cudart's own tests use proctest).
const announceDirEnv = "CUDAPOOL_DIR"

// trapName is the last element of the trapped announce directory: what the error of a
// test that announces there names.
const trapName = "tests-announce-in-a-directory-of-their-own"

// TrapAnnounceDir runs m's tests with the default announce directory ($CUDAPOOL_DIR,
// discover.DefaultDir) set to a path that cannot be made, under a regular file, and
// returns their status. A test, or a process it starts (they inherit the
// environment), that announces an exporter without a directory of its own then fails
// to listen, the error naming trapName, instead of leaving announcements of killed
// processes in the user's real directory, which poolstat would list. A test that
// announces sets its own: t.Setenv(discover.DirEnv, t.TempDir()), or
// producer.WithAnnounce, owner.WithAnnounceDir, or WithoutAnnounce. Main calls it; a
// package whose TestMain does not call Main calls it itself.
func TrapAnnounceDir(m *testing.M) int {
	tmp, err := os.MkdirTemp("", "proctest-trap-")
	if err != nil {
		_, _ = os.Stderr.WriteString("proctest: " + err.Error() + "\n") // nowhere else to report it
		return 1
	}
	defer func() { _ = os.RemoveAll(tmp) }() // cleanup: a temp dir left behind is harmless
	file := filepath.Join(tmp, "not-a-directory")
	if err := os.WriteFile(file, nil, 0o600); err != nil {
		_, _ = os.Stderr.WriteString("proctest: " + err.Error() + "\n") // nowhere else to report it
		return 1
	}
	if err := os.Setenv(announceDirEnv, filepath.Join(file, trapName)); err != nil {
		_, _ = os.Stderr.WriteString("proctest: " + err.Error() + "\n") // nowhere else to report it
		return 1
	}
	return m.Run()
}

// IsChild reports whether this process is a role started by Command.
func IsChild() bool {
	_, ok := os.LookupEnv(roleEnv)
	return ok
}

// Command returns, unstarted, this test binary re-executed in role with args. The
// child inherits the environment and writes to the test's stderr; the caller may set
// ExtraFiles (fd 3 onwards in the child), Stdin, Stdout and more before starting it.
// The child is killed when the test ends if it is still running.
func Command(t testing.TB, role string, args ...string) *exec.Cmd {
	t.Helper()
	exe, err := os.Executable()
	if err != nil {
		t.Fatalf("proctest: %v", err)
	}
	cmd := exec.Command(exe, args...)
	// Under -race every process sleeps a second at exit unless told not to; children
	// are many and short-lived.
	cmd.Env = append(os.Environ(), roleEnv+"="+role, "GORACE=atexit_sleep_ms=0")
	cmd.Stderr = os.Stderr
	t.Cleanup(func() {
		if cmd.Process != nil && cmd.ProcessState == nil {
			_ = cmd.Process.Kill() // the child may have exited already
			_ = cmd.Wait()         // only its exit matters here
		}
	})
	return cmd
}
