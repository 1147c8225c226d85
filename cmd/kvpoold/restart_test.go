package main

import (
	"bufio"
	"bytes"
	"context"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/cudapool/cudapool/cudart"
	"github.com/cudapool/cudapool/cudart/cudarttest"
	"github.com/cudapool/cudapool/internal/peercred"
	"github.com/cudapool/cudapool/internal/proctest"
	"github.com/cudapool/cudapool/internal/testwait"
	"github.com/cudapool/cudapool/kv"
	"github.com/cudapool/cudapool/kv/owner"
	"github.com/cudapool/cudapool/kv/replica"
)

// restartArgs serve a small llama-0.85b slab on the software device.
func restartArgs(dir string, pages int) []string {
	return []string{"-dir", dir, "-runtime", "test", "-layout", "llama-0.85b", "-pages", strconv.Itoa(pages), "-reattach-grace", "30s", "-stop-wait", "1s"}
}

var keeperPID = regexp.MustCompile(`keeper pid (\d+)`)

// daemon is kvpoold as a process of its own, started and read to its first line. The
// keeper it names is stopped when the test ends.
func daemon(t *testing.T, args ...string) (*exec.Cmd, string) {
	t.Helper()
	return startDaemon(t, proctest.Command(t, "kvpoold", args...))
}

// startDaemon is daemon of cmd, made by proctest.Command: the caller may set its
// environment or stderr first.
func startDaemon(t *testing.T, cmd *exec.Cmd) (*exec.Cmd, string) {
	t.Helper()
	out, err := cmd.StdoutPipe()
	require.NoError(t, err)
	require.NoError(t, cmd.Start())
	first := make(chan string, 1)
	go func() {
		sc := bufio.NewScanner(out)
		if sc.Scan() {
			first <- sc.Text()
		}
		close(first)
		for sc.Scan() { // the rest: kvpoold must not block on its stdout
		}
	}()
	line := testwait.Recv(t, first, "kvpoold's first line")
	require.Contains(t, line, "kvpoold: serving", "kvpoold's first line")
	if m := keeperPID.FindStringSubmatch(line); m != nil {
		pid, _ := strconv.Atoi(m[1])
		t.Cleanup(func() { killKeeper(t, pid) })
	}
	return cmd, line
}

// killKeeper SIGKILLs the keeper pid and waits for it to be gone.
func killKeeper(t *testing.T, pid int) {
	p, err := peercred.OpenProcess(pid)
	if err != nil {
		return
	}
	defer p.Close()
	_ = syscall.Kill(pid, syscall.SIGKILL)
	ctx, cancel := context.WithTimeout(context.Background(), testwait.Bound)
	defer cancel()
	assert.NoError(t, p.Wait(ctx), "the keeper's exit")
}

// sigkill kills kvpoold and reaps it.
func sigkill(t *testing.T, cmd *exec.Cmd) {
	require.NoError(t, cmd.Process.Kill())
	_ = cmd.Wait() // killed: its status says so
}

// attach dials dir with WithReconnect on a software device of the test's, with a
// stream; both are closed at the test's end.
func attach(t *testing.T, dir string) (*cudarttest.Device, *replica.Replica, cudart.Stream) {
	dev := cudarttest.ForTest(t)
	t.Cleanup(func() { // last: after the replica's Close and the stream's destroy
		assert.Empty(t, dev.Violations(), "the software device's rule violations")
	})
	s, err := dev.StreamCreate(0, cudart.StreamNonBlocking)
	require.NoError(t, err)
	t.Cleanup(func() { // after the replica's Close, which records on s one last time
		assert.NoError(t, dev.StreamSynchronize(0, s))
		assert.NoError(t, dev.StreamDestroy(0, s))
	})
	r, err := replica.Dial(bound(t), dir, dev, 0, replica.WithReconnect())
	require.NoError(t, err)
	t.Cleanup(func() { r.Close(bound(t)) })
	return dev, r, s
}

// pattern is what page p of layer l's K (and V, negated) holds in these tests.
func pattern(g kv.Geometry, p uint32, l int, v bool) []byte {
	b := make([]byte, g.PageBytes())
	for i := range b {
		b[i] = byte(int(p)*7 + l*3 + i)
		if v {
			b[i] = ^b[i]
		}
	}
	return b
}

