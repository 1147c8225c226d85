package main

// The kill soak: kvpoold (with its keeper, its index and a host tier) and replica
// processes on the software device, a seeded schedule of prompts and of SIGKILLs of
// kvpoold, of writers and of readers, and every byte a replica reads under a lease
// that ended well checked against what the writer of its hash wrote. A matched page
// must hold exactly what its writer sealed, through any kill and restart.
//
// The slab is elastic under the kills: kvpoold starts with one step and grows as the
// writers need pages, and a restart takes back the chunks the keeper holds, however
// many. On the software device kvpoold also gives chunks back (-min-free): its device
// reports a free memory that falls and rises on a seeded schedule ($CUDAPOOL_SOFTDEV_FREE,
// soakFree), so that the slab shrinks and grows again, and kills land mid-give-back.
// On a GPU (CUDAPOOL_KV_SOAK_RUNTIME=gpu) nothing can make the free memory fall, so
// the give-back is left off there: the slab only grows. The growths, give-backs and
// kills mid-give-back that kvpoold's log shows are counted and reported with each seed.
//
// A bounded soak runs in go test. CUDAPOOL_KV_SOAK=DURATION (e.g. 10m) runs seeds one
// after another for that long (scripts/kv-soak.sh); CUDAPOOL_KV_SOAK_SEED=N replays
// seed N. What replays is the schedule (the prompts each replica asks for, the kills,
// and the pauses between them): the processes' own interleaving is the kernel's.

import (
	"bufio"
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"math/rand/v2"
	"os"
	"os/exec"
	"regexp"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/cudapool/cudapool/cudart"
	"github.com/cudapool/cudapool/cudart/choose"
	"github.com/cudapool/cudapool/cudart/cudarttest"
	"github.com/cudapool/cudapool/internal/proctest"
	"github.com/cudapool/cudapool/kv"
	"github.com/cudapool/cudapool/kv/owner"
	"github.com/cudapool/cudapool/kv/replica"
)

// soakPages is the slab's bound: small, so that the prompts evict each other and
// spill to the host tier, which holds soakHostPages of them. The slab starts with one
// step of soakStepPages and grows to soakPages (soakGeometry).
const (
	soakPages     = 64
	soakStepPages = 16
	soakHostPages = 48
	soakPrompts   = 16 // distinct prompts; prompt p's pages are a prefix of its longer runs
	soakMaxPages  = 6  // pages of the longest run of a prompt
)

// soakGeometry is the soak's: 2 layers of 4 KV heads of 128, 128 tokens a page, so
// that a page of a layer's K or V is 128 KiB, a chunk of 2 MiB (the granularity, on
// the software device and on a GPU) holds soakStepPages, and the slab grows by steps
// of 4 chunks (one per tensor) from one step to 4.
var soakGeometry = kv.Geometry{Layers: 2, KVHeads: 4, HeadDim: 128, TokensPerPage: 128, DType: kv.DTypeBF16, Pages: soakPages}

// The give-back under the kills, on the software device: kvpoold's -min-free is
// soakMinFree, and its device reports a free memory (cudarttest.FreeSchedule, through
// $CUDAPOOL_SOFTDEV_FREE) drawn anew every soakFreePeriod from within two steps of it,
// from a seed of its own for each kvpoold started: half the draws are short, by one or
// two steps (kvpoold's give-back, which looks every 100 ms, gives that many back), a
// quarter are a step above it (the slab grows again).
const (
	soakMinFree    = 1 << 30
	soakFreePeriod = 120 * time.Millisecond
)

// soakPiece fills b with what layer l's K (v false) or V of the page sealed under h
// holds in the soak: its first 8 bytes name h (so that a wrong piece says whose bytes
// it holds), the rest a stream seeded by h, l and v.
func soakPiece(b []byte, h kv.Hash, l int, v bool) {
	id := binary.LittleEndian.Uint64(h[:8])
	x := id ^ uint64(l)*0x9e3779b97f4a7c15
	if v {
		x = ^x
	}
	binary.LittleEndian.PutUint64(b, id)
	for i := 8; i+8 <= len(b); i += 8 {
		x ^= x << 13
		x ^= x >> 7
		x ^= x << 17
		binary.LittleEndian.PutUint64(b[i:], x)
	}
}

