package main

import (
	"bufio"
	"bytes"
	"context"
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"golang.org/x/sys/unix"

	"github.com/cudapool/cudapool/cudart"
	"github.com/cudapool/cudapool/cudart/choose"
	"github.com/cudapool/cudapool/internal/proctest"
	"github.com/cudapool/cudapool/pool"
)

// TestMain lets the test binary be the suite's consumer and exporter processes, as
// the program is.
func TestMain(m *testing.M) {
	playRole()
	os.Exit(proctest.TrapAnnounceDir(m)) // the tests announce in directories of their own
}

// lines splits the suite's output into its lines' fields, by the first word.
func lines(t *testing.T, out string) map[string][][]string {
	t.Helper()
	by := map[string][][]string{}
	sc := bufio.NewScanner(strings.NewReader(out))
	sc.Buffer(nil, 1<<20)
	for sc.Scan() {
		f := strings.Fields(sc.Text())
		if len(f) > 0 {
			by[f[0]] = append(by[f[0]], f)
		}
	}
	require.NoError(t, sc.Err())
	return by
}

// The whole of "gosuite all", few samples, on the software device with validating
// consumers: every operation the table needs is reported once with exactly the
// samples its shape asks for, every buffer a consumer was given was checked byte by
// byte, the windows add up to the rates, no row says its feature is absent, and
// nothing fails.
func TestSuiteOnSoftwareDevice(t *testing.T) {
	picked, err := choose.Runtime(choose.Software)
	rt := picked.Runtime
	require.NoError(t, err)
	var out strings.Builder
	r := &reporter{w: &out}
	sh := quickShape
	r.measure("cudart", "import/pair", "us", func() ([]float64, error) { return importPairs(rt, choose.Software, sh) })
	sharing(r, rt, choose.Software, sh, true)
	require.NoError(t, choose.Violations(rt), "the software device saw violations")
	by := lines(t, out.String())
	assert.Empty(t, by["fail"], "failures")
	assert.False(t, r.failed, "the reporter says something failed")

	want := map[string]int{"cudart import/pair": sh.batches, "cudapool export/fresh": sh.samples,
		"cudapool open/first": sh.samples, "cudapool open/exported": sh.samples, "cudapool release": sh.samples,
		"cudapool open+release/exported": sh.samples, "cudapool sustained/4": sh.rounds,
		"cudapool read/same-gpu": sh.copies, "cudapool read/other-gpu": sh.copies,
		"cudapool block/64KiB/b1": sh.rounds, "cudapool block/64KiB/b64": sh.rounds, "cudapool blocklease/64KiB": sh.samples,
		"cudapool sustained/4/recycled": sh.rounds}
	for _, n := range fanouts {
		want[fmt.Sprintf("cudapool fanout/%d", n)] = sh.fanoutReps
	}
	results := map[string][]string{}
	for _, f := range by["result"] {
		require.Len(t, f, 7, "result line %q", f)
		key := f[1] + " " + f[2]
		assert.NotContains(t, results, key, "%s reported twice", key)
		results[key] = f
	}
	raws := map[string][]string{}
	for _, f := range by["raw"] {
		raws[f[1]+" "+f[2]] = f[4:]
	}
	assert.Len(t, results, len(want), "one result per operation")
	for key, n := range want {
		f, ok := results[key]
		if !assert.True(t, ok, "no result for %s", key) {
			continue
		}
		assert.Equal(t, strconv.Itoa(n), f[6], "%s: samples", key)
		assert.Len(t, raws[key], n, "%s: raw samples", key)
		median, err := strconv.ParseFloat(f[4], 64)
		if assert.NoError(t, err) {
			assert.Positive(t, median, key)
		}
	}

	// One window line per round of each windowed operation, whose shares make the
	// round's rate, going round the operation's names.
	windows := map[string][][]string{}
	for _, f := range by["window"] {
		require.Len(t, f, 8, "window line %q", f)
		windows[f[2]] = append(windows[f[2]], f)
	}
	require.Len(t, windows, 4)
	shares := map[string]float64{}
	blocks := int(sh.slabSize / blockSize)
	for op, names := range map[string]int{"sustained/4": sh.ring, "sustained/4/recycled": sh.ring,
		"block/64KiB/b1": blocks, "block/64KiB/b64": blocks} {
		require.Len(t, windows[op], sh.rounds, op)
		var rateSum float64
		for i, f := range windows[op] {
			assert.Equal(t, strconv.Itoa(i), f[3], "%s: window rounds in order", op)
			n, _ := strconv.ParseFloat(f[4], 64)
			turns, _ := strconv.ParseFloat(f[7], 64)
			assert.Positive(t, n)
			if op == "block/64KiB/b64" {
				assert.Zero(t, int(n)%64, "%s: whole batches", op)
			}
			assert.InDelta(t, n/float64(names), turns, 0.01, "%s: turns are shares over the names", op)
			shares[op] += n
		}
		for _, x := range raws["cudapool "+op] {
			v, _ := strconv.ParseFloat(x, 64)
			rateSum += v
		}
		assert.InDelta(t, shares[op]/sh.window.Seconds(), rateSum, 1, "%s: the windows' shares make the rates", op)
	}

	// The calls lines of each window count the consumers' Opens and Releases (one per
	// share, or per batch), and show the recycled path for what it is: its consumers
	// import each buffer's memory once at most, in whichever window they first open it,
	// and never free an import.
	calls := map[string]map[string]int{} // "OP ROUND SIDE" -> call -> count
	for _, f := range by["calls"] {
		require.Len(t, f, 9, "calls line %q", f)
		key := strings.Join(f[2:5], " ")
		if calls[key] == nil {
			calls[key] = map[string]int{}
		}
		n, err := strconv.Atoi(f[6])
		require.NoError(t, err, "calls line %q", f)
		calls[key][f[5]] = n
	}
	recycledImports := 0
	for op, ws := range windows {
		open, release, per := "Open", "Release", 1
		if op == "block/64KiB/b64" {
			open, release, per = "OpenAll", "ReleaseAll", 64
		}
		for _, w := range ws {
			c := calls[op+" "+w[3]+" consumers"]
			n, _ := strconv.Atoi(w[4])
			assert.Equal(t, n/per, c[open], "%s window %s: %s calls", op, w[3], open)
			assert.Equal(t, n/per, c[release], "%s window %s: %s calls", op, w[3], release)
			if op == "sustained/4/recycled" {
				recycledImports += c["MemPoolImportPointer"]
				assert.Zero(t, c["FreeAsync"], "%s window %s: the consumers freed imports", op, w[3])
			}
		}
	}
	assert.LessOrEqual(t, recycledImports, sh.ring*sustainConsumers, "recycled: imports of memory the consumers had imported")

	// Every buffer given to a consumer was validated, and there were as many as the
	// shape makes plus the windows' shares, for each producer.
	require.Len(t, by["validated"], 2, "the main producer's consumers and the recycled row's")
	// open/first, open/exported, release, open+release and the block lease: warm-up and
	// samples each; the two reads; the windows' shares; the blocks held (4 + 4 + 1).
	given := 5*(sh.warmup+sh.samples) + 2 + int(shares["sustained/4"]+shares["block/64KiB/b1"]+shares["block/64KiB/b64"]) + 9
	for _, n := range fanouts {
		given += n * (sh.warmup + sh.fanoutReps)
	}
	recycled := strconv.Itoa(int(shares["sustained/4/recycled"]))
	assert.Equal(t, []string{"validated", "cudapool", "all", recycled, recycled}, by["validated"][0])
	assert.Equal(t, []string{"validated", "cudapool", "all", strconv.Itoa(given), strconv.Itoa(given)}, by["validated"][1])

	assert.Empty(t, by["absent"], "every row of issue 11 is measured")
}