// writePages fills pages with pattern on s.
func writePages(t *testing.T, dev cudart.Runtime, r *replica.Replica, s cudart.Stream, pages []uint32) {
	g := r.Geometry()
	for _, p := range pages {
		for l := range g.Layers {
			k, v := r.Addr(l, kv.K, int(p)), r.Addr(l, kv.V, int(p))
			require.NoError(t, dev.MemcpyHtoDAsync(0, k, pattern(g, p, l, false), s))
			require.NoError(t, dev.MemcpyHtoDAsync(0, v, pattern(g, p, l, true), s))
		}
	}
}

// checkPages reads pages back and compares them with pattern of the pages they were
// written as (want[i] for pages[i]).
func checkPages(t *testing.T, dev cudart.Runtime, r *replica.Replica, s cudart.Stream, pages, want []uint32) {
	g := r.Geometry()
	for i, p := range pages {
		for l := range g.Layers {
			got := make([]byte, g.PageBytes())
			require.NoError(t, dev.MemcpyDtoHAsync(0, got, r.Addr(l, kv.K, int(p)), s))
			require.NoError(t, dev.StreamSynchronize(0, s))
			require.True(t, bytes.Equal(pattern(g, want[i], l, false), got), "page %d layer %d K", p, l)
		}
	}
}

func tokens(n, seed int) []int32 {
	ts := make([]int32, n)
	for i := range ts {
		ts[i] = int32(seed*100000 + i)
	}
	return ts
}

// sealed writes and seals n pages of a fresh prompt, visible when it returns.
func sealed(t *testing.T, ctx context.Context, dev cudart.Runtime, r *replica.Replica, s cudart.Stream, n, seed int) ([]kv.Hash, []uint32) {
	hashes := r.Hashes(tokens(n*r.Geometry().TokensPerPage, seed))
	w, err := r.Alloc(ctx, n)
	require.NoError(t, err)
	writePages(t, dev, r, s, w.Pages())
	res, err := r.Seal(ctx, w, hashes, s, replica.WaitVisible())
	require.NoError(t, err)
	require.Equal(t, n, res.Visible)
	return hashes, w.Pages()
}

// kvpoold SIGKILLed and started again on its directory adopts the slab from the
// keeper and the visible pages from the index; a replica attached throughout
// reattaches by itself, its read and write leases re-established, and matches hit
// every page sealed before, with the bytes written then.
func TestRestartKeepsTheCacheAndReplicasReattach(t *testing.T) {
	dir := shortDir(t)
	first, line := daemon(t, restartArgs(dir, 64)...)
	assert.Contains(t, line, "new cache in keeper pid")
	pid := keeperPID.FindStringSubmatch(line)[1]

	dev, r, s := attach(t, dir)
	ctx := bound(t)
	hashes, pages := sealed(t, ctx, dev, r, s, 12, 1)
	// Two more replicas, processes of their own, each holding a read lease of the
	// prompt across the restart.
	var others []*proctest.Child
	for range 2 {
		c := proctest.Start(t, "reattacher", dir)
		c.Send("match 1 12")
		c.Expect("matched 12 bytes true reattaches 0 held true")
		others = append(others, c)
	}
	read, err := r.Match(ctx, hashes[:4])
	require.NoError(t, err)
	require.Len(t, read.Pages(), 4)
	write, err := r.Alloc(ctx, 3)
	require.NoError(t, err)
	done := r.Done()

	sigkill(t, first)
	testwait.Recv(t, done, "the replica's Done after kvpoold's death")
	require.ErrorIs(t, r.Err(), kv.ErrOwnerGone)

	_, line = daemon(t, restartArgs(dir, 64)...)
	assert.Contains(t, line, "cache adopted from keeper pid "+pid+": 12 visible pages restored, 3 replicas to reattach")
	for _, c := range others {
		c.Send("await 1 12")
		c.Expect("matched 12 bytes true reattaches 1 held true")
	}
	require.NoError(t, r.WaitAttached(ctx))
	assert.Equal(t, uint64(1), r.Reattaches())
	require.NoError(t, r.Err())
	assert.NoError(t, read.Lost(), "the read lease is re-established")
	assert.NoError(t, write.Lost(), "the write lease is re-established")

	got, err := r.Match(ctx, hashes)
	require.NoError(t, err)
	require.Equal(t, pages, got.Pages(), "every page sealed before the restart matches, where it was")
	checkPages(t, dev, r, s, got.Pages(), pages)

	// The leases from before work as any: the write lease seals, the reads release.
	more := r.Hashes(tokens(3*r.Geometry().TokensPerPage, 2))
	writePages(t, dev, r, s, write.Pages())
	res, err := r.Seal(ctx, write, more, s, replica.WaitVisible())
	require.NoError(t, err)
	assert.Equal(t, 3, res.Visible)
	require.NoError(t, r.ReleaseAll(ctx, []*replica.Lease{read, got}, s))
	st, err := r.Stats(ctx)
	require.NoError(t, err)
	assert.Equal(t, 15, st.Devices[0].Sealed)
	assert.Equal(t, 0, st.Devices[0].Leased)
	require.NotNil(t, st.Restart)
	assert.Equal(t, kv.RestartStats{Epoch: 2, Adopted: true, Keeper: st.Restart.Keeper, Restored: 12, Replicas: 3}, *st.Restart,
		"the replicas to reattach are the number of the first line; none is awaited now")
	for _, c := range others {
		c.Finish()
	}
}