// soakCounts are what a soak replica reports.
type soakCounts struct {
	ops, pagesChecked, bytesChecked, wrongPieces, unverified, errs int
}

func (c *soakCounts) add(o soakCounts) {
	c.ops += o.ops
	c.pagesChecked += o.pagesChecked
	c.bytesChecked += o.bytesChecked
	c.wrongPieces += o.wrongPieces
	c.unverified += o.unverified
	c.errs += o.errs
}

func (c soakCounts) String() string {
	return fmt.Sprintf("ops=%d pages=%d bytes=%d wrong=%d unverified=%d errs=%d", c.ops, c.pagesChecked, c.bytesChecked, c.wrongPieces, c.unverified, c.errs)
}

func parseCounts(line string) (c soakCounts, err error) {
	_, err = fmt.Sscanf(line, "counts ops=%d pages=%d bytes=%d wrong=%d unverified=%d errs=%d", &c.ops, &c.pagesChecked, &c.bytesChecked, &c.wrongPieces, &c.unverified, &c.errs)
	return c, err
}

// soakReplica is a replica process of the soak: args are dir, seed and "write" or
// "read". It matches prompts of a seeded sequence, checks what it matched, and (a
// writer) allocates, writes and seals the rest. It prints "wrong ..." for each piece
// that differs, and "counts ..." on each line it reads from stdin and when stdin ends
// (then it exits).
func soakReplica(args []string) int {
	dir, mode := args[0], args[2]
	seed, err := strconv.ParseUint(args[1], 10, 64)
	if err != nil {
		fmt.Println("seed:", err)
		return 2
	}
	ch, err := choose.Runtime(soakRuntimeName())
	if err != nil {
		fmt.Println("runtime:", err)
		return 1
	}
	dev := ch.Runtime
	var mu sync.Mutex
	var c soakCounts
	stop := make(chan struct{})
	go func() { // the controller's lines: report; EOF: report and stop
		sc := bufio.NewScanner(os.Stdin)
		for sc.Scan() {
			mu.Lock()
			fmt.Println("counts", c)
			mu.Unlock()
		}
		close(stop)
	}()
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	go func() {
		<-stop
		cancel() // a step waiting on the owner ends with the stop
	}()
	r, err := replica.Dial(ctx, dir, dev, 0, replica.WithReconnect(), replica.WaitForOwner())
	if err != nil {
		fmt.Println("dial:", err)
		return 1
	}
	defer func() {
		cctx, ccancel := context.WithTimeout(context.Background(), soakWait)
		defer ccancel()
		_ = r.Close(cctx) // the process ends after; its exit releases what Close could not
	}()
	s, err := dev.StreamCreate(0, cudart.StreamNonBlocking)
	if err != nil {
		fmt.Println("stream:", err)
		return 1
	}
	g := r.Geometry()
	rng := rand.New(rand.NewPCG(seed, 0x50a4))
	want := make([]byte, g.PageBytes())
	seen := map[string]int{}
	for {
		select {
		case <-stop:
			mu.Lock()
			fmt.Println("counts", c)
			mu.Unlock()
			return 0
		default:
		}
		var one soakCounts
		one.ops = 1
		prompt := rng.IntN(soakPrompts)
		n := 1 + rng.IntN(soakMaxPages)
		hashes := r.Hashes(tokens(n*g.TokensPerPage, 1000+prompt))
		hold := time.Duration(rng.IntN(3)) * time.Millisecond
		if err := soakStep(ctx, dev, r, s, hashes, mode == "write", hold, want, &one); err != nil {
			one.errs++
			if seen[err.Error()] < 2 {
				seen[err.Error()]++
				fmt.Println("error:", err)
			}
			// The owner may be restarting: wait for the reattach rather than spin.
			_ = r.WaitAttached(ctx) // ends with the stop at the latest
			time.Sleep(time.Millisecond)
		}
		mu.Lock()
		c.add(one)
		mu.Unlock()
	}
}

