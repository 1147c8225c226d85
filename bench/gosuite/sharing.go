package main

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"maps"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/cudapool/cudapool/cudart"
	"github.com/cudapool/cudapool/export/producer"
	"github.com/cudapool/cudapool/pool"
)

// producer is this process's side of the sharing measurements: a pool on device 0,
// an exporter, and consumer processes (this program again, in consumerRole).
type producerSide struct {
	rt     cudart.Runtime // calls, for the pool and exporter too
	calls  *callCounter
	kind   string // the runtime the consumers load: gpu or test
	sh     shape
	pool   *pool.Pool
	ex     *producer.Exporter
	stream cudart.Stream
	dir    string

	exClosed bool
	validate bool
	// given counts the buffers the consumers were given, each of which a validating
	// consumer checks.
	given int
}

// sharing runs the sharing measurements, each reported on its own, and then
// closes everything it made.
func sharing(r *reporter, rt cudart.Runtime, kind string, sh shape, validate bool) {
	pr, err := newProducer(rt, kind, sh, validate)
	if err != nil {
		r.fail("cudapool", "sharing", err)
		return
	}
	defer pr.close(r)

	r.measure("cudapool", "export/fresh", "us", pr.exportFresh)
	// One consumer on device 0 for the one-consumer operations, as in cref.
	c, err := pr.startConsumer(0)
	if err != nil {
		r.fail("cudapool", "open/first", err)
		return
	}
	r.measure("cudapool", "open/first", "us", func() ([]float64, error) { return pr.openFirst(c) })
	r.measure("cudapool", "open/exported", "us", func() ([]float64, error) { return pr.openExported(c) })
	r.measure("cudapool", "release", "us", func() ([]float64, error) { return pr.release(c) })
	r.measure("cudapool", "open+release/exported", "us", func() ([]float64, error) { return pr.onRing(c, "openrelease") })
	consumers := []*consumerSide{c}
	defer func() {
		if validate {
			pr.reportValidated(r, consumers)
		}
		for _, c := range consumers {
			if err := c.quit(); err != nil {
				r.fail("cudapool", "consumer", err)
			}
		}
	}()
	for len(consumers) < max(slices.Max(fanouts), sustainConsumers) {
		c, err := pr.startConsumer(0)
		if err != nil {
			r.fail("cudapool", "fanout", err)
			return
		}
		consumers = append(consumers, c)
	}
	for _, n := range fanouts {
		r.measure("cudapool", fmt.Sprintf("fanout/%d", n), "us", func() ([]float64, error) { return pr.fanOut(consumers[:n]) })
	}
	r.measure("cudapool", "sustained/4", "shares/s", func() ([]float64, error) { return pr.sustained(r, consumers[:sustainConsumers]) })
	r.measure("cudapool", "sustained/4/recycled", "shares/s", func() ([]float64, error) { return pr.recycled(r) })
	for _, batch := range []int{1, 64} {
		r.measure("cudapool", fmt.Sprintf("block/64KiB/b%d", batch), "shares/s", func() ([]float64, error) {
			return pr.blockShares(r, consumers[:sustainConsumers], batch)
		})
	}
	r.measure("cudapool", "blocklease/64KiB", "us", func() ([]float64, error) { return pr.blockLease(c) })
	r.measure("cudapool", "read/same-gpu", "GB/s", func() ([]float64, error) { return pr.read(c) })
	n, err := rt.DeviceCount()
	if err != nil {
		r.fail("cudapool", "read/other-gpu", err)
		return
	}
	if n < 2 {
		r.needs("cudapool", "read/other-gpu", 2, n)
		return
	}
	other, err := pr.startConsumer(1)
	if err != nil {
		r.fail("cudapool", "read/other-gpu", err)
		return
	}
	consumers = append(consumers, other)
	r.measure("cudapool", "read/other-gpu", "GB/s", func() ([]float64, error) { return pr.read(other) })
}

func newProducer(rt cudart.Runtime, kind string, sh shape, validate bool) (*producerSide, error) {
	return newProducerWith(rt, kind, sh, validate, "x.sock", nil, nil)
}

