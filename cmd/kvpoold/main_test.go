package main

import (
	"bufio"
	"bytes"
	"context"
	"io"
	"os"
	"os/exec"
	"os/signal"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/cudapool/cudapool/cudart/cudarttest"
	"github.com/cudapool/cudapool/export/discover"
	"github.com/cudapool/cudapool/internal/proctest"
	"github.com/cudapool/cudapool/internal/testlog"
	"github.com/cudapool/cudapool/internal/testwait"
	"github.com/cudapool/cudapool/kv"
	"github.com/cudapool/cudapool/kv/replica"
)

// started runs kvpoold with args until the test stops it, once it has said where it
// serves.
func started(t *testing.T, args ...string) (stop func() (int, string, string)) {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	var out, errOut testlog.Buffer
	done := make(chan int, 1)
	go func() { done <- run(ctx, args, &out, &errOut) }()
	deadline := time.Now().Add(testwait.Bound)
	for !strings.Contains(out.String(), "serving") {
		select {
		case code := <-done:
			cancel()
			t.Fatalf("kvpoold exited with %d before serving\nstdout: %s\nstderr: %s", code, &out, &errOut)
		case <-time.After(time.Millisecond):
		}
		if time.Now().After(deadline) {
			t.Fatalf("kvpoold did not serve within %v", testwait.Bound)
		}
	}
	var once sync.Once
	var code int
	stop = func() (int, string, string) {
		once.Do(func() {
			cancel()
			code = testwait.Recv(t, done, "kvpoold to stop")
		})
		return code, out.String(), errOut.String()
	}
	t.Cleanup(func() { stop() })
	return stop
}

// shortDir is a directory for kvpoold to serve in, short enough for its sockets'
// paths, and points the announce directory, where kvpoold and its keeper announce
// their slab exporters, at one of the test's own: announcements of the processes a
// test kills stay out of the user's (TestMain traps the default, proctest.Main).
func shortDir(t *testing.T) string {
	t.Setenv(discover.DirEnv, t.TempDir())
	dir, err := os.MkdirTemp("", "kvpoold")
	require.NoError(t, err)
	t.Cleanup(func() { os.RemoveAll(dir) })
	return dir
}

func TestServesAndStops(t *testing.T) {
	dir := shortDir(t)
	stop := started(t, "-dir", dir, "-runtime", "test", "-layout", "llama-0.85b", "-pages", "256", "-chunk-bytes", "2MiB")

	dev := cudarttest.ForTest(t)
	ctx, cancel := context.WithTimeout(context.Background(), testwait.Bound)
	defer cancel()
	r, err := replica.Dial(ctx, dir, dev, 0)
	require.NoError(t, err)
	want, _ := kv.Layout("llama-0.85b")
	want.Pages = 256
	assert.Equal(t, want, r.Geometry())
	assert.Equal(t, "32 regions of 4.0 MiB, in chunks of 2.0 MiB", r.Layout().String(), "tensors of 4 MiB, 2 chunks each")
	chunks, pages := r.Mapped()
	assert.Equal(t, 32, chunks, "a chunk a tensor at the start")
	assert.Equal(t, 128, pages)
	l, err := r.Alloc(ctx, 4)
	require.NoError(t, err)
	require.NoError(t, r.Release(ctx, l, 0))
	require.NoError(t, r.Close(ctx))

	code, out, errOut := stop()
	require.Equal(t, 0, code, "stdout: %s\nstderr: %s", out, errOut)
	lines := strings.Split(strings.TrimSpace(out), "\n")
	require.Len(t, lines, 2, "one line serving, one stopped:\n%s", out)
	assert.Contains(t, lines[0], "kvpoold: serving "+dir+" on device(s) [0]: 16 layers x 8 kv heads x 64 head dim, bf16, 16 tokens/page, 256 pages, pages of 16 KiB per layer's K or V (a page span of 512 KiB, all layers' K and V), 128 MiB a slab at most (32 regions of 4.0 MiB, in chunks of 2.0 MiB; 64 MiB mapped now), no host tier;")
	assert.Contains(t, lines[0], "software device", "the first line names the runtime")
	assert.Equal(t, "kvpoold: stopped", lines[1])
	_, err = os.Stat(dir + "/kv.sock")
	assert.ErrorIs(t, err, os.ErrNotExist, "the page socket is removed at the stop")
}

func TestSecondOwnerOnALiveDirFails(t *testing.T) {
	dir := shortDir(t)
	started(t, "-dir", dir, "-runtime", "test", "-layout", "llama-0.85b", "-pages", "8")
	var out, errOut bytes.Buffer
	code := run(context.Background(), []string{"-dir", dir, "-runtime", "test", "-layout", "llama-0.85b", "-pages", "8"}, &out, &errOut)
	assert.Equal(t, 1, code)
	assert.Contains(t, errOut.String(), "an owner already serves "+dir)
	assert.Empty(t, out.String())
}