// soakStep matches hashes, reads every matched page (after hold), releases them and,
// if the release succeeded, checks what it read; a writer then writes and seals the
// pages the match did not find.
func soakStep(ctx context.Context, dev cudart.Runtime, r *replica.Replica, s cudart.Stream, hashes []kv.Hash, write bool, hold time.Duration, want []byte, c *soakCounts) error {
	g := r.Geometry()
	l, err := r.Match(ctx, hashes)
	if err != nil {
		return err
	}
	pages := l.Pages()
	time.Sleep(hold) // a reader holds its lease a while: the owner may restart meanwhile
	read := make([][]byte, 0, 2*g.Layers*len(pages))
	for _, p := range pages {
		for layer := range g.Layers {
			for _, part := range []kv.Part{kv.K, kv.V} {
				b := make([]byte, g.PageBytes())
				if err := dev.MemcpyDtoHAsync(0, b, r.Addr(layer, part, int(p)), s); err != nil {
					return err
				}
				read = append(read, b)
			}
		}
	}
	if err := dev.StreamSynchronize(0, s); err != nil {
		return err
	}
	if err := r.Release(ctx, l, s); err != nil {
		// A lease the owner did not keep through a restart: what was read under it
		// proves nothing.
		c.unverified += len(pages)
		return err
	}
	i := 0
	for j := range pages {
		for layer := range g.Layers {
			for _, v := range []bool{false, true} {
				soakPiece(want, hashes[j], layer, v)
				if string(read[i]) != string(want) {
					c.wrongPieces++
					fmt.Printf("wrong page=%d hash=%x layer=%d v=%v holds=%x\n", pages[j], hashes[j][:8], layer, v, read[i][:8])
				}
				c.bytesChecked += len(want)
				i++
			}
		}
		c.pagesChecked++
	}
	if !write || len(pages) == len(hashes) {
		return nil
	}
	rest := hashes[len(pages):]
	w, err := r.Alloc(ctx, len(rest))
	if err != nil {
		return err
	}
	for j, p := range w.Pages() {
		for layer := range g.Layers {
			for _, part := range []kv.Part{kv.K, kv.V} {
				b := make([]byte, g.PageBytes())
				soakPiece(b, rest[j], layer, part == kv.V)
				if err := dev.MemcpyHtoDAsync(0, r.Addr(layer, part, int(p)), b, s); err != nil {
					return err
				}
			}
		}
	}
	var sopts []replica.SealOption
	if len(rest)%2 == 0 {
		sopts = append(sopts, replica.WaitVisible())
	}
	if _, err := r.Seal(ctx, w, rest, s, sopts...); err != nil {
		_ = r.Release(ctx, w, s) // a seal refused leaves the lease; give it back if it is still ours
		return err
	}
	return nil
}

// soakArgs are kvpoold's flags in the soak: the keeper, the index, a host tier, a
// slab that starts with one step and, on the software device, -min-free.
func soakArgs(dir string) []string {
	g := soakGeometry
	args := []string{"-dir", dir, "-runtime", soakRuntimeName(),
		"-layers", strconv.Itoa(g.Layers), "-kv-heads", strconv.Itoa(g.KVHeads), "-head-dim", strconv.Itoa(g.HeadDim),
		"-tokens-per-page", strconv.Itoa(g.TokensPerPage), "-dtype", "bf16", "-pages", strconv.Itoa(g.Pages),
		"-chunk-bytes", "2MiB", "-initial-bytes", strconv.FormatUint(soakStepPages*g.PageSpanBytes(), 10),
		"-host-bytes", strconv.FormatUint(soakHostPages*owner.HostPageBytes(g), 10), "-reattach-grace", "2s", "-stop-wait", "1s"}
	if soakGivesBack() {
		args = append(args, "-min-free", strconv.Itoa(soakMinFree))
	}
	return args
}

// soakGivesBack says whether the soak's kvpoold gives chunks back: on the software
// device only, whose free memory a schedule can make fall and rise.
func soakGivesBack() bool { return soakRuntimeName() == "test" }

// soakFree is the free-memory schedule of the kvpoold started seed's n-th time.
func soakFree(seed uint64, n int) cudarttest.FreeSchedule {
	step := uint64(soakStepPages) * soakGeometry.PageSpanBytes()
	return cudarttest.FreeSchedule{Seed: seed<<20 + uint64(n), Low: soakMinFree - 2*step, High: soakMinFree + 2*step, Period: soakFreePeriod}
}

// soakRuntimeName is the runtime of the soak's processes: CUDAPOOL_KV_SOAK_RUNTIME
// (gpu on a GPU host), else the software device.
func soakRuntimeName() string {
	if v := os.Getenv("CUDAPOOL_KV_SOAK_RUNTIME"); v != "" {
		return v
	}
	return "test"
}