// An index whose bytes were changed, or cut short, is detected by its checksums and
// dropped: the owner says so in its first line and starts with no visible page; a read
// lease from before is lost (kv.ErrLeaseLost), never served from a page it cannot
// vouch for.
func TestCorruptIndexIsDropped(t *testing.T) {
	for _, tc := range []struct {
		name  string
		spoil func(b []byte) []byte
		why   string
	}{
		{"flipped", func(b []byte) []byte { b[indexHeaderBytes+12] ^= 0x40; return b }, "checksum is wrong"},
		{"truncated", func(b []byte) []byte { return b[:len(b)-3] }, "truncated"},
		{"header", func(b []byte) []byte { b[6] ^= 1; return b }, "the header"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			dir := shortDir(t)
			first, _ := daemon(t, restartArgs(dir, 32)...)
			dev, r, s := attach(t, dir)
			ctx := bound(t)
			hashes, _ := sealed(t, ctx, dev, r, s, 6, 3)
			read, err := r.Match(ctx, hashes)
			require.NoError(t, err)
			done := r.Done()
			sigkill(t, first)
			testwait.Recv(t, done, "the replica's Done after kvpoold's death")

			path := filepath.Join(dir, owner.IndexFile)
			b, err := os.ReadFile(path)
			require.NoError(t, err)
			require.NoError(t, os.WriteFile(path, tc.spoil(b), 0o600))

			_, line := daemon(t, restartArgs(dir, 32)...)
			assert.Contains(t, line, "0 visible pages restored")
			assert.Contains(t, line, "is corrupt")
			assert.Contains(t, line, tc.why)
			require.NoError(t, r.WaitAttached(ctx))
			require.ErrorIs(t, read.Lost(), kv.ErrLeaseLost)
			require.ErrorIs(t, r.Release(ctx, read, s), kv.ErrLeaseLost)
			got, err := r.Match(ctx, hashes)
			require.NoError(t, err)
			assert.Empty(t, got.Pages(), "no page of a dropped index is visible")
		})
	}
}

