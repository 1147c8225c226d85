package main

import (
	"bufio"
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/dustin/go-humanize"

	"github.com/cudapool/cudapool/cudart"
	"github.com/cudapool/cudapool/cudart/choose"
	"github.com/cudapool/cudapool/kv"
	"github.com/cudapool/cudapool/kv/owner"
	"github.com/cudapool/cudapool/kv/replica"
)

// The KV page pool's rows ("gosuite [-kv-bytes SIZE] kv"): an owner (kv/owner) in this
// process, its slab of SIZE (default 4 GiB) on device 0 with the llama-0.85b layout, and
// kvReplicas replica processes (kv/replica). A "meta kv-slab" line says the slab's size,
// layout (regions and chunks, every chunk mapped) and replicas.
//
//	kv/dial            ms per replica process: its Dial, every chunk of the whole
//	                   slab imported and mapped (the owner maps all of it at its
//	                   start, and each replica says it has every chunk mapped; one
//	                   sample a replica)
//	kv/slab            the slab's bytes (one sample), for the table's verdicts
//	kv/match512        one replica's Match of 512 visible pages (one round trip, the
//	                   lease included), hashes computed beforehand; us per Match
//	kv/match512+hash   the same with the 512 pages' prefix hashes computed in the loop
//	kv/hash512         the 512 prefix hashes of 8,192 tokens alone (kv.AppendPrefixHashes
//	                   into a reused slice); us per call
//	kv/visible         seal -> visible after the writer's work has completed: a replica
//	                   seals a page behind memsets still running on its stream (the
//	                   seal answers pending), waits for its stream, then Matches the
//	                   page until it is visible; us from the stream's completion to the
//	                   end of the first Match that finds it (one Match's round trip is
//	                   in it)
//	kv/pages/bNNN      pages per second through alloc + seal (waiting until visible) +
//	                   match + release of batches of NNN pages, by kvReplicas replicas
//	                   at once, one window per sample; each batch has hashes of its own
//	                   (counters, not SHA-256: the rate is the pool's, not the hash's).
//	                   A "# kv cycle" line gives the mean time of each step of a cycle.
//	kv/grow            the slab's growth by a step, from the owner's mapping to every
//	                   replica's (kvgrow.go: a slab and replicas of its own, first)
//	kv/idle-cpu        the owner's process (the page server and its slab exporter, with
//	                   kvReplicas replicas connected and idle): % of one CPU over the
//	                   idle window (10 s; 1 s -quick), from /proc/self/stat
//
// The latency rows print a "# pct" line with p50 and p99 beside the result line.
const (
	kvReplicaRole = "kvreplica"
	kvReplicas    = 4
	kvLatency     = 512
)

var kvBatches = []int{16, 64, 256, 512}

// defaultKVSlab is the kv rows' slab without -kv-bytes: room for every replica's
// largest batch in flight (written and read) twice over, and eviction takes the least
// recently used. A replica pins at most 3 batches at any instant (its write lease, its
// read lease and its latest release while it settles; with nothing queued on the
// stream a release settles at once), so 4 replicas pin at most 6,144 of the 8,192
// pages of 512 KiB, and an Alloc finds older evictable pages before a batch just
// sealed. That bounds the pins, not time: a replica's process descheduled between its
// seal and its match (a loaded host) lets the others' allocs take every page less
// recent than its batch, and then the batch, which the owner may evict (kv/owner's doc
// says so). TestKVRowsOnSoftwareDevice then failed once in 37 runs ("matched 0 of 512
// pages"); the rate row now counts such a batch (TestKVRateCountsABatchEvictedBeforeItsMatch
// forces it). The software device's memory is sparse: pages never written cost nothing.
const defaultKVSlab = 4 << 30