// soakWait bounds each wait of the soak for a process; it only ends a soak that hangs.
const soakWait = time.Minute

// TestKillSoak is the bounded soak: seeds 1 to 3 (or CUDAPOOL_KV_SOAK_SEED alone), 12
// kills each; with CUDAPOOL_KV_SOAK=DURATION, seeds one after another for that long.
// Each seed's line and the summary say how often the slab grew and was given back.
func TestKillSoak(t *testing.T) {
	if testing.Short() {
		t.Skip("the kill soak starts processes for seconds")
	}
	seeds, count := []uint64{1}, 3
	var until time.Time
	if v := os.Getenv("CUDAPOOL_KV_SOAK_SEED"); v != "" {
		s, err := strconv.ParseUint(v, 10, 64)
		require.NoError(t, err, "CUDAPOOL_KV_SOAK_SEED")
		seeds, count = []uint64{s}, 1
	}
	kills := 12
	if v := os.Getenv("CUDAPOOL_KV_SOAK"); v != "" {
		d, err := time.ParseDuration(v)
		require.NoError(t, err, "CUDAPOOL_KV_SOAK")
		until = time.Now().Add(d)
		kills = 40
		if os.Getenv("CUDAPOOL_KV_SOAK_SEED") == "" {
			seeds[0] = uint64(time.Now().UnixNano())
		}
	}
	var total soakCounts
	var slab soakSlab
	restarts := 0
	for i := 0; ; i++ {
		seed := seeds[0] + uint64(i)
		c, n, sl := soakSeed(t, seed, kills)
		total.add(c)
		slab.add(sl)
		restarts += n
		t.Logf("seed %d: %d kvpoold restarts, %s, %s", seed, n, sl, c)
		if t.Failed() || (until.IsZero() && i+1 >= count) || (!until.IsZero() && time.Now().After(until)) {
			break
		}
	}
	t.Logf("kill soak: %d kvpoold restarts, %s, %d pages and %d bytes checked, %d wrong pieces, %d pages unverified (their lease was lost)",
		restarts, slab, total.pagesChecked, total.bytesChecked, total.wrongPieces, total.unverified)
	if r := os.Getenv("CUDAPOOL_KV_SOAK_REPORT"); r != "" {
		_ = os.WriteFile(r, []byte(fmt.Sprintf("kv kill soak: seeds %d.., %d kvpoold restarts, %s, %d pages (%d bytes) checked, %d wrong pieces, %d pages unverified\n",
			seeds[0], restarts, slab, total.pagesChecked, total.bytesChecked, total.wrongPieces, total.unverified)), 0o644) // a report for the script; the test's verdict stands without it
	}
}

// soakSeed runs one seed: kvpoold, 3 writers and 1 reader, and kills kills times. It
// returns what the replicas counted, the restarts, and what kvpoold's logs said of
// the slab.
func soakSeed(t *testing.T, seed uint64, kills int) (soakCounts, int, soakSlab) {
	dir := shortDir(t)
	rng := rand.New(rand.NewPCG(seed, 0x5eed))
	owners := []*soakOwner{startSoakOwner(t, dir, seed, 0)}
	cmd := owners[0].cmd
	modes := []string{"write", "write", "write", "read"}
	kids := make([]*soakKid, len(modes))
	spawned := uint64(0)
	spawn := func(mode string) *soakKid { // each replica process a seed of its own
		spawned++
		return startSoakKid(t, dir, seed<<20+spawned, mode)
	}
	for i, m := range modes {
		kids[i] = spawn(m)
	}
	var total soakCounts
	restarts := 0
	for range kills {
		time.Sleep(time.Duration(20+rng.IntN(180)) * time.Millisecond)
		switch k := rng.IntN(10); {
		case k < 6: // kvpoold
			sigkill(t, cmd)
			if rng.IntN(2) == 0 {
				time.Sleep(time.Duration(rng.IntN(50)) * time.Millisecond)
			}
			restarts++
			owners = append(owners, startSoakOwner(t, dir, seed, restarts))
			cmd = owners[len(owners)-1].cmd
		default: // a replica, started again with a seed of its own
			i := rng.IntN(len(kids))
			total.add(kids[i].kill(t))
			kids[i] = spawn(kids[i].mode)
		}
	}
	for _, k := range kids {
		total.add(k.stop(t))
	}
	sigkill(t, cmd)
	slab := endSoakOwners(t, owners)
	if total.wrongPieces > 0 {
		t.Errorf("seed %d: %d pieces held other bytes than their writer sealed (CUDAPOOL_KV_SOAK_SEED=%d replays the schedule)", seed, total.wrongPieces, seed)
	}
	if total.pagesChecked == 0 {
		t.Errorf("seed %d: no page was checked", seed)
	}
	return total, restarts, slab
}