// A kvpoold started with another geometry refuses the live keeper's chunks and the
// index: it drops them, makes a slab anew in the same keeper and says why in its
// first line. A replica of the old slab is told, and stays stopped.
func TestRestartWithAnotherGeometryDropsTheOldSlab(t *testing.T) {
	dir := shortDir(t)
	first, line := daemon(t, append(restartArgs(dir, 32), "-host-bytes", "8MiB")...)
	old := keeperPID.FindStringSubmatch(line)[1]
	dev, r, s := attach(t, dir)
	ctx := bound(t)
	sealed(t, ctx, dev, r, s, 4, 4)
	sigkill(t, first)
	testwait.Recv(t, r.Done(), "the replica's Done after kvpoold's death")

	// The old keeper waits for its importers to unmap the slab: the replica goes.
	closed := make(chan error, 1)
	go func() {
		if err := r.WaitAttached(ctx); !errors.Is(err, kv.ErrOwnerGone) {
			closed <- fmt.Errorf("WaitAttached on a gone slab: %v", err)
			return
		}
		closed <- r.Close(ctx)
	}()
	_, line = daemon(t, append(restartArgs(dir, 16), "-host-bytes", "8MiB")...)
	assert.Contains(t, line, "the keeper keeps chunks of 16x8x64x16xbf16x32-2097152 (2097152 bytes) for device 0, this owner serves 16x8x64x16xbf16x16-2097152")
	assert.Contains(t, line, "the old chunks and index are dropped")
	assert.Contains(t, line, "new cache in keeper pid "+old+",", "the same keeper: it holds descriptors of any slab")
	require.NoError(t, testwait.Recv(t, closed, "the old slab's replica to close"))
}

// Two kvpoolds on one directory: the second refuses to start, naming the first.
func TestSecondKvpooldOnADirRefuses(t *testing.T) {
	dir := shortDir(t)
	daemon(t, restartArgs(dir, 8)...)
	var out, errOut bytes.Buffer
	code := run(context.Background(), restartArgs(dir, 8), &out, &errOut)
	assert.Equal(t, 1, code)
	assert.Contains(t, errOut.String(), "an owner already serves "+dir)
	assert.Contains(t, errOut.String(), owner.LockFile)
}

// indexHeaderBytes is the length of the index's header record for one device: u32
// length | magic, version, epoch, keeper pid and start, geometry, devices | u32 CRC.
const indexHeaderBytes = 4 + 8 + 4 + 8 + 4 + 8 + 24 + 4 + 4 + 4

// bound is the context of waits that only a bug makes long.
func bound(t testing.TB) context.Context {
	ctx, cancel := context.WithTimeout(context.Background(), testwait.Bound)
	t.Cleanup(cancel)
	return ctx
}

// childReplica dials dir from a replica process of the tests, on a software device of
// its own, with a stream; cancel ends its context (bounded).
func childReplica(dir string, opts ...replica.Option) (*cudarttest.Device, *replica.Replica, cudart.Stream, context.Context, context.CancelFunc, error) {
	dev := cudarttest.New()
	ctx, cancel := context.WithTimeout(context.Background(), testwait.Bound)
	r, err := replica.Dial(ctx, dir, dev, 0, opts...)
	if err != nil {
		return nil, nil, 0, ctx, cancel, fmt.Errorf("dial: %w", err)
	}
	s, err := dev.StreamCreate(0, cudart.StreamNonBlocking)
	if err != nil {
		return nil, nil, 0, ctx, cancel, fmt.Errorf("stream: %w", err)
	}
	return dev, r, s, ctx, cancel, nil
}

// midSealWriter is a replica process that seals 8 pages behind a stalled stream, says
// "sealed", and waits to be killed: its writes never complete.
func midSealWriter(args []string) int {
	dev, r, s, ctx, cancel, err := childReplica(args[0])
	defer cancel()
	if err != nil {
		fmt.Println(err)
		return 1
	}
	w, err := r.Alloc(ctx, 8)
	if err != nil {
		fmt.Println("alloc:", err)
		return 1
	}
	if _, err := dev.Stall(0, s); err != nil {
		fmt.Println("stall:", err)
		return 1
	}
	g := r.Geometry()
	for _, p := range w.Pages() {
		if err := dev.MemsetAsync(0, r.Addr(0, kv.K, int(p)), 0xee, g.PageBytes(), s); err != nil {
			fmt.Println("write:", err)
			return 1
		}
	}
	res, err := r.Seal(ctx, w, r.Hashes(tokens(8*g.TokensPerPage, 9)), s)
	if err != nil || res.Pending != 8 {
		fmt.Println("seal:", res, err)
		return 1
	}
	fmt.Println("sealed")
	<-ctx.Done()
	return 1
}