// newProducerWith is newProducer with options for its pool and its exporter, whose
// socket is named sock.
func newProducerWith(rt cudart.Runtime, kind string, sh shape, validate bool, sock string, poolOpts []pool.Option, listenOpts []producer.ListenOption) (*producerSide, error) {
	calls := newCallCounter(rt)
	pr := &producerSide{rt: calls, calls: calls, kind: kind, sh: sh, validate: validate}
	rt = calls
	var err error
	if pr.dir, err = os.MkdirTemp("", "gosuite"); err != nil {
		return nil, err
	}
	if pr.stream, err = rt.StreamCreate(0, cudart.StreamNonBlocking); err != nil {
		_ = os.RemoveAll(pr.dir) // best effort: a leftover file is harmless, and the first error is the one returned
		return nil, err
	}
	if pr.pool, err = pool.New(rt, 0, append([]pool.Option{pool.WithName("gosuite")}, poolOpts...)...); err != nil {
		_ = rt.StreamDestroy(0, pr.stream) // cleanup: nothing is left to undo if it fails
		_ = os.RemoveAll(pr.dir)           // best effort: a leftover file is harmless, and the first error is the one returned
		return nil, err
	}
	quiet := slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: slog.LevelError}))
	listenOpts = append([]producer.ListenOption{producer.WithoutAnnounce(), producer.WithLogger(quiet)}, listenOpts...)
	if pr.ex, err = producer.Listen(filepath.Join(pr.dir, sock), rt, listenOpts...); err != nil {
		_, _ = pr.pool.Close(context.Background(), pool.Force()) // cleanup: nothing is left to do if closing fails
		_ = rt.StreamDestroy(0, pr.stream)                       // cleanup: nothing is left to undo if it fails
		_ = os.RemoveAll(pr.dir)                                 // best effort: a leftover file is harmless, and the first error is the one returned
		return nil, err
	}
	return pr, nil
}

// closeExporter closes the producer's exporter, once.
func (pr *producerSide) closeExporter(r *reporter) {
	if pr.exClosed {
		return
	}
	pr.exClosed = true
	ctx, cancel := context.WithTimeout(context.Background(), opTimeout)
	defer cancel()
	if err := pr.ex.Close(ctx); err != nil {
		r.fail("cudapool", "close", err)
	}
}

func (pr *producerSide) close(r *reporter) {
	pr.closeExporter(r)
	ctx, cancel := context.WithTimeout(context.Background(), opTimeout)
	defer cancel()
	_ = pr.rt.StreamSynchronize(0, pr.stream) // cleanup: the measurement is over
	_, _ = pr.pool.Close(ctx, pool.Force())   // cleanup: nothing is left to do if closing fails
	_ = pr.rt.StreamDestroy(0, pr.stream)     // cleanup: nothing is left to undo if it fails
	_ = os.RemoveAll(pr.dir)                  // best effort: a leftover file is harmless, and the first error is the one returned
}

// alloc returns n buffers of size bytes, written on the producer's stream: every byte
// of buffer i is byte(i), which is what a consumer validates against the number that
// ends the buffer's name.
func (pr *producerSide) alloc(n int, size uint64) ([]*pool.Buffer, error) {
	var bufs []*pool.Buffer
	for i := range n {
		b, err := pr.pool.Alloc(context.Background(), size, pr.stream)
		if err == nil {
			err = pr.rt.MemsetAsync(0, b.Ptr(), byte(i), size, pr.stream)
		}
		if err != nil {
			_ = pr.retire("", bufs) // cleanup: the measurement is over
			return nil, err
		}
		bufs = append(bufs, b)
	}
	return bufs, nil
}

// publish publishes bufs as name<i> and returns the time each Publish took.
func (pr *producerSide) publish(name string, bufs []*pool.Buffer) ([]time.Duration, error) {
	took := make([]time.Duration, len(bufs))
	for i, b := range bufs {
		start := time.Now()
		err := pr.ex.Publish(context.Background(), fmt.Sprint(name, i), b, pr.stream)
		took[i] = time.Since(start)
		if err != nil {
			return nil, err
		}
	}
	return took, nil
}

// retire unpublishes name<i> (when name is set) and frees bufs; a buffer still
// leased is freed when its leases end.
func (pr *producerSide) retire(name string, bufs []*pool.Buffer) error {
	var errs []error
	for i, b := range bufs {
		if name != "" {
			_ = pr.ex.Unpublish(fmt.Sprint(name, i)) // cleanup: the name may be gone already
		}
		errs = append(errs, b.Free(pr.stream))
	}
	return errors.Join(errs...)
}