// fifo makes a named pipe in dir.
func fifo(t *testing.T, dir, name string) string {
	t.Helper()
	p := filepath.Join(dir, name)
	require.NoError(t, unix.Mkfifo(p, 0o600))
	return p
}

// A ring of one participant (its pipe leads back to itself) runs the whole plan:
// every entry in both slots (the binding slot of a cache entry passed, its turns
// taken all the same), each with exactly the batches asked, one turn after another,
// and a bytes line per entry and slot run saying what the plan says. The hit and miss
// entries took the path they name (allocRing checks the pool's counts).
func TestAllocRingRunsThePlan(t *testing.T) {
	picked, err := choose.Runtime(choose.Software)
	rt := picked.Runtime
	require.NoError(t, err)
	g, err := granularityOf(rt)
	require.NoError(t, err)
	plan, err := parsePlan(fmt.Sprintf("ipc/1KiB=%d local/1KiB=1024 hit/1MiB=%d local/1MiB=1048576 miss/1KiB=%d", g, g, g))
	require.NoError(t, err)
	dir := t.TempDir()
	p := fifo(t, dir, "turn")
	rg, err := openRing(p, p)
	require.NoError(t, err)
	defer func() { _ = rg.in.Close() }()  // test cleanup
	defer func() { _ = rg.out.Close() }() // test cleanup
	require.NoError(t, rg.pass(-1))       // turn 0 to start
	var out strings.Builder
	const batches = 3
	require.NoError(t, allocRing(&reporter{w: &out}, rt, plan, rg, 7, batches, 10))
	require.NoError(t, choose.Violations(rt))

	by := lines(t, out.String())
	samples := by["sample"]
	require.Len(t, samples, (2*len(plan)-2)*batches)
	i, slotsBefore := 0, 0
	gs := strconv.FormatUint(g, 10)
	for _, e := range plan {
		for _, slot := range allocSlots {
			impl := map[string]string{"api": "cudapool", "binding": "cudart"}[slot]
			if slot == "binding" && e.cached() {
				slotsBefore++
				continue
			}
			for b := range batches {
				f := samples[i]
				require.Len(t, f, 8)
				assert.Equal(t, []string{"sample", impl, slot, e.op, "7", strconv.Itoa(b)}, f[:6])
				// The first turn of each entry and slot is its warm-up batch.
				turn := slotsBefore*(batches+1) + 1 + b
				assert.Equal(t, strconv.Itoa(turn), f[6], "turn of sample %d", i)
				us, err := strconv.ParseFloat(f[7], 64)
				assert.NoError(t, err)
				assert.Positive(t, us)
				i++
			}
			slotsBefore++
		}
	}
	var bytes []string
	for _, f := range by["bytes"] {
		bytes = append(bytes, strings.Join(f[1:], " "))
	}
	assert.Equal(t, []string{
		"cudapool alloc/ipc/1KiB " + gs, "cudart alloc/ipc/1KiB " + gs,
		"cudapool alloc/local/1KiB 1024", "cudart alloc/local/1KiB 1024",
		"cudapool alloc/hit/1MiB " + gs,
		"cudapool alloc/local/1MiB 1048576", "cudart alloc/local/1MiB 1048576",
		"cudapool alloc/miss/1KiB " + gs,
	}, bytes)
}

