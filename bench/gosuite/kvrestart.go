package main

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"path/filepath"
	"strings"
	"time"

	"github.com/cudapool/cudapool/cudart"
	"github.com/cudapool/cudapool/cudart/choose"
	"github.com/cudapool/cudapool/kv"
	"github.com/cudapool/cudapool/kv/owner"
	"github.com/cudapool/cudapool/kv/replica"
)

// The restart row ("gosuite kv-restart"): a keeper (owner.Keep) of a 4 GiB llama-0.85b slab, a
// page server over it (owner.Listen with Keeper and an index) and kvRestartReplicas
// replica processes dialed WithReconnect, each a process of its own. One replica seals
// a 32,768-token prompt (2,048 pages); every replica matches it. Then, per sample, the
// page server is SIGKILLed and a new one started:
//
//	kv/restart   ms from the new page server's start (its exec) until every replica
//	             has reattached and matched all 2,048 pages of the prompt; the pages'
//	             bytes are checked afterwards
const (
	kvKeeperRole        = "kvkeeper"
	kvOwnerRole         = "kvowner"
	kvRestartRole       = "kvrestart"
	kvRestartReplicas   = 3
	kvRestartPages      = 2048
	kvRestartSlabPages  = 8192
	kvRestartNamespace  = "restart"
	kvRestartTokenStart = 11
)

func kvRestartGeometry() kv.Geometry {
	g, _ := kv.Layout("llama-0.85b")
	g.Pages = kvRestartSlabPages
	return g
}

// kvRestartRow measures kv/restart.
func kvRestartRow(r *reporter, onGPU bool, sh shape) {
	const op = "kv/restart"
	kind := choose.Software
	if onGPU {
		kind = choose.GPU
	}
	dir, err := os.MkdirTemp("", "gosuite-kvr")
	if err != nil {
		r.fail("cudapool", op, err)
		return
	}
	defer func() { _ = os.RemoveAll(dir) }() // best effort: a leftover file is harmless
	w := &restartRow{kind: kind, dir: dir}
	defer w.stop()
	if err := w.start(); err != nil {
		r.fail("cudapool", op, err)
		return
	}
	r.measure("cudapool", op, "ms", func() ([]float64, error) {
		var v []float64
		for range min(sh.rounds, 3) { // each round starts a process: CUDA's start is most of it
			ms, err := w.restart()
			if err != nil {
				return nil, err
			}
			v = append(v, ms)
		}
		return v, nil
	})
}

// restartRow is the processes of one [kvRestartRow] on dir: the keeper, the page
// server and the replicas.
type restartRow struct {
	kind, dir string
	keeper    *consumerSide
	own       *consumerSide // the page server now
	reps      []*consumerSide
}

// start starts the keeper, the page server and kvRestartReplicas replicas; the
// first replica seals the prompt and every replica matches it. On failure what it
// started is left to stop.
func (w *restartRow) start() error {
	var err error
	if w.keeper, err = startRole(kvKeeperRole, w.kind, w.dir); err != nil {
		return fmt.Errorf("the keeper: %w", err)
	}
	if w.own, err = startRole(kvOwnerRole, w.kind, w.dir); err != nil {
		return fmt.Errorf("the page server: %w", err)
	}
	for range kvRestartReplicas {
		c, err := startRole(kvRestartRole, w.kind, w.dir)
		if err != nil {
			return fmt.Errorf("a replica: %w", err)
		}
		w.reps = append(w.reps, c)
	}
	if _, err := w.reps[0].ask("seal", "sealed"); err != nil {
		return err
	}
	for _, c := range w.reps {
		if _, err := c.ask("match", "matched"); err != nil {
			return err
		}
	}
	return nil
}

// restart SIGKILLs the page server, starts a new one and returns the ms from its
// start until the last replica has reattached and matched the whole prompt, once
// every replica has checked the prompt's bytes.
func (w *restartRow) restart() (float64, error) {
	w.own.kill() // SIGKILL, and reaped
	for _, c := range w.reps {
		if err := c.say("await"); err != nil {
			return 0, err
		}
	}
	t0 := time.Now()
	own, err := startRole(kvOwnerRole, w.kind, w.dir)
	if err != nil {
		return 0, fmt.Errorf("the restarted page server: %w", err)
	}
	w.own = own
	last := t0
	for _, c := range w.reps {
		at, err := c.await("at")
		if err != nil {
			return 0, err
		}
		if len(at) != 1 {
			return 0, fmt.Errorf("replica %d said at %v", c.pid, at)
		}
		if t := time.Unix(0, int64(at[0])); t.After(last) {
			last = t
		}
	}
	for _, c := range w.reps {
		if _, err := c.ask("check", "checked"); err != nil {
			return 0, err
		}
	}
	return float64(last.Sub(t0).Microseconds()) / 1000, nil
}