// kvRateRows measures the rows kv/pages/b<B>, one per batch of kvBatches: each
// round, every replica of cs cycles batches of B pages for sh.window at once, and
// a sample is their pages a second, summed; a comment line gives a cycle's steps.
func kvRateRows(r *reporter, cs []*consumerSide, sh shape) {
	for _, b := range kvBatches {
		op := fmt.Sprintf("kv/pages/b%d", b)
		var steps [4]float64 // us, summed over the replicas' cycles
		cycles, evicted := 0.0, 0.0
		r.measure("cudapool", op, "pages/s", func() ([]float64, error) {
			var rates []float64
			for range sh.rounds {
				for _, c := range cs {
					if err := c.say(fmt.Sprintf("rate %d %d", b, sh.window.Microseconds())); err != nil {
						return nil, err
					}
				}
				total := 0.0
				for _, c := range cs {
					v, err := c.await("pages")
					if err != nil {
						return nil, err
					}
					if len(v) != 8 || v[1] <= 0 {
						return nil, fmt.Errorf("replica %d said %v, want PAGES SECONDS CYCLES ALLOC SEAL MATCH RELEASE EVICTED", c.pid, v)
					}
					total += v[0] / v[1]
					cycles += v[2]
					evicted += v[7]
					for i := range steps {
						steps[i] += v[3+i]
					}
				}
				rates = append(rates, total)
			}
			return rates, nil
		})
		if cycles > 0 {
			fmt.Fprintf(r.w, "# kv cycle b%d us per cycle: alloc %.1f seal %.1f match %.1f release %.1f (%d cycles of %d replicas, %d batches evicted before their match)\n",
				b, steps[0]/cycles, steps[1]/cycles, steps[2]/cycles, steps[3]/cycles, int(cycles), kvReplicas, int(evicted))
		}
	}
}

// kvRows measures the KV page pool's rows on a slab of slabBytes (rounded down to
// whole pages).
func kvRows(r *reporter, rt cudart.Runtime, onGPU bool, sh shape, slabBytes uint64) {
	kind := choose.Software
	if onGPU {
		kind = choose.GPU
	}
	g, _ := kv.Layout("llama-0.85b")
	g.Pages = 1
	g.Pages = int(slabBytes / g.SlabBytes())
	kvGrowRow(r, rt, kind, sh, g) // before this slab is made: each may be most of the device
	dir, err := os.MkdirTemp("", "gosuite-kv")
	if err != nil {
		r.fail("cudapool", "kv", err)
		return
	}
	defer func() { _ = os.RemoveAll(dir) }() // best effort: a leftover file is harmless, and the first error is the one returned
	quiet := slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: slog.LevelError}))
	o, err := owner.Listen(dir, rt, g, owner.WithLogger(quiet), owner.WithInitialPages(g.Pages)) // all mapped: the rows measure pages, not growth
	if err != nil {
		r.fail("cudapool", "kv", err)
		return
	}
	fmt.Fprintf(r.w, "meta kv-slab %s (%d pages, %v) on device 0, mapped by %d replica processes\n",
		humanize.IBytes(g.SlabBytes()), g.Pages, o.Layout(), kvReplicas)
	var cs []*consumerSide
	defer func() {
		for _, c := range cs {
			if err := c.quit(); err != nil {
				r.fail("cudapool", "kv/replica", err)
			}
		}
		ctx, cancel := context.WithTimeout(context.Background(), opTimeout)
		defer cancel()
		if err := o.Close(ctx); err != nil {
			r.fail("cudapool", "kv/owner", err)
		}
	}()
	for range kvReplicas {
		c, err := startRole(kvReplicaRole, kind, dir)
		if err != nil {
			r.fail("cudapool", "kv/replica", err)
			return
		}
		cs = append(cs, c)
	}
	var dials []float64
	for _, c := range cs {
		v, err := c.ask("dial", "dialed")
		if err == nil && (len(v) != 2 || int(v[1]) != o.Layout().Chunks()) {
			err = fmt.Errorf("replica %d said %v, want MS and the slab's %d chunks mapped", c.pid, v, o.Layout().Chunks())
		}
		if err != nil {
			r.fail("cudapool", "kv/dial", err)
			return
		}
		dials = append(dials, v[0])
	}
	r.result("cudapool", "kv/dial", "ms", dials)
	r.result("cudapool", "kv/slab", "B", []float64{float64(g.SlabBytes())})
	if _, err := cs[0].ask(fmt.Sprintf("prepare %d", kvLatency), "prepared"); err != nil {
		r.fail("cudapool", "kv/match512", err)
		return
	}
	for _, hashing := range []int{0, 1} {
		op := "kv/match512"
		if hashing == 1 {
			op += "+hash"
		}
		v, err := cs[0].ask(fmt.Sprintf("latency %d %d %d %d", kvLatency, sh.samples, sh.warmup, hashing), "samples")
		if err != nil {
			r.fail("cudapool", op, err)
			continue
		}
		fmt.Fprintf(r.w, "# pct cudapool %s us p50 %.2f p99 %.2f\n", op, percentile(v, 0.5), percentile(v, 0.99))
		r.result("cudapool", op, "us", v)
	}
	r.measure("cudapool", "kv/hash512", "us", func() ([]float64, error) { return hashSamples(g, sh), nil })
	scratch := 1 << 20 // the software device writes every byte of a memset
	if onGPU {
		scratch = 256 << 20
	}
	c0, _ := cpuTicks()
	t0 := time.Now()
	if v, err := cs[1].ask(fmt.Sprintf("visible %d %d %d", sh.samples, sh.warmup, scratch), "samples"); err != nil {
		r.fail("cudapool", "kv/visible", err)
	} else {
		// How much CPU the owner spent while seals were pending: its waits sleep, or spin.
		c1, _ := cpuTicks()
		fmt.Fprintf(r.w, "# pct cudapool kv/visible us p50 %.2f p99 %.2f; the owner used %.0f%% of a CPU meanwhile\n",
			percentile(v, 0.5), percentile(v, 0.99), float64(c1-c0)/clockTicks/time.Since(t0).Seconds()*100)
		r.result("cudapool", "kv/visible", "us", v)
	}
	kvRateRows(r, cs, sh)
	idle := 10 * time.Second
	if sh.samples < fullShape.samples {
		idle = time.Second
	}
	r.measure("cudapool", "kv/idle-cpu", "%cpu", func() ([]float64, error) {
		pct, err := idleCPU(idle)
		return []float64{pct}, err
	})
	st := o.Stats().Devices[0]
	fmt.Fprintf(r.w, "# kv owner: %d seals, %d hits, %d misses, %d evictions, %d duplicates\n", st.Seals, st.Hits, st.Misses, st.Evictions, st.Duplicates)
}

