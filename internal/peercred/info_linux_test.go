package peercred

import (
	"os/exec"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

func TestLookupShowsCommandAndStart(t *testing.T) {
	before := time.Now()
	cmd := exec.Command("sleep", "60")
	require.NoError(t, cmd.Start())
	after := time.Now()
	t.Cleanup(func() { _ = cmd.Process.Kill(); _ = cmd.Wait() }) // test cleanup

	info, err := Lookup(cmd.Process.Pid)
	require.NoError(t, err)
	assert.Equal(t, "sleep", info.Command)
	// The kernel counts in 10 ms ticks and the boot time in whole seconds.
	assert.WithinRange(t, info.Started, before.Add(-time.Second-10*time.Millisecond), after.Add(time.Second+10*time.Millisecond))

	require.NoError(t, cmd.Process.Kill())
	_ = cmd.Wait() // reaped: the pid names nothing
	_, err = Lookup(cmd.Process.Pid)
	assert.ErrorIs(t, err, ErrGone)
}

func TestLookupRefusesPidsItCannotSee(t *testing.T) {
	for _, pid := range []int{0, -1} {
		_, err := Lookup(pid)
		assert.Error(t, err, "pid %d", pid)
	}
}

func TestParseStat(t *testing.T) {
	// A command name may hold spaces and parentheses: it ends at the last ')'.
	stat := "4242 (a) b (c) S 1 4242 4242 0 -1 4194560 100 0 0 0 0 0 0 0 20 0 1 0 987654 1000 100\n"
	command, ticks, err := parseStat([]byte(stat))
	require.NoError(t, err)
	assert.Equal(t, "a) b (c", command)
	assert.Equal(t, uint64(987654), ticks)

	for _, bad := range []string{"", "4242 no-parens S 1", "4242 (x) S 1 2 3", "4242 (x) S 1 4242 4242 0 -1 4194560 100 0 0 0 0 0 0 0 20 0 1 0 NaN 1"} {
		_, _, err := parseStat([]byte(bad))
		assert.Error(t, err, "%q", bad)
	}
}