// The lines of kvpoold's log (kv/owner's) that the soak counts.
const (
	logGrew      = `msg="kv: the slab grew"`
	logGiveBack  = `msg="kv: device memory short; giving the slab's last chunks back"`
	logGivenBack = `msg="kv: the slab's last chunks are given back"`
)

// soakSlab is what kvpoold's logs said of the slab: growths, give-backs begun and
// ended, kvpoold processes killed with one begun and not ended, and restarts that
// took back less than the whole slab from the keeper.
type soakSlab struct{ grew, begun, gaveBack, killedMid, tookBackPart int }

func (c *soakSlab) add(o soakSlab) {
	c.grew += o.grew
	c.begun += o.begun
	c.gaveBack += o.gaveBack
	c.killedMid += o.killedMid
	c.tookBackPart += o.tookBackPart
}

func (c soakSlab) String() string {
	return fmt.Sprintf("%d growths, %d give-backs (%d begun, %d kvpoold kills mid-give-back), %d restarts took back part of the slab",
		c.grew, c.gaveBack, c.begun, c.killedMid, c.tookBackPart)
}

// slabMapped finds in kvpoold's first line the slab's bound and what is mapped at the
// start (the chunks the keeper held, on a restart).
var slabMapped = regexp.MustCompile(`([0-9.]+ [KMGT]?i?B) a slab at most .*; ([0-9.]+ [KMGT]?i?B) mapped now`)

// soakOwner is a kvpoold process of the soak, and the reading of its log.
type soakOwner struct {
	cmd    *exec.Cmd
	keeper int           // the keeper pid its first line names, 0 where none
	part   bool          // a restart that took back part of the slab
	log    chan soakSlab // what its log said, once the log has ended
}

// startSoakOwner starts kvpoold on dir, the n-th of seed (its free-memory schedule,
// soakFree, is the n-th's), and reads its first line. Its log (stderr) is copied to
// the test's stderr and counted until it ends: when kvpoold has died and, for the one
// that started the keeper (which inherits its stderr), the keeper too.
func startSoakOwner(t *testing.T, dir string, seed uint64, n int) *soakOwner {
	t.Helper()
	cmd := proctest.Command(t, "kvpoold", soakArgs(dir)...)
	if soakGivesBack() {
		cmd.Env = append(cmd.Env, cudarttest.FreeEnv+"="+soakFree(seed, n).String())
	}
	r, w, err := os.Pipe()
	require.NoError(t, err)
	cmd.Stderr = w // a file, not a copy of this process's: the keeper may hold it after kvpoold
	o := &soakOwner{log: make(chan soakSlab, 1)}
	go o.read(r)
	var line string
	o.cmd, line = startDaemon(t, cmd)
	require.NoError(t, w.Close()) // kvpoold has its own
	if m := keeperPID.FindStringSubmatch(line); m != nil {
		o.keeper, _ = strconv.Atoi(m[1])
	}
	m := slabMapped.FindStringSubmatch(line)
	require.NotNil(t, m, "kvpoold's first line says what is mapped")
	o.part = n > 0 && m[1] != m[2]
	t.Logf("kvpoold pid %d (start %d of the seed): %s", o.cmd.Process.Pid, n, line)
	return o
}

// read copies kvpoold's log from r to the test's stderr, counting, until it ends.
func (o *soakOwner) read(r *os.File) {
	defer r.Close()
	var c soakSlab
	begun := false
	sc := bufio.NewScanner(r)
	for sc.Scan() {
		line := sc.Text()
		fmt.Fprintln(os.Stderr, line) // where kvpoold's log went before the soak counted it
		switch {
		case strings.Contains(line, logGrew):
			c.grew++
		case strings.Contains(line, logGiveBack):
			c.begun++
			begun = true
		case strings.Contains(line, logGivenBack):
			c.gaveBack++
			begun = false
		}
	}
	if begun {
		c.killedMid++
	}
	o.log <- c
}