func TestBadCommandLines(t *testing.T) {
	for _, args := range [][]string{
		{"-runtime", "test"},                    // no geometry
		{"-runtime", "test", "-layout", "nope"}, // unknown layout
		{"-runtime", "test", "-layout", "llama-0.85b", "-layers", "2"},
		{"-runtime", "test", "-layers", "2", "-kv-heads", "2", "-head-dim", "8", "-dtype", "int3"},
		{"-runtime", "test", "-layout", "llama-0.85b", "-pages", "4", "-bytes", "1MiB"},
		{"-runtime", "test", "-layout", "llama-0.85b", "-bytes", "1KiB"},
		{"-runtime", "test", "-layout", "llama-0.85b", "-pages", "4", "-devices", "zero"},
		{"-runtime", "test", "-layout", "llama-0.85b", "extra"},
		{"-runtime", "test", "-layout", "llama-0.85b", "-pages", "4", "-host-bytes", "lots"},
		{"-runtime", "test", "-layout", "llama-0.85b"},                                            // neither -pages nor -bytes
		{"-runtime", "test", "-layout", "llama-0.85b", "-pages", "0"},                             // no page
		{"-runtime", "test", "-layout", "llama-0.85b", "-pages", "-3"},                            // no page
		{"-runtime", "test", "-layout", "llama-0.85b", "-bytes", "0"},                             // no page
		{"-runtime", "test", "-layout", "llama-0.85b", "-bytes", "lots"},                          // no size
		{"-runtime", "test", "-layout", "llama-0.85b", "-bytes", "1TiB"},                          // over the most pages a slab has
		{"-runtime", "test", "-layout", "llama-0.85b", "-pages", "64", "-chunk-bytes", "1000KiB"}, // off the granularity
		{"-runtime", "test", "-layout", "llama-0.85b", "-pages", "4", "-chunk-bytes", "0"},
		{"-runtime", "test", "-layout", "llama-0.85b", "-pages", "4", "-initial-bytes", "1KiB"}, // no page
		{"-runtime", "test", "-layout", "llama-0.85b", "-pages", "4", "-handle", "ipc"},
		{"-runtime", "test", "-layout", "llama-0.85b", "-pages", "4", "-handle", "fabric"}, // no IMEX channel on the software device
		{"-runtime", "test", "-layout", "llama-0.85b", "-pages", "4", "-stop-wait", "-1s"},
	} {
		var out, errOut bytes.Buffer
		// Bounded: a command line taken as good serves until the context ends.
		ctx, cancel := context.WithTimeout(context.Background(), testwait.Bound)
		code := run(ctx, append(args, "-dir", shortDir(t)), &out, &errOut)
		cancel()
		assert.Equal(t, 2, code, "%q: stdout %s, stderr %s", args, &out, &errOut)
		assert.NotEmpty(t, errOut.String(), "%q says why", args)
	}
}

// -host-bytes gives the device a host tier, which replicas get at dial; one larger
// than the host's memory is refused at start, saying so, as a bad command line.
func TestHostBytes(t *testing.T) {
	dir := shortDir(t)
	stop := started(t, "-dir", dir, "-runtime", "test", "-layout", "llama-0.85b", "-pages", "8", "-host-bytes", "8MiB")
	dev := cudarttest.ForTest(t)
	ctx, cancel := context.WithTimeout(context.Background(), testwait.Bound)
	defer cancel()
	r, err := replica.Dial(ctx, dir, dev, 0)
	require.NoError(t, err)
	tier, ok := r.HostTier()
	require.True(t, ok, "the replica got no host tier")
	assert.Equal(t, 16, tier.Pages)
	require.NoError(t, r.Close(ctx))
	code, out, errOut := stop()
	require.Equal(t, 0, code, "stdout: %s\nstderr: %s", out, errOut)
	assert.Contains(t, out, "a host tier of 8.0 MiB (16 pages) a device, copies by kernel;")

	var o, e bytes.Buffer
	code = run(context.Background(), []string{"-dir", shortDir(t), "-runtime", "test", "-layout", "llama-0.85b", "-pages", "8", "-host-bytes", "1EiB"}, &o, &e)
	assert.Equal(t, exitUsage, code)
	assert.Contains(t, e.String(), "larger than the host's available memory")
}