// A plan whose bytes are not what the pool allocates fails before measuring: the
// columns would not allocate the same bytes.
func TestAllocRingRefusesUnequalBytes(t *testing.T) {
	picked, err := choose.Runtime(choose.Software)
	rt := picked.Runtime
	require.NoError(t, err)
	plan, err := parsePlan("ipc/1KiB=1024")
	require.NoError(t, err)
	p := fifo(t, t.TempDir(), "turn")
	rg, err := openRing(p, p)
	require.NoError(t, err)
	defer func() { _ = rg.in.Close() }()  // test cleanup
	defer func() { _ = rg.out.Close() }() // test cleanup
	require.NoError(t, rg.pass(-1))
	var out strings.Builder
	err = allocRing(&reporter{w: &out}, rt, plan, rg, 0, 2, 10)
	require.ErrorContains(t, err, "would not allocate the same bytes")
	assert.NotContains(t, out.String(), "sample ")
}

// A participant whose turn never comes fails within its timeout, saying why.
func TestAllocRingGivesUpWithoutATurn(t *testing.T) {
	p := fifo(t, t.TempDir(), "turn")
	rg, err := openRing(p, p)
	require.NoError(t, err)
	defer func() { _ = rg.in.Close() }()  // test cleanup
	defer func() { _ = rg.out.Close() }() // test cleanup
	rg.timeout = 50 * time.Millisecond
	start := time.Now()
	_, err = rg.take()
	require.ErrorContains(t, err, "no turn came")
	assert.Less(t, time.Since(start), 5*time.Second)
}