// A writer SIGKILLed while its seal waits for its writes, across kvpoold's SIGKILL and
// restart: none of its pages is ever visible.
func TestWriterKilledMidSealAcrossARestart(t *testing.T) {
	dir := shortDir(t)
	w := childThenKill(t, dir, 32, "midseal", "sealed")
	w.Kill()

	_, line := daemon(t, restartArgs(dir, 32)...)
	assert.Contains(t, line, "cache adopted from keeper pid")
	assert.Contains(t, line, "0 visible pages restored, 0 replicas to reattach")
	_, r, _ := attach(t, dir)
	ctx := bound(t)
	got, err := r.Match(ctx, r.Hashes(tokens(8*r.Geometry().TokensPerPage, 9)))
	require.NoError(t, err)
	assert.Empty(t, got.Pages(), "no page of the writer killed mid-seal is visible")
	st, err := r.Stats(ctx)
	require.NoError(t, err)
	assert.Equal(t, 0, st.Devices[0].Sealed)
	assert.Equal(t, 32, st.Devices[0].Free, "its pages are free again")
}

// A writer whose seal waits for its stream across kvpoold's SIGKILL and restart keeps
// its pages while it lives, the reattach grace over: its queued writes may still land
// there. (Before, the restarted kvpoold gave them to others, and the writes landed
// on their pages.) Once it has exited they are free, and none of them is visible.
func TestWriterMidSealKeepsItsPagesAcrossARestart(t *testing.T) {
	dir := shortDir(t)
	w := childThenKill(t, dir, 32, "midseal", "sealed")
	_, line := daemon(t, append(restartArgs(dir, 32), "-reattach-grace", "1ms")...)
	assert.Contains(t, line, "the pages of 1 write leases kept for their writers")
	_, r, _ := attach(t, dir)
	ctx := bound(t)
	l, err := r.Alloc(ctx, 24)
	require.NoError(t, err, "the pages the writer does not hold")
	_, err = r.Alloc(ctx, 1)
	require.ErrorIs(t, err, kv.ErrNoSpace, "the writer's 8 pages are its own while it lives")
	w.Kill()
	_ = w.Wait() // killed: its status says so
	require.Eventually(t, func() bool {
		st, err := r.Stats(ctx)
		return err == nil && st.Devices[0].Free == 8
	}, testwait.Bound, time.Millisecond, "the writer's pages to be free once it has exited")
	got, err := r.Match(ctx, r.Hashes(tokens(8*r.Geometry().TokensPerPage, 9)))
	require.NoError(t, err)
	assert.Empty(t, got.Pages(), "no page of the writer's seal is visible")
	require.NoError(t, r.Release(ctx, l, 0))
}

// A keeper whose kvpoold died, with no replica mapping its slabs, frees them and
// exits once -keeper-idle has passed.
func TestKeeperOfADeadKvpooldExitsWhenIdle(t *testing.T) {
	dir := shortDir(t)
	first, line := daemon(t, append(restartArgs(dir, 8), "-keeper-idle", "50ms")...)
	pid, err := strconv.Atoi(keeperPID.FindStringSubmatch(line)[1])
	require.NoError(t, err)
	p, err := peercred.OpenProcess(pid)
	require.NoError(t, err)
	defer p.Close()
	sigkill(t, first)
	require.NoError(t, p.Wait(bound(t)), "the idle keeper's exit")
}

// A replica reconnecting to an owner that does not come back closes at once, and
// WaitAttached ends with its context or the Close.
func TestCloseWhileReconnecting(t *testing.T) {
	dir := shortDir(t)
	first, _ := daemon(t, restartArgs(dir, 8)...)
	_, r, _ := attach(t, dir)
	done := r.Done()
	sigkill(t, first)
	testwait.Recv(t, done, "the replica's Done after kvpoold's death")
	short, cancel := context.WithTimeout(context.Background(), 20*time.Millisecond)
	defer cancel()
	require.ErrorIs(t, r.WaitAttached(short), context.DeadlineExceeded, "no owner: no reattach")
	waited := make(chan error, 1)
	go func() { waited <- r.WaitAttached(context.Background()) }()
	closed := make(chan error, 1)
	go func() { closed <- r.Close(bound(t)) }()
	require.NoError(t, testwait.Recv(t, closed, "Close while reconnecting"))
	require.ErrorIs(t, testwait.Recv(t, waited, "WaitAttached ended by Close"), kv.ErrClosed)
}

