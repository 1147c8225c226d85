package proctest

import (
	"bytes"
	"fmt"
	"os"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"golang.org/x/sys/unix"
)

// A killed child stays a zombie until Wait reaps it.
func TestKillLeavesAZombieUntilWait(t *testing.T) {
	c := Start(t, "echo")
	c.Expect("ready ")
	c.Kill()
	// WNOWAIT: wait for the exit, reaping nothing.
	var info unix.Siginfo
	require.NoError(t, unix.Waitid(unix.P_PID, c.PID(), &info, unix.WEXITED|unix.WNOWAIT, nil))
	stat := fmt.Sprintf("/proc/%d/stat", c.PID())
	b, err := os.ReadFile(stat)
	require.NoError(t, err, "killed child not left as a zombie")
	// The state follows the last ')': the command name may hold one.
	i := bytes.LastIndexByte(b, ')')
	require.True(t, i >= 0 && i+2 < len(b) && b[i+2] == 'Z', "killed child's state: %s, want Z", b)
	require.Error(t, c.Wait(), "Wait after SIGKILL, want the signal")
	assert.NoFileExists(t, stat, "after Wait")
}