func TestParsePlan(t *testing.T) {
	plan, err := parsePlan("ipc/1KiB=2097152 local/64MiB=67108864")
	require.NoError(t, err)
	assert.Equal(t, []planEntry{
		{kind: "ipc", asked: 1 << 10, bytes: 2 << 20, op: "alloc/ipc/1KiB"},
		{kind: "local", asked: 64 << 20, bytes: 64 << 20, op: "alloc/local/64MiB"},
	}, plan)
	for _, bad := range []string{"", "ipc/1KiB", "fabric/1KiB=1024", "hit/1KiB", "ipc/1KB=1024", "ipc/0KiB=1", "ipc/1MiB=1024", "ipc/1KiB=x"} {
		_, err := parsePlan(bad)
		assert.Error(t, err, "plan %q", bad)
	}
}

// checkCache refuses a pool whose cache did not take the path an entry measures.
func TestCheckCacheRefusesTheWrongPath(t *testing.T) {
	picked, err := choose.Runtime(choose.Software)
	rt := picked.Runtime
	require.NoError(t, err)
	g, err := granularityOf(rt)
	require.NoError(t, err)
	plan, err := parsePlan(fmt.Sprintf("hit/1KiB=%d miss/1KiB=%d ipc/1KiB=%d", g, g, g))
	require.NoError(t, err)
	hit, miss, plain := plan[0], plan[1], plan[2]
	run := func(e planEntry, n int) *pool.Pool { // n Alloc+Free pairs on one stream
		p, s, done, err := freshPool(rt, e.poolOptions()...)
		require.NoError(t, err)
		t.Cleanup(done)
		for range n {
			b, err := p.Alloc(context.Background(), e.asked, s)
			require.NoError(t, err)
			require.NoError(t, p.Free(b, s))
		}
		return p
	}
	assert.NoError(t, checkCache(run(hit, 5), hit, 5))
	assert.NoError(t, checkCache(run(miss, 5), miss, 5))
	assert.NoError(t, checkCache(run(plain, 5), plain, 5))
	assert.ErrorContains(t, checkCache(run(plain, 5), hit, 5), "did not take the path measured")
	assert.ErrorContains(t, checkCache(run(hit, 5), miss, 5), "did not take the path measured")
	assert.ErrorContains(t, checkCache(run(hit, 5), hit, 6), "did not take the path measured")
	assert.ErrorContains(t, checkCache(run(miss, 5), plain, 5), "did not take the path measured")
}