// The index is compacted as it grows: after 1,600 seals and as many evictions in a
// slab of 8 pages, the restarted owner restores the 8 pages visible last, each with
// its bytes.
func TestIndexCompactsAndRestores(t *testing.T) {
	dir := shortDir(t)
	first, _ := daemon(t, restartArgs(dir, 8)...)
	dev, r, s := attach(t, dir)
	ctx := bound(t)
	path := filepath.Join(dir, owner.IndexFile)
	var hashes []kv.Hash
	var pages []uint32
	for round := range 200 { // 2 records a page a round past the first: over the 1,040 that compact, twice
		if round < 199 { // pages of no bytes: only the index is looked at
			w, err := r.Alloc(ctx, 8)
			require.NoError(t, err)
			_, err = r.Seal(ctx, w, r.Hashes(tokens(8*r.Geometry().TokensPerPage, 100+round)), s, replica.WaitVisible())
			require.NoError(t, err)
			continue
		}
		hashes, pages = sealed(t, ctx, dev, r, s, 8, 100+round)
	}
	info, err := os.Stat(path)
	require.NoError(t, err)
	assert.Less(t, info.Size(), int64(1100*33), "the journal was compacted")
	done := r.Done()
	sigkill(t, first)
	testwait.Recv(t, done, "the replica's Done after kvpoold's death")
	_, line := daemon(t, restartArgs(dir, 8)...)
	assert.Contains(t, line, "8 visible pages restored")
	require.NoError(t, r.WaitAttached(ctx))
	got, err := r.Match(ctx, hashes)
	require.NoError(t, err)
	require.Equal(t, pages, got.Pages())
	checkPages(t, dev, r, s, got.Pages(), pages)
	require.NoError(t, r.Release(ctx, got, s))
}

// reattacher is a replica process dialed WithReconnect, driven by lines:
//
//	match SEED N   match the N pages of tokens(SEED), check their bytes, and hold the
//	               read lease
//	await SEED N   wait until reattached, then match and check them again and release
//	               both leases
//
// each answered "matched K bytes OK reattaches R held H" (H: the held lease is not lost).
func reattacher(args []string) int {
	dev, r, s, ctx, cancel, err := childReplica(args[0], replica.WithReconnect())
	defer cancel()
	if err != nil {
		fmt.Println(err)
		return 1
	}
	g := r.Geometry()
	var held *replica.Lease
	for line := range proctest.Commands() {
		f := strings.Fields(line)
		seed, _ := strconv.Atoi(f[1])
		n, _ := strconv.Atoi(f[2])
		if f[0] == "await" {
			if err := r.WaitAttached(ctx); err != nil {
				fmt.Println("wait:", err)
				return 1
			}
		}
		l, err := r.Match(ctx, r.Hashes(tokens(n*g.TokensPerPage, seed)))
		if err != nil {
			fmt.Println("match:", err)
			return 1
		}
		ok := true
		got := make([]byte, g.PageBytes())
		for _, p := range l.Pages() {
			if err := dev.MemcpyDtoHAsync(0, got, r.Addr(g.Layers-1, kv.V, int(p)), s); err != nil {
				fmt.Println("read:", err)
				return 1
			}
			if err := dev.StreamSynchronize(0, s); err != nil {
				fmt.Println("read:", err)
				return 1
			}
			ok = ok && bytes.Equal(got, pattern(g, p, g.Layers-1, true))
		}
		if held == nil {
			held = l
		}
		fmt.Println("matched", len(l.Pages()), "bytes", ok, "reattaches", r.Reattaches(), "held", held.Lost() == nil)
		if f[0] == "await" {
			if err := r.ReleaseAll(ctx, []*replica.Lease{l, held}, s); err != nil {
				fmt.Println("release:", err)
				return 1
			}
		}
	}
	if err := r.Close(ctx); err != nil {
		fmt.Println("close:", err)
		return 1
	}
	return 0
}

