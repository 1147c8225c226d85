package main

import (
	"bufio"
	"context"
	"net"
	"path/filepath"
	"strconv"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/cudapool/cudapool/internal/proctest"
	"github.com/cudapool/cudapool/internal/testlog"
	"github.com/cudapool/cudapool/internal/testwait"
	"github.com/cudapool/cudapool/kv/owner"
)

// A keeper holds descriptors alone (runKeeper has no runtime to make): it serves
// keep.sock, whatever slab flags it is given, and stops when told, with status 0.
func TestKeeperOfDescriptorsMakesNoRuntime(t *testing.T) {
	dir := shortDir(t)
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	var out, errOut testlog.Buffer
	exited := make(chan int, 1)
	go func() {
		exited <- runKeeper(ctx, []string{"-dir", dir, "-keeper-idle", "1h", "-layout", "llama-0.85b", "-pages", "8"}, &out, &errOut)
	}()
	path := filepath.Join(dir, owner.KeepSocket)
	require.Eventually(t, func() bool {
		c, err := net.Dial("unix", path)
		if err == nil {
			_ = c.Close()
		}
		return err == nil
	}, testwait.Bound, time.Millisecond, "the keeper's socket")
	cancel()
	assert.Equal(t, exitOK, testwait.Recv(t, exited, "the keeper's stop"), errOut.String())
}

// A keeper of descriptors to which no kvpoold has connected for -keeper-idle exits by
// itself and says why.
func TestKeeperOfDescriptorsExitsWhenIdle(t *testing.T) {
	var out, errOut testlog.Buffer
	code := runKeeper(context.Background(), []string{"-dir", shortDir(t), "-keeper-idle", "20ms"}, &out, &errOut)
	assert.Equal(t, exitOK, code, errOut.String())
	assert.Contains(t, errOut.String(), "no kvpoold has been connected to")
}

// The keeper killed, kvpoold says that the cache and the host tiers' memory went with
// it, and exits 1.
func TestKvpooldSaysTheKeeperDied(t *testing.T) {
	dir := shortDir(t)
	var errOut testlog.Buffer
	cmd := proctest.Command(t, "kvpoold", append(restartArgs(dir, 8), "-host-bytes", "8MiB")...)
	cmd.Stderr = &errOut
	stdout, err := cmd.StdoutPipe()
	require.NoError(t, err)
	require.NoError(t, cmd.Start())
	first := make(chan string, 1)
	go func() {
		sc := bufio.NewScanner(stdout)
		sc.Scan()
		first <- sc.Text()
		for sc.Scan() {
		}
	}()
	line := testwait.Recv(t, first, "kvpoold's first line")
	m := keeperPID.FindStringSubmatch(line)
	require.NotNil(t, m, line)
	pid, err := strconv.Atoi(m[1])
	require.NoError(t, err)
	killKeeper(t, pid)
	waited := make(chan error, 1)
	go func() { waited <- cmd.Wait() }()
	err = testwait.Recv(t, waited, "kvpoold's exit once its keeper died")
	assert.Equal(t, exitFailed, cmd.ProcessState.ExitCode(), "%v", err)
	assert.Contains(t, errOut.String(), "the keeper is gone, and with it the chunks and the host tiers' memory it kept")
	assert.Contains(t, errOut.String(), "kvpoold: the keeper (pid "+m[1]+") is gone, and the cache with it")
}