// shared publishes n buffers as name<i> for a measurement, and returns the function
// that retires them.
func (pr *producerSide) shared(name string, n int, size uint64) (func() error, error) {
	bufs, err := pr.alloc(n, size)
	if err != nil {
		return nil, err
	}
	if _, err := pr.publish(name, bufs); err != nil {
		_ = pr.retire(name, bufs) // cleanup: the measurement is over
		return nil, err
	}
	return func() error { return pr.retire(name, bufs) }, nil
}

// exportFresh times Publish of buffers never exported (the pool itself was, by a
// warm-up Publish): cudapool's export of a fresh buffer.
func (pr *producerSide) exportFresh() ([]float64, error) {
	warm, err := pr.shared("warm", pr.sh.warmup, shareSize)
	if err != nil {
		return nil, err
	}
	if err := warm(); err != nil {
		return nil, err
	}
	bufs, err := pr.alloc(pr.sh.samples, shareSize)
	if err != nil {
		return nil, err
	}
	if err := pr.rt.StreamSynchronize(0, pr.stream); err != nil {
		_ = pr.retire("", bufs) // cleanup: the measurement is over
		return nil, err
	}
	took, err := pr.publish("fresh", bufs)
	if rerr := pr.retire("fresh", bufs); err == nil {
		err = rerr
	}
	if err != nil {
		return nil, err
	}
	return durations(took), nil
}

// openFirst: a buffer never exported is published and opened by the consumer,
// Publish (timed here) plus Open (timed there) for each buffer.
func (pr *producerSide) openFirst(c *consumerSide) ([]float64, error) {
	var us []float64
	total := pr.sh.warmup + pr.sh.samples
	for done := 0; done < total; {
		batch := min(20, total-done) // buffers published before the consumer opens them
		name := fmt.Sprintf("first%d-", done)
		done += batch
		bufs, err := pr.alloc(batch, shareSize)
		if err == nil {
			err = pr.rt.StreamSynchronize(0, pr.stream)
		}
		if err != nil {
			return nil, err
		}
		took, err := pr.publish(name, bufs)
		var opened []float64
		if err == nil {
			opened, err = c.ask(fmt.Sprintf("fresh %s %d", name, batch), "us")
		}
		if rerr := pr.retire(name, bufs); err == nil {
			err = rerr
		}
		if err != nil {
			return nil, err
		}
		if len(opened) != batch {
			return nil, fmt.Errorf("consumer timed %d opens of %d", len(opened), batch)
		}
		pr.given += batch
		for i, d := range took {
			us = append(us, micros(d)+opened[i])
		}
	}
	return us[pr.sh.warmup:], nil
}

// openExported: the consumer opens (timed) and releases buffers published before.
func (pr *producerSide) openExported(c *consumerSide) ([]float64, error) {
	return pr.onRing(c, "open")
}

// release: the consumer opens and releases (timed) buffers published before.
func (pr *producerSide) release(c *consumerSide) ([]float64, error) {
	return pr.onRing(c, "release")
}

// onRing has the consumer cycle through a ring of buffers published before, timing
// verb's part of each cycle: open, release, or openrelease (both).
func (pr *producerSide) onRing(c *consumerSide, verb string) ([]float64, error) {
	retire, err := pr.shared("ring", pr.sh.ring, shareSize)
	if err != nil {
		return nil, err
	}
	n := pr.sh.warmup + pr.sh.samples
	us, err := c.ask(fmt.Sprintf("%s ring %d %d", verb, pr.sh.ring, n), "us")
	if rerr := retire(); err == nil {
		err = rerr
	}
	if err != nil {
		return nil, err
	}
	if len(us) != n {
		return nil, fmt.Errorf("consumer timed %d cycles of %d", len(us), n)
	}
	pr.given += n
	return us[pr.sh.warmup:], nil
}