// With two devices, the page server copies a prompt across them through the slabs it
// adopted, and after its restart both devices' pages are back.
func TestRestartTwoDevices(t *testing.T) {
	dir := shortDir(t)
	first, _ := daemon(t, append(restartArgs(dir, 16), "-devices", "0,1")...)
	dev, r0, s := attach(t, dir)
	ctx := bound(t)
	hashes, pages := sealed(t, ctx, dev, r0, s, 4, 21)
	dev1 := cudarttest.ForTest(t)
	r1, err := replica.Dial(ctx, dir, dev1, 1, replica.WithReconnect())
	require.NoError(t, err)
	t.Cleanup(func() { r1.Close(bound(t)) })
	s1, err := dev1.StreamCreate(1, cudart.StreamNonBlocking)
	require.NoError(t, err)
	copied, err := r1.Match(ctx, hashes)
	require.NoError(t, err)
	require.Len(t, copied.Pages(), 4, "copied from device 0's slab")
	require.NoError(t, r1.Release(ctx, copied, s1))
	done0, done1 := r0.Done(), r1.Done()
	sigkill(t, first)
	testwait.Recv(t, done0, "device 0's replica told")
	testwait.Recv(t, done1, "device 1's replica told")
	_, line := daemon(t, append(restartArgs(dir, 16), "-devices", "0,1")...)
	assert.Contains(t, line, "8 visible pages restored, 2 replicas to reattach")
	require.NoError(t, r0.WaitAttached(ctx))
	require.NoError(t, r1.WaitAttached(ctx))
	got0, err := r0.Match(ctx, hashes)
	require.NoError(t, err)
	assert.Equal(t, pages, got0.Pages())
	checkPages(t, dev, r0, s, got0.Pages(), pages)
	got1, err := r1.Match(ctx, hashes)
	require.NoError(t, err)
	assert.Equal(t, copied.Pages(), got1.Pages(), "device 1's copies are back where they were")
	require.NoError(t, r0.Release(ctx, got0, s))
	require.NoError(t, r1.Release(ctx, got1, s1))
	require.NoError(t, dev1.StreamSynchronize(1, s1))
	require.NoError(t, dev1.StreamDestroy(1, s1))
}

// When the keeper dies too, the slabs are gone: the next kvpoold starts a new keeper
// and says in its first line that the cache, and the index's pages, are gone; a
// replica of the old slabs stays stopped.
func TestKeeperDeathEndsTheCache(t *testing.T) {
	dir := shortDir(t)
	first, line := daemon(t, restartArgs(dir, 16)...)
	pid, err := strconv.Atoi(keeperPID.FindStringSubmatch(line)[1])
	require.NoError(t, err)
	dev, r, s := attach(t, dir)
	ctx := bound(t)
	sealed(t, ctx, dev, r, s, 5, 31)
	sigkill(t, first)
	killKeeper(t, pid)
	require.ErrorIs(t, r.WaitAttached(ctx), kv.ErrOwnerGone, "no reattach to slabs that are gone")

	_, line = daemon(t, restartArgs(dir, 16)...)
	assert.Contains(t, line, "new cache in keeper pid")
	assert.Contains(t, line, "no keeper was alive")
	assert.Contains(t, line, "the 5 visible pages of the index with them")
}

// -one-process makes the slabs in kvpoold itself: no keeper, and its first line says so.
func TestOneProcess(t *testing.T) {
	dir := shortDir(t)
	stop := started(t, append(restartArgs(dir, 8), "-one-process")...)
	code, out, errOut := stop()
	require.Equal(t, 0, code, "stderr: %s", errOut)
	assert.Contains(t, out, "slabs in this process (-one-process)")
	assert.NotContains(t, out, "keeper pid")
	_, err := os.Stat(filepath.Join(dir, owner.IndexFile))
	assert.ErrorIs(t, err, os.ErrNotExist, "no index")
}

// Two restarts in a row: each waits for the one replica attached before, reattached
// once more each time, and the pages stay.
func TestTwoRestarts(t *testing.T) {
	dir := shortDir(t)
	cmd, _ := daemon(t, restartArgs(dir, 16)...)
	dev, r, s := attach(t, dir)
	ctx := bound(t)
	hashes, pages := sealed(t, ctx, dev, r, s, 3, 41)
	for i := range 2 {
		done := r.Done()
		sigkill(t, cmd)
		testwait.Recv(t, done, "the replica's Done after kvpoold's death")
		var line string
		cmd, line = daemon(t, restartArgs(dir, 16)...)
		assert.Contains(t, line, "3 visible pages restored, 1 replicas to reattach", "restart %d", i+1)
		require.NoError(t, r.WaitAttached(ctx))
		assert.Equal(t, uint64(i+1), r.Reattaches())
		got, err := r.Match(ctx, hashes)
		require.NoError(t, err)
		assert.Equal(t, pages, got.Pages())
		require.NoError(t, r.Release(ctx, got, s))
	}
}