// endSoakOwners stops the keeper of owners, every one killed already, and returns
// what their logs said, once each has ended.
func endSoakOwners(t *testing.T, owners []*soakOwner) soakSlab {
	for _, o := range owners {
		if o.keeper != 0 {
			killKeeper(t, o.keeper) // it shares the log of the kvpoold that started it
		}
	}
	var c soakSlab
	timeout := time.After(soakWait)
	for _, o := range owners {
		select {
		case s := <-o.log:
			c.add(s)
			if o.part {
				c.tookBackPart++
			}
		case <-timeout:
			t.Errorf("the log of kvpoold %d did not end within %v of its kill and its keeper's", o.cmd.Process.Pid, soakWait)
			return c
		}
	}
	return c
}

// soakKid is a soak replica process.
type soakKid struct {
	mode  string
	cmd   *exec.Cmd
	in    io.WriteCloser
	lines chan string
	last  soakCounts // the last counts it reported
}

func startSoakKid(t *testing.T, dir string, seed uint64, mode string) *soakKid {
	k := &soakKid{mode: mode, cmd: proctest.Command(t, "soakreplica", dir, strconv.FormatUint(seed, 10), mode), lines: make(chan string, 64)}
	var err error
	k.in, err = k.cmd.StdinPipe()
	require.NoError(t, err)
	out, err := k.cmd.StdoutPipe()
	require.NoError(t, err)
	require.NoError(t, k.cmd.Start())
	t.Logf("soak replica %d: %s, seed %d", k.cmd.Process.Pid, mode, seed)
	go func() {
		defer close(k.lines)
		sc := bufio.NewScanner(out)
		for sc.Scan() {
			k.lines <- sc.Text()
		}
	}()
	return k
}

// collect reads the kid's lines until one of counts (or its end), failing t on a
// wrong piece.
func (k *soakKid) collect(t *testing.T) {
	timeout := time.After(soakWait)
	for {
		select {
		case line, ok := <-k.lines:
			if !ok {
				return
			}
			switch {
			case strings.HasPrefix(line, "counts "):
				c, err := parseCounts(line)
				require.NoError(t, err, line)
				k.last = c
				return
			case strings.HasPrefix(line, "wrong "):
				t.Errorf("soak replica %d (%s): %s", k.cmd.Process.Pid, k.mode, line)
			default:
				t.Logf("soak replica %d (%s): %s", k.cmd.Process.Pid, k.mode, line)
			}
		case <-timeout:
			t.Fatalf("soak replica %d (%s) said nothing for %v", k.cmd.Process.Pid, k.mode, soakWait)
		}
	}
}

// kill asks the kid for its counts, SIGKILLs it and reaps it.
func (k *soakKid) kill(t *testing.T) soakCounts {
	_, err := io.WriteString(k.in, "report\n")
	if err == nil {
		k.collect(t)
	}
	_ = k.cmd.Process.Signal(syscall.SIGKILL)
	_ = k.cmd.Wait() // killed: its status says so
	k.drain(t)
	return k.last
}

// stop ends the kid's input, which makes it report and exit.
func (k *soakKid) stop(t *testing.T) soakCounts {
	_ = k.in.Close() // its end of input is the stop
	k.collect(t)
	done := make(chan error, 1)
	go func() { done <- k.cmd.Wait() }()
	select {
	case err := <-done:
		var ee *exec.ExitError
		if err != nil && !errors.As(err, &ee) {
			t.Errorf("soak replica: %v", err)
		}
	case <-time.After(soakWait):
		_ = k.cmd.Process.Kill()
		t.Errorf("soak replica %d (%s) did not exit within %v of its stop", k.cmd.Process.Pid, k.mode, soakWait)
	}
	k.drain(t)
	return k.last
}

// drain reads what is left of a dead kid's output, failing t on a wrong piece.
func (k *soakKid) drain(t *testing.T) {
	for line := range k.lines {
		if strings.HasPrefix(line, "wrong ") {
			t.Errorf("soak replica (%s): %s", k.mode, line)
		}
	}
}