// fanOut: a fresh buffer is published and pushed to every consumer at once
// (PushAll); latency from Publish until the last consumer's push handler holds a
// usable mapping.
func (pr *producerSide) fanOut(cs []*consumerSide) ([]float64, error) {
	var us []float64
	for rep := range pr.sh.warmup + pr.sh.fanoutReps {
		bufs, err := pr.alloc(1, shareSize)
		if err == nil {
			err = pr.rt.StreamSynchronize(0, pr.stream)
		}
		if err != nil {
			return nil, err
		}
		name := fmt.Sprintf("fan%d-%d-", len(cs), rep)
		start := monotonic()
		_, err = pr.publish(name, bufs)
		if err == nil {
			pids := make([]int, len(cs))
			for i, c := range cs {
				pids[i] = c.pid
			}
			err = pr.ex.PushAll(context.Background(), name+"0", pids...)
		}
		last := start
		for _, c := range cs {
			if err != nil {
				break
			}
			var at []float64
			at, err = c.await("pushed " + name + "0")
			if err == nil {
				last = max(last, int64(at[0]))
				pr.given++
			}
		}
		if rerr := pr.retire(name, bufs); err == nil {
			err = rerr
		}
		if err != nil {
			return nil, err
		}
		if rep >= pr.sh.warmup {
			us = append(us, float64(last-start)/1e3)
		}
	}
	return us, nil
}

// slowOpen is the time from which an Open in the sustained loop counts as a stall in
// the window lines: an Open of a buffer already exported takes tens of microseconds.
const slowOpen = time.Millisecond

// sustained: the consumers open and release buffers published before, each as fast
// as it can, for a window; a round's rate is all their shares over the window.
func (pr *producerSide) sustained(r *reporter, cs []*consumerSide) ([]float64, error) {
	retire, err := pr.shared("sus", pr.sh.ring, shareSize)
	if err != nil {
		return nil, err
	}
	defer func() { _ = retire() }() // cleanup: the measurement is over
	rates, err := pr.windows(r, "sustained/4", cs, "sus", pr.sh.ring, 1)
	if err != nil {
		return nil, err
	}
	return rates, retire()
}

// windows has the consumers open and release name<i % count>, batch names at a time, as
// fast as each can, for pr.sh.rounds windows, and returns each window's rate.
func (pr *producerSide) windows(r *reporter, op string, cs []*consumerSide, name string, count, batch int) ([]float64, error) {
	var rates []float64
	for round := range pr.sh.rounds {
		rate, err := pr.window(r, op, cs, round, name, count, batch)
		if err != nil {
			return nil, err
		}
		rates = append(rates, rate)
	}
	return rates, nil
}

// window is one window of windows, and returns its rate. It also gives a line
//
//	window cudapool OP ROUND SHARES SLOW SLOW_MS TURNS
//
// SLOW is how many Opens took slowOpen or more, SLOW_MS their time in all, and TURNS
// how many times the consumers went round the count names (summed): the stall pattern.
// The calls lines (callCounter) say what each side did for those shares.
func (pr *producerSide) window(r *reporter, op string, cs []*consumerSide, round int, name string, count, batch int) (float64, error) {
	pr.calls.take()
	for _, c := range cs {
		if err := c.say(fmt.Sprintf("sustain %s %d %d %d", name, count, pr.sh.window.Milliseconds(), batch)); err != nil {
			return 0, err
		}
	}
	var total, slow, slowMS, turns float64
	consumed := map[string]tally{}
	for _, c := range cs {
		v, err := c.await("count")
		if err != nil {
			return 0, err
		}
		if len(v) != 3 {
			return 0, fmt.Errorf("consumer %d said %d numbers after count, want 3", c.pid, len(v))
		}
		total += v[0]
		slow += v[1]
		slowMS += v[2]
		turns += v[0] / float64(count)
		calls, err := c.awaitLine("calls")
		if err == nil {
			err = decode(strings.Fields(calls), consumed)
		}
		if err != nil {
			return 0, fmt.Errorf("consumer %d: %w", c.pid, err)
		}
	}
	produced := pr.calls.take()
	pr.given += int(total)
	fmt.Fprintf(r.w, "window cudapool %s %d %.0f %.0f %.3f %.2f\n", op, round, total, slow, slowMS, turns)
	printCalls(r, op, round, "producer", produced)
	printCalls(r, op, round, "consumers", consumed)
	return total / pr.sh.window.Seconds(), nil
}

// printCalls prints the calls lines of one side of a window.
func printCalls(r *reporter, op string, round int, side string, ts map[string]tally) {
	for _, call := range slices.Sorted(maps.Keys(ts)) {
		t := ts[call]
		fmt.Fprintf(r.w, "calls cudapool %s %d %s %s %d %.3f %.3f\n", op, round, side, call, t.n,
			float64(t.total.Microseconds())/1e3, float64(t.max.Microseconds())/1e3)
	}
}

// blockSize is the size of a KV block of issue 11's block rows.
const blockSize = 64 << 10

