package main

import (
	"bufio"
	"context"
	"net"
	"path/filepath"
	"strconv"
	"syscall"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/cudapool/cudapool/internal/peercred"
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
	assert.Contains(t, errOut.String(), "no kvpoold and no replica has been connected to")
}

// A replica that maps the slab holds the keeper: kvpoold killed, the keeper outlives
// -keeper-idle many times over, the next kvpoold adopts the chunks, and the replica
// reattaches with its pages intact; once no kvpoold runs and the last replica closes,
// the keeper frees what it holds and exits. (Failed first: the keeper exited
// -keeper-idle after kvpoold's death, for it counted kvpoolds alone; the replica
// stopped with it, and the next kvpoold's first line said "new cache in keeper pid".)
func TestKeeperStaysWhileAReplicaMapsTheSlab(t *testing.T) {
	dir := shortDir(t)
	const idle = 20 * time.Millisecond
	args := append(restartArgs(dir, 16), "-keeper-idle", idle.String())
	first, line := daemon(t, args...)
	m := keeperPID.FindStringSubmatch(line)
	require.NotNil(t, m, line)
	pid, err := strconv.Atoi(m[1])
	require.NoError(t, err)
	keeper, err := peercred.OpenProcess(pid)
	require.NoError(t, err)
	defer keeper.Close()

	dev, r, s := attach(t, dir)
	ctx := bound(t)
	hashes, pages := sealed(t, ctx, dev, r, s, 3, 61)
	done := r.Done()
	sigkill(t, first)
	testwait.Recv(t, done, "the replica's Done after kvpoold's death")
	// Not a bound on anything: the time an idle keeper of before took fifty times over.
	// The keeper stays however long it is, while the replica is connected.
	time.Sleep(50 * idle)
	require.NoError(t, syscall.Kill(pid, 0), "the keeper is alive while a replica maps its slab")

	second, line := daemon(t, args...)
	assert.Contains(t, line, "cache adopted from keeper pid "+m[1]+": 3 visible pages restored")
	require.NoError(t, r.WaitAttached(ctx))
	got, err := r.Match(ctx, hashes)
	require.NoError(t, err)
	require.Equal(t, pages, got.Pages(), "the pages sealed before kvpoold's death match, where they were")
	checkPages(t, dev, r, s, got.Pages(), pages)
	require.NoError(t, r.Release(ctx, got, s))
	require.NoError(t, dev.StreamSynchronize(0, s))

	done = r.Done()
	sigkill(t, second)
	testwait.Recv(t, done, "the replica's Done after the second kvpoold's death")
	require.NoError(t, syscall.Kill(pid, 0), "the keeper is alive while a replica maps its slab")
	require.NoError(t, r.Close(ctx))
	require.NoError(t, keeper.Wait(ctx), "the keeper's exit once nobody is connected")
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