// hashSamples times kv.AppendPrefixHashes of 8,192 tokens in pages of g, into a
// reused slice: us per call.
func hashSamples(g kv.Geometry, sh shape) []float64 {
	toks := make([]int32, 8192)
	for i := range toks {
		toks[i] = int32(i * 7919 % 128000)
	}
	dst := make([]kv.Hash, 0, len(toks)/g.TokensPerPage)
	v := make([]float64, 0, sh.samples)
	for i := range sh.samples + sh.warmup {
		t0 := time.Now()
		dst = kv.AppendPrefixHashes(dst[:0], "gosuite", toks, g.TokensPerPage)
		if d := time.Since(t0); i >= sh.warmup {
			v = append(v, micros(d))
		}
	}
	return v
}

// idleCPU is the share of one CPU (%) that this process used over window, from the
// utime and stime fields of /proc/self/stat.
func idleCPU(window time.Duration) (float64, error) {
	t0, err := cpuTicks()
	if err != nil {
		return 0, err
	}
	start := time.Now()
	time.Sleep(window)
	t1, err := cpuTicks()
	if err != nil {
		return 0, err
	}
	return 100 * float64(t1-t0) / clockTicks / time.Since(start).Seconds(), nil
}

// clockTicks is USER_HZ, the unit of /proc's times on Linux.
const clockTicks = 100

// cpuTicks is this process's utime + stime, in clock ticks.
func cpuTicks() (uint64, error) {
	b, err := os.ReadFile("/proc/self/stat")
	if err != nil {
		return 0, err
	}
	// The command name, in parentheses, may hold spaces: the fields count from after it.
	i := strings.LastIndexByte(string(b), ')')
	if i < 0 {
		return 0, errors.New("/proc/self/stat: no command name")
	}
	f := strings.Fields(string(b[i+1:]))
	if len(f) < 13 {
		return 0, fmt.Errorf("/proc/self/stat: %d fields after the name", len(f))
	}
	var total uint64
	for _, x := range f[11:13] { // utime, stime: fields 14 and 15 of proc(5)
		n, err := strconv.ParseUint(x, 10, 64)
		if err != nil {
			return 0, fmt.Errorf("/proc/self/stat: %w", err)
		}
		total += n
	}
	return total, nil
}

// percentile is the q-quantile of v (sorted in place).
func percentile(v []float64, q float64) float64 {
	if len(v) == 0 {
		return 0
	}
	sorted := append([]float64(nil), v...)
	slices.Sort(sorted)
	return sorted[int(q*float64(len(sorted)-1)+0.5)]
}