// The kv rows, few samples, on the software device: each is reported once with the
// samples its shape asks for, and nothing fails.
func TestKVRowsOnSoftwareDevice(t *testing.T) {
	sh := quickShape
	by, got, out := softwareRows(t, func(r *reporter, rt cudart.Runtime, onGPU bool, sh shape) {
		kvRows(r, rt, onGPU, sh, 8<<30) // 32 regions of 8 chunks
	}, sh)
	want := map[string]int{"kv/dial": kvReplicas, "kv/slab": 1, "kv/match512": sh.samples, "kv/match512+hash": sh.samples,
		"kv/hash512": sh.samples, "kv/visible": sh.samples, "kv/pages/b16": sh.rounds, "kv/pages/b64": sh.rounds,
		"kv/pages/b256": sh.rounds, "kv/pages/b512": sh.rounds, "kv/idle-cpu": 1,
		"kv/grow": kvGrowRounds(sh) * 7 * 32} // a sample a chunk: 7 growths of a step of 32 chunks, from one step to eight
	assert.Len(t, got, len(want))
	for op, n := range want {
		assert.Equal(t, strconv.Itoa(n), got[op], "%s: samples", op)
	}
	assert.Len(t, by["#"], 6+len(kvBatches), "four percentile lines, the growth's, a cycle line per batch and the owner's figures:\n%s", out)
	assert.Equal(t, [][]string{
		strings.Fields("meta kv-grow 8.0 GiB slab (32 regions of 256 MiB, in chunks of 32 MiB) from one step of 32 chunks (1.0 GiB) to its 256, on device 0, mapped by 3 idle replica processes"),
		strings.Fields("meta kv-slab 8.0 GiB (16384 pages, 32 regions of 256 MiB, in chunks of 32 MiB) on device 0, mapped by 4 replica processes"),
	}, by["meta"])
}

// softwareRows runs rows with shape sh on the software device and returns the lines
// by kind, each result's sample count by op, and the whole output, once it has
// checked that no row failed, every median is positive (kv/idle-cpu's may be 0) and
// no rule was broken.
func softwareRows(t *testing.T, rows func(*reporter, cudart.Runtime, bool, shape), sh shape) (map[string][][]string, map[string]string, string) {
	t.Helper()
	picked, err := choose.Runtime(choose.Software)
	require.NoError(t, err)
	var out strings.Builder
	r := &reporter{w: &out}
	rows(r, picked.Runtime, false, sh)
	require.NoError(t, choose.Violations(picked.Runtime), "the software device saw violations")
	by := lines(t, out.String())
	require.Empty(t, by["fail"], "failures:\n%s", out.String())
	got := map[string]string{}
	for _, f := range by["result"] {
		require.Len(t, f, 7, "result line %q", f)
		got[f[2]] = f[6]
		median, err := strconv.ParseFloat(f[4], 64)
		require.NoError(t, err)
		if f[2] == "kv/idle-cpu" {
			assert.GreaterOrEqual(t, median, 0.0, f[2])
		} else {
			assert.Positive(t, median, f[2])
		}
	}
	return by, got, out.String()
}

// The host tier's rows, on the software device: each cycle's prompt is evicted,
// restored byte-exact and reported, and nothing fails.
func TestKVTierRowsOnSoftwareDevice(t *testing.T) {
	sh := quickShape
	by, got, out := softwareRows(t, kvTierRows, sh)
	assert.Equal(t, map[string]string{"kv/host/restore32k": strconv.Itoa(sh.rounds), "kv/host/spill": strconv.Itoa(sh.rounds)}, got)
	require.Len(t, by["#"], 1, "the host tier's figures:\n%s", out)
	assert.Contains(t, strings.Join(by["#"][0], " "), "0 lost", "a page was lost:\n%s", out)
}

// A measurement the host has too few GPUs for is not run, and says so, unless
// CUDAPOOL_REQUIRE_GPUS demands them: then it fails.
func TestNeedsMoreGPUs(t *testing.T) {
	for _, c := range []struct {
		demanded, want string
		failed         bool
	}{
		{"", "needs cudapool read/other-gpu 2\n", false},
		{"1", "needs cudapool read/other-gpu 2\n", false},
		{"2", "fail cudapool read/other-gpu 1 GPU(s) here; CUDAPOOL_REQUIRE_GPUS=2 demands 2\n", true},
	} {
		t.Setenv("CUDAPOOL_REQUIRE_GPUS", c.demanded)
		var out bytes.Buffer
		r := &reporter{w: &out}
		r.needs("cudapool", "read/other-gpu", 2, 1)
		assert.Equal(t, c.want, out.String(), "CUDAPOOL_REQUIRE_GPUS=%q", c.demanded)
		assert.Equal(t, c.failed, r.failed, "CUDAPOOL_REQUIRE_GPUS=%q", c.demanded)
	}
}