// stop kills every process of the row that was started: the page server first.
func (w *restartRow) stop() {
	if w.own != nil {
		w.own.kill()
	}
	for _, c := range w.reps {
		c.kill()
	}
	if w.keeper != nil {
		w.keeper.kill()
	}
}

// kvRestartRuntime is the runtime of kind for the restart row's processes.
func kvRestartRuntime(kind string) (cudart.Runtime, error) {
	picked, err := choose.Runtime(kind)
	if err != nil {
		return nil, err
	}
	return picked.Runtime, nil
}

// kvKeeperMain is the restart row's keeper: "ready" once it keeps the slab, then until
// its stdin ends.
func kvKeeperMain(args []string) int {
	fail := func(err error) int { fmt.Fprintln(os.Stderr, "gosuite kvkeeper:", err); return 1 }
	if len(args) != 2 {
		return fail(errors.New("want KIND DIR"))
	}
	rt, err := kvRestartRuntime(args[0])
	if err != nil {
		return fail(err)
	}
	k, err := owner.Keep(args[1], rt, kvRestartGeometry())
	if err != nil {
		return fail(err)
	}
	fmt.Println("ready")
	in := bufio.NewScanner(os.Stdin)
	for in.Scan() {
	}
	ctx, cancel := context.WithTimeout(context.Background(), opTimeout)
	defer cancel()
	if err := k.Close(ctx); err != nil {
		return fail(err)
	}
	return 0
}

// kvOwnerMain is the restart row's page server: "ready" once it serves, then until it
// is killed or its stdin ends.
func kvOwnerMain(args []string) int {
	fail := func(err error) int { fmt.Fprintln(os.Stderr, "gosuite kvowner:", err); return 1 }
	if len(args) != 2 {
		return fail(errors.New("want KIND DIR"))
	}
	rt, err := kvRestartRuntime(args[0])
	if err != nil {
		return fail(err)
	}
	quiet := slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: slog.LevelError}))
	o, err := owner.Listen(args[1], rt, kvRestartGeometry(), owner.WithKeeper(nil),
		owner.WithIndex(filepath.Join(args[1], owner.IndexFile)), owner.WithLogger(quiet), owner.WithInitialPages(kvRestartGeometry().Pages))
	if err != nil {
		return fail(err)
	}
	fmt.Fprintf(os.Stderr, "# gosuite kvowner: %s\n", o.Recovery())
	fmt.Println("ready")
	in := bufio.NewScanner(os.Stdin)
	for in.Scan() {
	}
	ctx, cancel := context.WithTimeout(context.Background(), opTimeout)
	defer cancel()
	if err := o.Close(ctx); err != nil {
		return fail(err)
	}
	return 0
}

// kvRestartMain is a replica of the restart row, driven by lines on stdin:
//
//	seal    write and seal the prompt's 2,048 pages: "sealed"
//	match   match them all: "matched"
//	await   after the page server's death: wait until reattached and a match hits
//	        every page: "at UNIX-NANOSECONDS"
//	check   match and check every page's bytes: "checked"
func kvRestartMain(args []string) int {
	fail := func(err error) int { fmt.Fprintln(os.Stderr, "gosuite kvrestart:", err); return 1 }
	if len(args) != 2 {
		return fail(errors.New("want KIND DIR"))
	}
	rt, err := kvRestartRuntime(args[0])
	if err != nil {
		return fail(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Minute)
	defer cancel()
	quiet := slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: slog.LevelError}))
	rp, err := replica.Dial(ctx, args[1], rt, 0, replica.WithNamespace(kvRestartNamespace), replica.WithReconnect(), replica.WithLogger(quiet))
	if err != nil {
		return fail(err)
	}
	s, err := rt.StreamCreate(0, cudart.StreamNonBlocking)
	if err != nil {
		return fail(err)
	}
	g := rp.Geometry()
	toks := make([]int32, kvRestartPages*g.TokensPerPage)
	for i := range toks {
		toks[i] = int32(i*7919 + kvRestartTokenStart)
	}
	k := &restartReplica{rp: rp, rt: rt, s: s, g: g, hashes: rp.Hashes(toks)}
	return serveReplica(ctx, rp, rt, s, func(line string) (string, error) { return k.obey(ctx, strings.TrimSpace(line)) }, fail)
}