// kvReplicaMain is a replica process of the kv rows, driven by lines on stdin:
//
//	dial                          how long its Dial took: "dialed MS CHUNKS" (the
//	                              chunks it had mapped then)
//	fill, grow, arm C, grown      kv/grow's writer and watchers (kvgrow.go)
//	prepare N                     seal a chain of N pages: "prepared"
//	latency N SAMPLES WARMUP H    time Match (+ hashing if H is 1) of that chain and its
//	                              release: "samples US..." (the Match alone, in us)
//	visible SAMPLES WARMUP BYTES  time seal -> visible after the stream's work completed,
//	                              behind memsets of BYTES: "samples US..."
//	rate B WINDOW-US              alloc+seal+match+release batches of B pages for the
//	                              window: "pages N SECONDS CYCLES ALLOC SEAL MATCH
//	                              RELEASE EVICTED" (the steps' time summed, in us;
//	                              EVICTED batches were evicted before their match)
//	tierprep N SEED, tierevict N, tiermatch   the host tier's rows (kvtier.go)
func kvReplicaMain(args []string) int {
	fail := func(err error) int { fmt.Fprintln(os.Stderr, "gosuite kvreplica:", err); return 1 }
	if len(args) != 2 {
		return fail(errors.New("want KIND DIR"))
	}
	picked, err := choose.Runtime(args[0])
	if err != nil {
		return fail(err)
	}
	rt := picked.Runtime
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Minute)
	defer cancel()
	quiet := slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: slog.LevelError}))
	t0 := time.Now()
	rp, err := replica.Dial(ctx, args[1], rt, 0, replica.WithNamespace(strconv.Itoa(os.Getpid())), replica.WithLogger(quiet))
	if err != nil {
		return fail(err)
	}
	dialed := time.Since(t0)
	mapped, _ := rp.Mapped()
	s, err := rt.StreamCreate(0, cudart.StreamNonBlocking)
	if err != nil {
		return fail(err)
	}
	k := &kvLoad{r: rp, rt: rt, s: s, seq: uint64(os.Getpid()) << 32, dialed: dialed, mapped: mapped}
	return serveReplica(ctx, rp, rt, s, func(line string) (string, error) { return k.obey(ctx, strings.Fields(line)) }, fail)
}

// serveReplica says "ready", answers each line of stdin with obey's reply, and at its
// end closes rp and destroys s; a command that fails ends it, through fail.
func serveReplica(ctx context.Context, rp *replica.Replica, rt cudart.Runtime, s cudart.Stream, obey func(line string) (string, error), fail func(error) int) int {
	out := &lineWriter{w: os.Stdout}
	out.say("ready")
	in := bufio.NewScanner(os.Stdin)
	for in.Scan() {
		reply, err := obey(in.Text())
		if err != nil {
			_ = rp.Close(ctx) // cleanup: the command's error is the one returned
			return fail(fmt.Errorf("%q: %w", in.Text(), err))
		}
		out.say(reply)
	}
	if err := rp.Close(ctx); err != nil {
		return fail(err)
	}
	if err := rt.StreamDestroy(0, s); err != nil {
		return fail(err)
	}
	if err := choose.Violations(rt); err != nil {
		return fail(err)
	}
	return 0
}

// kvLoad is a replica process's side of the kv rows.
type kvLoad struct {
	r      *replica.Replica
	rt     cudart.Runtime
	s      cudart.Stream
	tokens []int32   // the prepared chain's
	chain  []kv.Hash // its hashes
	seq    uint64    // the counter the rate's hashes are made of
	dialed time.Duration
	mapped int        // chunks mapped when Dial returned
	watch  *growWatch // kv/grow's spin, armed (kvgrow.go)

	tierChain []kv.Hash // the host tier rows' prompt (kvtier.go)
	afterSeal func()    // a test's, run between a rate cycle's seal and its match; nil in a replica
}