// slab publishes the blocks of one slab of pr.sh.slabSize bytes as blk<i> (block i
// written byte(i)) and returns the block count and the function that retires them.
func (pr *producerSide) slab() (int, func() error, error) {
	bufs, err := pr.alloc(1, pr.sh.slabSize)
	if err != nil {
		return 0, nil, err
	}
	b := bufs[0]
	n := int(pr.sh.slabSize / blockSize)
	ctx := context.Background()
	retire := func(published int) error {
		for i := range published {
			_ = pr.ex.Unpublish(fmt.Sprint("blk", i)) // cleanup: the name may be gone already
		}
		return b.Free(pr.stream)
	}
	for i := range n {
		off := uint64(i) * blockSize
		err := pr.rt.MemsetAsync(0, b.Ptr()+cudart.DevicePtr(off), byte(i), blockSize, pr.stream)
		if err == nil {
			err = pr.ex.Publish(ctx, fmt.Sprint("blk", i), b, pr.stream, producer.Range(off, blockSize))
		}
		if err != nil {
			_ = retire(i) // cleanup: the measurement is over
			return 0, nil, err
		}
	}
	return n, func() error { return retire(n) }, nil
}

// hold has each consumer keep blk0 open (hold) or give it back (drop): a consumer that
// serves from a slab holds some block of it at any time, so its import of the slab
// stays mapped while it leases and returns the others.
func hold(cs []*consumerSide, verb string) error {
	for _, c := range cs {
		if _, err := c.ask(verb+" blk0 0", verb); err != nil {
			return err
		}
	}
	return nil
}

// blockShares: the consumers, each holding one block, lease and return the slab's
// blocks batch at a time as fast as they can (batch 1: Open and Release; more:
// OpenAll and ReleaseAll).
func (pr *producerSide) blockShares(r *reporter, cs []*consumerSide, batch int) ([]float64, error) {
	n, retire, err := pr.slab()
	if err != nil {
		return nil, err
	}
	defer func() { _ = retire() }() // cleanup: the measurement is over
	if err := hold(cs, "hold"); err != nil {
		return nil, err
	}
	pr.given += len(cs)
	rates, err := pr.windows(r, fmt.Sprintf("block/64KiB/b%d", batch), cs, "blk", n, batch)
	if derr := hold(cs, "drop"); err == nil {
		err = derr
	}
	if err != nil {
		return nil, err
	}
	return rates, retire()
}

// blockLease: one consumer, holding one block, opens (timed) and releases the slab's
// blocks in turn: the latency of a block lease.
func (pr *producerSide) blockLease(c *consumerSide) ([]float64, error) {
	n, retire, err := pr.slab()
	if err != nil {
		return nil, err
	}
	defer func() { _ = retire() }() // cleanup: the measurement is over
	cs := []*consumerSide{c}
	if err := hold(cs, "hold"); err != nil {
		return nil, err
	}
	pr.given++
	total := pr.sh.warmup + pr.sh.samples
	us, err := c.ask(fmt.Sprintf("open blk %d %d", n, total), "us")
	if derr := hold(cs, "drop"); err == nil {
		err = derr
	}
	if err == nil && len(us) != total {
		err = fmt.Errorf("consumer timed %d opens of %d", len(us), total)
	}
	if err != nil {
		return nil, err
	}
	pr.given += total
	return us[pr.sh.warmup:], retire()
}

// reportValidated asks each consumer how many buffers it checked, and says whether
// that is every buffer they were given:
//
//	validated cudapool all CHECKED GIVEN
func (pr *producerSide) reportValidated(r *reporter, cs []*consumerSide) {
	checked := 0
	for _, c := range cs {
		v, err := c.ask("checked - 0", "checked")
		if err != nil || len(v) != 1 {
			r.fail("cudapool", "validate", fmt.Errorf("consumer %d: %v %v", c.pid, v, err))
			return
		}
		checked += int(v[0])
	}
	fmt.Fprintf(r.w, "validated cudapool all %d %d\n", checked, pr.given)
	if checked != pr.given {
		r.fail("cudapool", "validate", fmt.Errorf("the consumers checked %d buffers of the %d they were given", checked, pr.given))
	}
}