func TestBytesMakesWholePages(t *testing.T) {
	g, err := kv.Layout("llama-0.85b")
	require.NoError(t, err)
	got, err := flags{bytes: "8MiB", set: map[string]bool{"bytes": true}}.slabPages(g)
	require.NoError(t, err)
	// A page is 16 layers x K and V x 16 KiB = 512 KiB.
	assert.Equal(t, 16, got.Pages)
	got, err = flags{bytes: "100GiB", set: map[string]bool{"bytes": true}}.slabPages(g)
	require.NoError(t, err)
	assert.Equal(t, 204800, got.Pages)
	assert.Equal(t, uint64(100<<30), got.SlabBytes())
}

// A slab whose start is larger than the device's free memory is refused at start
// (status 1), the message naming both sizes; chunks off the device's granularity are a
// bad command line (status 2), the message naming both; so are FABRIC chunks where the
// driver refuses them (no IMEX channel), the message saying so.
func TestRefusedAtStart(t *testing.T) {
	for _, c := range []struct {
		args []string
		code int
		want string
	}{
		{[]string{"-bytes", "100GiB", "-chunk-bytes", "1GiB"}, 1, "a slab's start of 32 GiB (34359738368 bytes: 32 chunks of 1.0 GiB, 65536 pages of the 204800 at most) is larger than device 0's free memory, 16 GiB (17179869184 bytes, of 16 GiB)"},
		{[]string{"-pages", "64", "-chunk-bytes", "1000KiB"}, 2, "chunks of 1024000 bytes (1000 KiB): not a multiple of device 0's granularity, 2.0 MiB"},
		{[]string{"-pages", "64", "-handle", "fabric"}, 2, "-handle fabric needs an IMEX channel on this host"},
	} {
		var out, errOut bytes.Buffer
		args := append([]string{"-dir", shortDir(t), "-runtime", "test", "-layout", "llama-0.85b"}, c.args...)
		code := run(context.Background(), args, &out, &errOut)
		assert.Equal(t, c.code, code, "%q", c.args)
		assert.Contains(t, errOut.String(), c.want)
		assert.Empty(t, out.String())
	}
}

func TestMain(m *testing.M) {
	// kvpoold's keeper is this test binary in the kvpoold role, "keeper" its first
	// argument.
	keeperCommand = func(args []string) (*exec.Cmd, error) {
		exe, err := os.Executable()
		if err != nil {
			return nil, err
		}
		cmd := exec.Command(exe, args...)
		cmd.Env = append(os.Environ(), "CUDAPOOL_PROCTEST_ROLE=kvpoold", "GORACE=atexit_sleep_ms=0")
		return cmd, nil
	}
	proctest.Main(m, map[string]func(args []string) int{
		// kvpoold is this command as a process of its own, signals and all.
		"kvpoold": func(args []string) int {
			ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
			defer stop()
			return run(ctx, args, os.Stdout, os.Stderr)
		},
		"midseal":     midSealWriter,
		"reattacher":  reattacher,
		"holder":      holder,
		"soakreplica": soakReplica,
	})
}

func TestStopsOnSignals(t *testing.T) {
	for _, sig := range []syscall.Signal{syscall.SIGTERM, syscall.SIGINT} {
		t.Run(sig.String(), func(t *testing.T) {
			dir := shortDir(t)
			cmd := proctest.Command(t, "kvpoold", "-dir", dir, "-runtime", "test", "-layout", "llama-0.85b", "-pages", "8")
			stdout, err := cmd.StdoutPipe()
			require.NoError(t, err)
			require.NoError(t, cmd.Start())
			lines := bufio.NewScanner(stdout)
			first := make(chan string, 1)
			go func() {
				if lines.Scan() {
					first <- lines.Text()
				}
				close(first)
			}()
			assert.Contains(t, testwait.Recv(t, first, "kvpoold's first line"), "kvpoold: serving "+dir)
			require.NoError(t, cmd.Process.Signal(sig))
			rest, _ := io.ReadAll(stdout)
			require.NoError(t, cmd.Wait(), "kvpoold's exit after %v", sig)
			assert.Equal(t, "kvpoold: stopped\n", string(rest))
		})
	}
}

// TestStopWaitsForReplicasToLetGo: at a stop kvpoold tells its replicas at once and
// waits up to -stop-wait for them to unmap its slabs. Replicas that close when told
// make a clean stop, exit status 0.
func TestStopWaitsForReplicasToLetGo(t *testing.T) {
	dir := shortDir(t)
	stop := started(t, "-dir", dir, "-runtime", "test", "-layout", "llama-0.85b", "-pages", "8")
	ctx, cancel := context.WithTimeout(context.Background(), testwait.Bound)
	defer cancel()
	var closed []chan error
	for range 2 {
		r, err := replica.Dial(ctx, dir, cudarttest.ForTest(t), 0) // a runtime each, as two processes
		require.NoError(t, err)
		l, err := r.Alloc(ctx, 1)
		require.NoError(t, err)
		_ = l // held at the stop: the owner ends it
		c := make(chan error, 1)
		go func() {
			<-r.Done() // told the owner stops
			c <- r.Close(ctx)
		}()
		closed = append(closed, c)
	}
	code, out, errOut := stop()
	for _, c := range closed {
		_ = testwait.Recv(t, c, "a replica to close once told") // told a stop, Close reports the owner gone
	}
	assert.Equal(t, 0, code, "a clean stop\nstdout: %s\nstderr: %s", out, errOut)
	assert.Contains(t, out, "kvpoold: stopped")
	assert.Empty(t, errOut)
}