func (k *kvLoad) obey(ctx context.Context, f []string) (string, error) {
	nums := make([]int, len(f)-1)
	for i, x := range f[1:] {
		n, err := strconv.Atoi(x)
		if err != nil {
			return "", err
		}
		nums[i] = n
	}
	switch {
	case f[0] == "dial" && len(nums) == 0:
		return fmt.Sprintf("dialed %.3f %d", float64(k.dialed.Microseconds())/1e3, k.mapped), nil
	case f[0] == "fill" && len(nums) == 0:
		return "filled", k.fill(ctx)
	case f[0] == "grow" && len(nums) == 0:
		return "grew", k.growOne(ctx)
	case f[0] == "arm" && len(nums) == 1:
		return "armed", k.arm(nums[0])
	case f[0] == "grown" && len(nums) == 0:
		return k.grown()
	case f[0] == "prepare" && len(nums) == 1:
		return "prepared", k.prepare(ctx, nums[0])
	case f[0] == "latency" && len(nums) == 4:
		return k.latency(ctx, nums[1], nums[2], nums[3] == 1)
	case f[0] == "visible" && len(nums) == 3:
		return k.visible(ctx, nums[0], nums[1], uint64(nums[2]))
	case f[0] == "rate" && len(nums) == 2:
		return k.rate(ctx, nums[0], time.Duration(nums[1])*time.Microsecond)
	case f[0] == "tierprep" && len(nums) == 2:
		return "prepared", k.tierPrep(ctx, nums[0], nums[1])
	case f[0] == "tierevict" && len(nums) == 1:
		return "evicted", k.tierEvict(ctx, nums[0])
	case f[0] == "tiermatch" && len(nums) == 0:
		return k.tierMatch(ctx)
	}
	return "", fmt.Errorf("unknown command %q", f)
}

// prepare seals a chain of n pages, so that Match finds all of them.
func (k *kvLoad) prepare(ctx context.Context, n int) error {
	g := k.r.Geometry()
	k.tokens = make([]int32, n*g.TokensPerPage)
	for i := range k.tokens {
		k.tokens[i] = int32(i*7919) + int32(k.seq>>32)
	}
	k.chain = k.r.Hashes(k.tokens)
	return k.sealed(ctx, k.chain, nil)
}

// sealed allocs a page for each hash, has write queue their bytes on k.s (nil: none),
// and seals them, waiting until all are visible.
func (k *kvLoad) sealed(ctx context.Context, hashes []kv.Hash, write func(pages []uint32) error) error {
	l, err := k.r.Alloc(ctx, len(hashes))
	if err != nil {
		return err
	}
	if write != nil {
		if err := write(l.Pages()); err != nil {
			return err
		}
	}
	res, err := k.r.Seal(ctx, l, hashes, k.s, replica.WaitVisible())
	if err != nil {
		return err
	}
	if res.Visible != len(hashes) {
		return fmt.Errorf("sealed %+v, want %d visible", res, len(hashes))
	}
	return nil
}

func (k *kvLoad) latency(ctx context.Context, samples, warmup int, hashing bool) (string, error) {
	v := make([]float64, 0, samples)
	for i := range samples + warmup {
		t0 := time.Now()
		hashes := k.chain
		if hashing {
			hashes = k.r.Hashes(k.tokens)
		}
		l, err := k.r.Match(ctx, hashes)
		d := time.Since(t0)
		if err != nil {
			return "", err
		}
		if len(l.Pages()) != len(k.chain) {
			return "", fmt.Errorf("matched %d of %d pages", len(l.Pages()), len(k.chain))
		}
		if err := k.r.Release(ctx, l, k.s); err != nil {
			return "", err
		}
		if i >= warmup {
			v = append(v, micros(d))
		}
	}
	return samplesLine(v), nil
}

func samplesLine(v []float64) string {
	var b strings.Builder
	b.WriteString("samples")
	for _, x := range v {
		fmt.Fprintf(&b, " %.3f", x)
	}
	return b.String()
}

// rate runs alloc+seal+match+release of batches of b pages for window, one cycle at
// least. A batch the owner evicted between its seal and its match (see
// defaultKVSlab) is counted, not a failure; a short match without an eviction behind
// it is one.
func (k *kvLoad) rate(ctx context.Context, b int, window time.Duration) (string, error) {
	hashes := make([]kv.Hash, b)
	pages, cycles, evicted := 0, 0, 0
	evictions, err := k.evictions(ctx)
	if err != nil {
		return "", err
	}
	var steps [4]time.Duration // alloc, seal, match, release
	start := time.Now()
	for cycles == 0 || time.Since(start) < window { // one cycle at least
		nextHashes(hashes, &k.seq)
		t0 := time.Now()
		w, err := k.r.Alloc(ctx, b)
		if err != nil {
			return "", err
		}
		t1 := time.Now()
		res, err := k.r.Seal(ctx, w, hashes, k.s, replica.WaitVisible())
		if err != nil {
			return "", err
		}
		if res.Visible != b {
			return "", fmt.Errorf("sealed %+v, want %d visible", res, b)
		}
		if k.afterSeal != nil {
			k.afterSeal()
		}
		t2 := time.Now()
		m, err := k.r.Match(ctx, hashes)
		if err != nil {
			return "", err
		}
		if len(m.Pages()) != b {
			now, err := k.evictions(ctx)
			switch {
			case err != nil:
				return "", err
			case now == evictions:
				return "", fmt.Errorf("matched %d of %d pages, and the owner evicted none since the row began", len(m.Pages()), b)
			}
			evicted++
		}
		t3 := time.Now()
		if err := k.r.Release(ctx, m, k.s); err != nil {
			return "", err
		}
		t4 := time.Now()
		for i, d := range []time.Duration{t1.Sub(t0), t2.Sub(t1), t3.Sub(t2), t4.Sub(t3)} {
			steps[i] += d
		}
		pages += b
		cycles++
	}
	return fmt.Sprintf("pages %d %.6f %d %.1f %.1f %.1f %.1f %d", pages, time.Since(start).Seconds(), cycles,
		micros(steps[0]), micros(steps[1]), micros(steps[2]), micros(steps[3]), evicted), nil
}