// read: the consumer copies an imported buffer into its own memory, each copy
// timed on the host around a synchronize (cudart has no timing events).
func (pr *producerSide) read(c *consumerSide) ([]float64, error) {
	retire, err := pr.shared("big", 1, pr.sh.readSize)
	if err != nil {
		return nil, err
	}
	gbs, err := c.ask(fmt.Sprintf("read big0 %d", pr.sh.copies), "gbs")
	if rerr := retire(); err == nil {
		err = rerr
	}
	if err == nil {
		pr.given++
	}
	return gbs, err
}

func durations(ds []time.Duration) []float64 {
	us := make([]float64, len(ds))
	for i, d := range ds {
		us[i] = micros(d)
	}
	return us
}

// consumer is a consumer process, driven by lines on its stdin; its stdout lines
// are read by a goroutine, so that every wait has a hang guard.
type consumerSide struct {
	cmd   *exec.Cmd
	pid   int
	in    io.WriteCloser
	lines chan string
}

func (pr *producerSide) startConsumer(dev int) (*consumerSide, error) {
	return startRole(consumerRole, pr.kind, pr.ex.Addr(), strconv.Itoa(dev), strconv.FormatBool(pr.validate))
}

// startRole starts this program as role with args, once it has said "ready".
func startRole(role string, args ...string) (*consumerSide, error) {
	self, err := os.Executable()
	if err != nil {
		return nil, err
	}
	cmd := exec.Command(self, append([]string{role}, args...)...)
	cmd.Stderr = os.Stderr
	in, err := cmd.StdinPipe()
	if err != nil {
		return nil, err
	}
	out, err := cmd.StdoutPipe()
	if err != nil {
		return nil, err
	}
	if err := cmd.Start(); err != nil {
		return nil, err
	}
	c := &consumerSide{cmd: cmd, pid: cmd.Process.Pid, in: in, lines: make(chan string, 16)}
	go func() {
		sc := bufio.NewScanner(out)
		sc.Buffer(nil, 1<<20)
		for sc.Scan() {
			c.lines <- sc.Text()
		}
		close(c.lines)
	}()
	if _, err := c.await("ready"); err != nil {
		c.kill()
		return nil, err
	}
	return c, nil
}

func (c *consumerSide) say(line string) error {
	_, err := io.WriteString(c.in, line+"\n")
	return err
}

// await waits for the consumer's next line, which must start with want, and
// returns the numbers after it.
func (c *consumerSide) await(want string) ([]float64, error) {
	rest, err := c.awaitLine(want)
	if err != nil {
		return nil, err
	}
	var v []float64
	for _, f := range strings.Fields(rest) {
		x, err := strconv.ParseFloat(f, 64)
		if err != nil {
			return nil, fmt.Errorf("consumer %d said %q after %q: %v", c.pid, rest, want, err)
		}
		v = append(v, x)
	}
	return v, nil
}

// awaitLine waits for the consumer's next line, which must start with want, and
// returns the rest of it.
func (c *consumerSide) awaitLine(want string) (string, error) {
	select {
	case line, ok := <-c.lines:
		if !ok {
			return "", fmt.Errorf("consumer %d ended before saying %q", c.pid, want)
		}
		rest, found := strings.CutPrefix(line, want)
		if !found {
			return "", fmt.Errorf("consumer %d said %q, want %q", c.pid, line, want)
		}
		return rest, nil
	case <-time.After(opTimeout):
		return "", fmt.Errorf("consumer %d said nothing for %v (want %q)", c.pid, opTimeout, want)
	}
}

func (c *consumerSide) ask(cmd, want string) ([]float64, error) {
	if err := c.say(cmd); err != nil {
		return nil, err
	}
	return c.await(want)
}

// quit tells the consumer to close its importer and waits for it to exit.
func (c *consumerSide) quit() error {
	_ = c.in.Close() // cleanup: nothing is left to do if closing fails
	go func() {      // lines no one waits for must not block the consumer's exit
		for range c.lines {
		}
	}()
	done := make(chan error, 1)
	go func() { done <- c.cmd.Wait() }()
	select {
	case err := <-done:
		if err != nil {
			return fmt.Errorf("consumer %d: %w", c.pid, err)
		}
		return nil
	case <-time.After(opTimeout):
		c.kill()
		return fmt.Errorf("consumer %d did not exit", c.pid)
	}
}

func (c *consumerSide) kill() {
	_ = c.cmd.Process.Kill() // the child may have exited already
	_ = c.cmd.Wait()         // only its exit matters here
}
