package proctest

import (
	"fmt"
	"os/exec"
	"strings"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

func TestMain(m *testing.M) {
	Main(m, map[string]func([]string) int{"echo": echoRole, "announce-dir": announceDirRole})
}

// echoRole says "ready ARGS", then answers each command with "echo COMMAND"; the command
// "fail" makes it exit with status 3.
func echoRole(args []string) int {
	fmt.Println("ready", strings.Join(args, " "))
	for line := range Commands() {
		if line == "fail" {
			return 3
		}
		fmt.Println("echo", line)
	}
	return 0
}

func TestChildLineProtocol(t *testing.T) {
	c := Start(t, "echo", "a", "b")
	c.Expect("ready a b")
	c.Send("one")
	c.Send("two")
	require.Equal(t, "echo one", c.Next())
	c.Expect("echo two")
	c.Finish()
}

func TestChildExitStatus(t *testing.T) {
	c := Start(t, "echo")
	c.Expect("ready ")
	c.Send("fail")
	var exit *exec.ExitError
	err := c.Wait()
	require.ErrorAs(t, err, &exit, "Wait, want exit status 3")
	assert.Equal(t, 3, exit.ExitCode(), "Wait = %v", err)
}