// restartReplica is the state of one [kvRestartMain]: its replica, runtime and
// stream, and the prompt's hashes and, once matched, the pages it was sealed in.
type restartReplica struct {
	rp       *replica.Replica
	rt       cudart.Runtime
	s        cudart.Stream
	g        kv.Geometry
	hashes   []kv.Hash
	sealedAs []uint32 // the pages as sealed: what each holds
}

// obey runs one command of [kvRestartMain] and returns its reply.
func (k *restartReplica) obey(ctx context.Context, cmd string) (string, error) {
	switch cmd {
	case "seal":
		return k.seal(ctx)
	case "match":
		l, err := k.match(ctx)
		if err != nil {
			return "", err
		}
		k.sealedAs = append([]uint32(nil), l.Pages()...)
		return "matched", k.rp.Release(ctx, l, k.s)
	case "await":
		return k.await(ctx)
	case "check":
		return k.check(ctx)
	}
	return "", fmt.Errorf("unknown command %q", cmd)
}

// match leases every page of the prompt; a match of fewer is released and fails.
func (k *restartReplica) match(ctx context.Context) (*replica.Lease, error) {
	l, err := k.rp.Match(ctx, k.hashes)
	if err != nil {
		return nil, err
	}
	if len(l.Pages()) != len(k.hashes) {
		err = fmt.Errorf("matched %d of %d pages", len(l.Pages()), len(k.hashes))
		return nil, errors.Join(err, k.rp.Release(ctx, l, k.s))
	}
	return l, nil
}

// seal writes each page of the prompt with a byte of its own (page%251+1) and
// seals them all, waiting until they are visible.
func (k *restartReplica) seal(ctx context.Context) (string, error) {
	w, err := k.rp.Alloc(ctx, len(k.hashes))
	if err != nil {
		return "", err
	}
	for _, p := range w.Pages() {
		if err := k.rt.MemsetAsync(0, k.rp.Addr(0, kv.K, int(p)), byte(p%251+1), k.g.PageBytes(), k.s); err != nil {
			return "", err
		}
	}
	res, err := k.rp.Seal(ctx, w, k.hashes, k.s, replica.WaitVisible())
	if err != nil {
		return "", err
	}
	if res.Visible != len(k.hashes) {
		return "", fmt.Errorf("sealed %+v", res)
	}
	return "sealed", nil
}

// await, after the page server's death, waits until the replica has reattached and
// a match hits every page, and says when.
func (k *restartReplica) await(ctx context.Context) (string, error) {
	for {
		if err := k.rp.WaitAttached(ctx); err != nil {
			return "", err
		}
		l, err := k.match(ctx)
		if err == nil {
			at := time.Now().UnixNano()
			return fmt.Sprintf("at %d", at), k.rp.Release(ctx, l, k.s)
		}
		if !errors.Is(err, kv.ErrOwnerGone) {
			return "", err
		}
	}
}

// check matches the prompt and checks that each page is the one it was sealed in
// and holds its byte in the first and last of its last 4 bytes.
func (k *restartReplica) check(ctx context.Context) (string, error) {
	l, err := k.match(ctx)
	if err != nil {
		return "", err
	}
	got := make([]byte, 4)
	for i, p := range l.Pages() {
		if p != k.sealedAs[i] {
			return "", fmt.Errorf("page %d of the prompt is page %d, was %d", i, p, k.sealedAs[i])
		}
		if err := k.rt.MemcpyDtoHAsync(0, got, k.rp.Addr(0, kv.K, int(p))+cudart.DevicePtr(k.g.PageBytes()-4), k.s); err != nil {
			return "", err
		}
		if err := k.rt.StreamSynchronize(0, k.s); err != nil {
			return "", err
		}
		if want := byte(p%251 + 1); got[0] != want || got[3] != want {
			return "", fmt.Errorf("page %d holds %x, want %x", p, got, want)
		}
	}
	return "checked", k.rp.Release(ctx, l, k.s)
}