// evictions is how many pages the owner has evicted from its slabs.
func (k *kvLoad) evictions(ctx context.Context) (uint64, error) {
	st, err := k.r.Stats(ctx)
	if err != nil {
		return 0, err
	}
	var n uint64
	for _, d := range st.Devices {
		n += d.Evictions
	}
	return n, nil
}

// nextHashes fills hs with hashes made of the counter at seq, which it advances: each
// one new.
func nextHashes(hs []kv.Hash, seq *uint64) {
	for i := range hs {
		*seq++
		binary.LittleEndian.PutUint64(hs[i][:], *seq)
	}
}

// visibleMemsets is how many memsets of its scratch buffer a visible sample queues
// before its page's write and seal: enough work (on the GPU, 8 x 256 MiB, about half
// a millisecond) that the seal reaches the owner before it has run.
const visibleMemsets = 8

// visible times seal -> visible after the writer's work completed: the seal of a page
// written behind memsets of a scratch buffer of scratch bytes still running answers
// pending; the stream's completion is awaited on the host, and then Match asks for the
// page until it is visible. A sample whose seal was not pending (the work ran first)
// is taken again, up to 10 times each.
func (k *kvLoad) visible(ctx context.Context, samples, warmup int, scratch uint64) (_ string, err error) {
	rt := k.rt
	mp, err := rt.DeviceGetDefaultMemPool(0)
	if err != nil {
		return "", err
	}
	buf, err := rt.MallocFromPoolAsync(0, scratch, mp, k.s)
	if err != nil {
		return "", err
	}
	defer func() {
		if ferr := rt.FreeAsync(0, buf, k.s); err == nil {
			err = ferr
		}
	}()
	g := k.r.Geometry()
	hash := make([]kv.Hash, 1)
	v := make([]float64, 0, samples)
	missed := 0
	for i := 0; i < samples+warmup; {
		k.seq++
		binary.LittleEndian.PutUint64(hash[0][:], k.seq)
		w, err := k.r.Alloc(ctx, 1)
		if err != nil {
			return "", err
		}
		for range visibleMemsets {
			if err := rt.MemsetAsync(0, buf, byte(i), scratch, k.s); err != nil {
				return "", err
			}
		}
		page := k.r.Addr(0, kv.K, int(w.Pages()[0]))
		if err := rt.MemsetAsync(0, page, byte(i), g.PageBytes(), k.s); err != nil {
			return "", err
		}
		res, err := k.r.Seal(ctx, w, hash, k.s)
		if err != nil {
			return "", err
		}
		if err := rt.StreamSynchronize(0, k.s); err != nil {
			return "", err
		}
		done := time.Now()
		var d time.Duration
		for {
			m, err := k.r.Match(ctx, hash)
			if err != nil {
				return "", err
			}
			if len(m.Pages()) == 1 {
				d = time.Since(done)
				if err := k.r.Release(ctx, m, k.s); err != nil {
					return "", err
				}
				break
			}
			if err := ctx.Err(); err != nil {
				return "", err
			}
		}
		if res.Pending == 0 {
			if missed++; missed > 10*(samples+warmup) {
				return "", fmt.Errorf("%d seals answered visible at once: the work ran before the seal arrived", missed)
			}
			continue
		}
		if i >= warmup {
			v = append(v, micros(d))
		}
		i++
	}
	return samplesLine(v), nil
}