// TestStopWithReplicasHoldingOn: on the VMM route a replica's mapping keeps the slab's
// memory, whatever kvpoold does: a stop with replicas that still map the slab is a
// clean one (0), and each replica is told.
func TestStopWithReplicasHoldingOn(t *testing.T) {
	dir := shortDir(t)
	stop := started(t, "-dir", dir, "-runtime", "test", "-layout", "llama-0.85b", "-pages", "8", "-stop-wait", "100ms")
	dev := cudarttest.ForTest(t)
	ctx, cancel := context.WithTimeout(context.Background(), testwait.Bound)
	defer cancel()
	r, err := replica.Dial(ctx, dir, dev, 0)
	require.NoError(t, err)
	code, out, errOut := stop()
	assert.Equal(t, exitOK, code, "stdout: %s\nstderr: %s", out, errOut)
	testwait.Recv(t, r.Done(), "the replica's Done at the stop")
	require.ErrorIs(t, r.Err(), kv.ErrOwnerGone)
	require.NoError(t, r.Close(ctx), "its slab unmapped: the memory goes back")
}

// TestOwnersPerTrustDomain: the slab, not the namespace, is the unit of trust (every
// replica maps its owner's slab read-write), so trust domains are separated by one
// owner directory each. Two kvpoolds in two directories on one device serve side by
// side, and pages sealed through one are not seen through the other.
func TestOwnersPerTrustDomain(t *testing.T) {
	dirs := []string{shortDir(t), shortDir(t)}
	for _, dir := range dirs {
		started(t, "-dir", dir, "-runtime", "test", "-layout", "llama-0.85b", "-pages", "8", "-devices", "0")
	}
	ctx, cancel := context.WithTimeout(context.Background(), testwait.Bound)
	defer cancel()
	var rs []*replica.Replica
	for _, dir := range dirs {
		r, err := replica.Dial(ctx, dir, cudarttest.ForTest(t), 0)
		require.NoError(t, err)
		t.Cleanup(func() { // before the owners stop: they wait for it
			cctx, ccancel := context.WithTimeout(context.Background(), testwait.Bound)
			defer ccancel()
			assert.NoError(t, r.Close(cctx))
		})
		rs = append(rs, r)
	}
	toks := make([]int32, 2*rs[0].Geometry().TokensPerPage)
	hs := rs[0].Hashes(toks)
	for i, r := range rs {
		l, err := r.Alloc(ctx, 2)
		require.NoError(t, err, "owner %d", i)
		if i == 0 {
			_, err = r.Seal(ctx, l, hs, 0, replica.WaitVisible())
			require.NoError(t, err)
		} else {
			require.NoError(t, r.Release(ctx, l, 0))
		}
	}
	m, err := rs[0].Match(ctx, hs)
	require.NoError(t, err)
	assert.Len(t, m.Pages(), 2, "the owner that sealed them shows them")
	require.NoError(t, rs[0].Release(ctx, m, 0))
	m, err = rs[1].Match(ctx, hs)
	require.NoError(t, err)
	assert.Empty(t, m.Pages(), "another owner's directory holds none of them")
}

// -initial-bytes maps that much of each slab at the start (here all of it), and a
// replica maps it at its dial.
func TestInitialBytesMapsTheSlabAtTheStart(t *testing.T) {
	dir := shortDir(t)
	stop := started(t, "-dir", dir, "-runtime", "test", "-layout", "llama-0.85b", "-pages", "256", "-chunk-bytes", "2MiB", "-initial-bytes", "128MiB")
	ctx, cancel := context.WithTimeout(context.Background(), testwait.Bound)
	defer cancel()
	r, err := replica.Dial(ctx, dir, cudarttest.ForTest(t), 0)
	require.NoError(t, err)
	chunks, pages := r.Mapped()
	assert.Equal(t, 64, chunks, "2 chunks a tensor")
	assert.Equal(t, 256, pages)
	require.NoError(t, r.Close(ctx))
	code, out, errOut := stop()
	require.Equal(t, 0, code, "stdout: %s\nstderr: %s", out, errOut)
	assert.Contains(t, out, "128 MiB a slab at most (32 regions of 4.0 MiB, in chunks of 2.0 MiB; 128 MiB mapped now)")
}