// childThenKill serves dir with kvpoold, starts a replica process in role that says
// said, and SIGKILLs kvpoold.
func childThenKill(t *testing.T, dir string, pages int, role, said string) *proctest.Child {
	first, _ := daemon(t, restartArgs(dir, pages)...)
	c := proctest.Start(t, role, dir)
	c.Expect(said)
	sigkill(t, first)
	return c
}

// holder is a replica process that does not reconnect: it allocs 8 pages, says
// "held", and holds them until it is killed.
func holder(args []string) int {
	_, r, _, ctx, cancel, err := childReplica(args[0])
	defer cancel()
	if err != nil {
		fmt.Println(err)
		return 1
	}
	if _, err := r.Alloc(ctx, 8); err != nil {
		fmt.Println("alloc:", err)
		return 1
	}
	fmt.Println("held")
	<-ctx.Done()
	return 1
}

// A restarted kvpoold allocates no page while a replica attached before may still
// write its pages: an Alloc waits until that replica reattaches or, here, exits.
func TestAllocsWaitForTheReplicasOfBefore(t *testing.T) {
	dir := shortDir(t)
	h := childThenKill(t, dir, 16, "holder", "held")
	_, line := daemon(t, restartArgs(dir, 16)...)
	assert.Contains(t, line, "1 replicas to reattach")

	_, r, _ := attach(t, dir)
	short, cancel := context.WithTimeout(context.Background(), 50*time.Millisecond)
	defer cancel()
	_, err := r.Alloc(short, 1)
	require.ErrorIs(t, err, context.DeadlineExceeded, "no page is handed out while the holder may write")
	h.Kill()
	_ = h.Wait() // killed: its status says so
	// The Alloc that gave up is answered once allocations go on, and its page given
	// back after: 15 pages are the holder's 8 and 7 more.
	w, err := r.Alloc(bound(t), 15)
	require.NoError(t, err, "the holder's pages too, once it has exited")
	require.NoError(t, r.Release(bound(t), w, 0))
}

// A clean stop stops the keeper too; with -leave-keeper it leaves it, and the next
// kvpoold adopts its slabs and the pages.
func TestCleanStopAndLeaveKeeper(t *testing.T) {
	for _, leave := range []bool{false, true} {
		t.Run(fmt.Sprintf("leave=%v", leave), func(t *testing.T) {
			dir := shortDir(t)
			args := restartArgs(dir, 8)
			if leave {
				args = append(args, "-leave-keeper")
			}
			stop := started(t, args...)
			dev, r, s := attach(t, dir)
			ctx := bound(t)
			hashes, pages := sealed(t, ctx, dev, r, s, 2, 51)
			require.NoError(t, r.Close(ctx))
			code, out, errOut := stop()
			require.Equal(t, 0, code, "stderr: %s", errOut)
			pid, err := strconv.Atoi(keeperPID.FindStringSubmatch(out)[1])
			require.NoError(t, err)
			if !leave {
				if p, err := peercred.OpenProcess(pid); err == nil { // a zombie not reaped yet is one
					exited, err := p.Exited()
					require.NoError(t, err)
					assert.True(t, exited, "the keeper stopped with kvpoold")
					p.Close()
				}
				return
			}
			t.Cleanup(func() { killKeeper(t, pid) })
			_, line := daemon(t, restartArgs(dir, 8)...)
			assert.Contains(t, line, fmt.Sprintf("cache adopted from keeper pid %d: 2 visible pages restored, 0 replicas", pid))
			_, r2, s2 := attach(t, dir)
			got, err := r2.Match(ctx, hashes)
			require.NoError(t, err)
			assert.Equal(t, pages, got.Pages())
			require.NoError(t, r2.Release(ctx, got, s2))
		})
	}
}
