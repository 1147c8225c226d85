package main

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"os"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/cudapool/cudapool/cudart"
	"github.com/cudapool/cudapool/cudart/choose"
	"github.com/cudapool/cudapool/export/consumer"
	"github.com/cudapool/cudapool/pool"
)

// consumerRole is the first argument that makes this program a consumer:
//
//	gosuite consumer KIND SOCKET DEVICE VALIDATE
//
// It dials the exporter at SOCKET for DEVICE on runtime KIND (gpu or test), says
// "ready", and obeys lines on stdin until it closes:
//
//	fresh NAME N              Open NAME0..NAME<N-1> (each timed), then Release each: "us T..."
//	open NAME COUNT N         N times Open NAME<i%COUNT> (timed), Release: "us T..."
//	release NAME COUNT N      N times Open NAME<i%COUNT>, Release (timed): "us T..."
//	openrelease NAME COUNT N  N times Open and Release NAME<i%COUNT> (timed together): "us T..."
//	sustain NAME COUNT MS B   Open and Release NAME<i%COUNT> for MS ms, B names at a time
//	                          (OpenAll and ReleaseAll when B > 1): "count N SLOW SLOW_MS"
//	                          (SLOW: the Opens that took slowOpen or more, SLOW_MS their time),
//	                          then "calls" and the window's calls (callCounter's encode)
//	read NAME N               Open NAME, copy it N times into own memory: "gbs R..."
//	hold NAME 0               Open NAME and keep it until drop: "hold"
//	drop NAME 0               Release what hold kept: "drop"
//	checked - 0               "checked N": how many buffers this consumer validated
//
// A buffer the exporter pushes is held, "pushed NAME MONOTONIC-NS" said, and
// released. Times are microseconds. With VALIDATE true, every buffer opened or pushed
// is copied to the host and each byte checked against the number that ends its name
// (the producer writes byte(i) into buffer i): the timings then include the check.
const consumerRole = "consumer"

func consumerMain(args []string) int {
	fail := func(err error) int { fmt.Fprintln(os.Stderr, "gosuite consumer:", err); return 1 }
	if len(args) != 4 {
		return fail(errors.New("want KIND SOCKET DEVICE VALIDATE"))
	}
	dev, err := strconv.Atoi(args[2])
	if err != nil {
		return fail(err)
	}
	validate, err := strconv.ParseBool(args[3])
	if err != nil {
		return fail(err)
	}
	picked, err := choose.Runtime(args[0])
	if err != nil {
		return fail(err)
	}
	calls := newCallCounter(picked.Runtime)
	rt := cudart.Runtime(calls)
	ctx := context.Background()
	s, err := rt.StreamCreate(dev, cudart.StreamNonBlocking)
	if err != nil {
		return fail(err)
	}
	pushStream, err := rt.StreamCreate(dev, cudart.StreamNonBlocking)
	if err != nil {
		return fail(err)
	}
	out := &lineWriter{w: os.Stdout}
	c := &consumerState{rt: rt, calls: calls, dev: dev, s: s, validate: validate}
	pushed := func(name string, m *consumer.Mapping) {
		at := monotonic()
		if err := c.check(m, pushStream); err != nil {
			// The producer waits for "pushed": say what went wrong instead.
			out.say(fmt.Sprintf("bad push %s: %v", name, err))
		} else {
			out.say(fmt.Sprintf("pushed %s %d", name, at))
		}
		if err := m.Release(ctx, pushStream); err != nil {
			fmt.Fprintln(os.Stderr, "gosuite consumer: release of a push:", err)
		}
	}
	quiet := slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: slog.LevelError}))
	imp, err := consumer.Dial(ctx, args[1], rt, dev, consumer.WithPushes(pushed, pushStream), consumer.WithLogger(quiet))
	if err != nil {
		return fail(err)
	}
	c.imp = imp
	out.say("ready")
	in := bufio.NewScanner(os.Stdin)
	for in.Scan() {
		reply, err := c.obey(ctx, strings.Fields(in.Text()))
		if err != nil {
			_ = imp.Close(ctx) // cleanup: nothing is left to do if closing fails
			return fail(fmt.Errorf("%q: %w", in.Text(), err))
		}
		out.say(reply)
	}
	closeCtx, cancel := context.WithTimeout(ctx, opTimeout)
	defer cancel()
	if err := imp.Close(closeCtx); err != nil {
		return fail(err)
	}
	if err := choose.Violations(picked.Runtime); err != nil {
		return fail(err)
	}
	return 0
}

// lineWriter writes whole lines from several goroutines (the command loop and the
// push handler).
type lineWriter struct {
	mu sync.Mutex
	w  io.Writer
}

func (lw *lineWriter) say(line string) {
	lw.mu.Lock()
	defer lw.mu.Unlock()
	fmt.Fprintln(lw.w, line)
}

type consumerState struct {
	rt    cudart.Runtime
	calls *callCounter // rt, counting
	dev   int
	imp   *consumer.Importer
	s     cudart.Stream

	validate bool
	checked  atomic.Int64 // buffers validated, by the command loop and the push handler
	held     map[string]*consumer.Mapping
}

// check validates m's bytes when the consumer validates: every byte must be the
// number that ends m's name, as the producer wrote it. The copy is queued on s after
// Open's wait for the producer's writes, so it reads what they wrote.
func (c *consumerState) check(m *consumer.Mapping, s cudart.Stream) error {
	if !c.validate {
		return nil
	}
	name := m.Name()
	digits := strings.TrimRightFunc(name, func(r rune) bool { return r >= '0' && r <= '9' })
	i, err := strconv.Atoi(name[len(digits):])
	if err != nil {
		return fmt.Errorf("validate %q: no number ends the name", name)
	}
	host := make([]byte, m.Size())
	if err := c.rt.MemcpyDtoHAsync(c.dev, host, m.Ptr(), s); err != nil {
		return fmt.Errorf("validate %q: %w", name, err)
	}
	if err := c.rt.StreamSynchronize(c.dev, s); err != nil {
		return fmt.Errorf("validate %q: %w", name, err)
	}
	for at, b := range host {
		if b != byte(i) {
			return fmt.Errorf("validate %q: byte %d is %#x, want %#x", name, at, b, byte(i))
		}
	}
	c.checked.Add(1)
	return nil
}

// open opens name on c.s and validates it.
func (c *consumerState) open(ctx context.Context, name string) (*consumer.Mapping, error) {
	m, err := c.imp.Open(ctx, name, c.s)
	if err != nil {
		return nil, err
	}
	if err := c.check(m, c.s); err != nil {
		_ = m.Release(ctx, c.s) // cleanup: the measurement is over
		return nil, err
	}
	return m, nil
}

func (c *consumerState) obey(ctx context.Context, f []string) (string, error) {
	if len(f) < 3 {
		return "", errors.New("too few fields")
	}
	nums := make([]int, len(f)-2)
	for i := range nums {
		n, err := strconv.Atoi(f[i+2])
		if err != nil {
			return "", err
		}
		nums[i] = n
	}
	name := f[1]
	switch {
	case f[0] == "fresh" && len(nums) == 1:
		return c.fresh(ctx, name, nums[0])
	case (f[0] == "open" || f[0] == "release" || f[0] == "openrelease") && len(nums) == 2:
		return c.cycle(ctx, name, nums[0], nums[1], f[0])
	case f[0] == "checked":
		return fmt.Sprintf("checked %d", c.checked.Load()), nil
	case f[0] == "hold" && c.held[name] == nil:
		m, err := c.open(ctx, name)
		if err != nil {
			return "", err
		}
		if c.held == nil {
			c.held = map[string]*consumer.Mapping{}
		}
		c.held[name] = m
		return "hold", nil
	case f[0] == "drop" && c.held[name] != nil:
		m := c.held[name]
		delete(c.held, name)
		return "drop", m.Release(ctx, c.s)
	case f[0] == "sustain" && len(nums) == 3 && nums[2] >= 1:
		return c.sustain(ctx, name, nums[0], time.Duration(nums[1])*time.Millisecond, nums[2])
	case f[0] == "read" && len(nums) == 1:
		return c.read(ctx, name, nums[0])
	}
	return "", errors.New("unknown command")
}

func samples(word string, v []float64) string {
	var b strings.Builder
	b.WriteString(word)
	for _, x := range v {
		fmt.Fprintf(&b, " %.4f", x)
	}
	return b.String()
}

func (c *consumerState) fresh(ctx context.Context, name string, n int) (string, error) {
	us := make([]float64, n)
	var ms []*consumer.Mapping
	defer func() {
		for _, m := range ms {
			_ = m.Release(ctx, c.s) // cleanup: the measurement is over
		}
	}()
	for i := range n {
		start := time.Now()
		m, err := c.open(ctx, fmt.Sprint(name, i))
		us[i] = micros(time.Since(start))
		if err != nil {
			return "", err
		}
		ms = append(ms, m)
	}
	return samples("us", us), nil
}

// cycle opens and releases n buffers of a ring, timing verb's part: the Open (open),
// the Release (release) or both (openrelease).
func (c *consumerState) cycle(ctx context.Context, name string, count, n int, verb string) (string, error) {
	us := make([]float64, n)
	for i := range n {
		start := time.Now()
		m, err := c.open(ctx, fmt.Sprint(name, i%count))
		if err != nil {
			return "", err
		}
		opened := time.Now()
		err = m.Release(ctx, c.s)
		switch verb {
		case "open":
			us[i] = micros(opened.Sub(start))
		case "release":
			us[i] = micros(time.Since(opened))
		default:
			us[i] = micros(time.Since(start))
		}
		if err != nil {
			return "", err
		}
	}
	return samples("us", us), nil
}

func (c *consumerState) sustain(ctx context.Context, name string, count int, window time.Duration, batch int) (string, error) {
	end := time.Now().Add(window)
	n, slow := 0, 0
	var stalled time.Duration
	names := make([]string, batch)
	open, release := "Open", "Release"
	if batch > 1 {
		open, release = "OpenAll", "ReleaseAll"
	}
	c.calls.take()
	for ; time.Now().Before(end); n += batch {
		for j := range names {
			names[j] = fmt.Sprint(name, (n+j)%count)
		}
		start := time.Now()
		ms, err := c.openAll(ctx, names)
		if err != nil {
			return "", err
		}
		c.calls.note(open, start)
		if took := time.Since(start); took >= slowOpen {
			slow++
			stalled += took
		}
		start = time.Now()
		if err := c.releaseAll(ctx, ms); err != nil {
			return "", err
		}
		c.calls.note(release, start)
	}
	return fmt.Sprintf("count %d %d %.3f\ncalls%s", n, slow, float64(stalled.Microseconds())/1e3, encode(c.calls.take())), nil
}

// openAll opens names on c.s, one Open for one name and one OpenAll for more, and
// validates each.
func (c *consumerState) openAll(ctx context.Context, names []string) ([]*consumer.Mapping, error) {
	if len(names) == 1 {
		m, err := c.open(ctx, names[0])
		return []*consumer.Mapping{m}, err
	}
	ms, err := c.imp.OpenAll(ctx, names, c.s)
	if err != nil {
		return nil, err
	}
	for _, m := range ms {
		if err := c.check(m, c.s); err != nil {
			_ = c.imp.ReleaseAll(ctx, ms, c.s) // cleanup: the measurement is over
			return nil, err
		}
	}
	return ms, nil
}

// releaseAll releases what openAll opened, the same way.
func (c *consumerState) releaseAll(ctx context.Context, ms []*consumer.Mapping) error {
	if len(ms) == 1 {
		return ms[0].Release(ctx, c.s)
	}
	return c.imp.ReleaseAll(ctx, ms, c.s)
}

// read copies the mapping of name into a buffer of a local pool n times after one
// untimed copy, each copy timed around its synchronize, in GB/s (10^9 bytes, each
// byte counted once).
func (c *consumerState) read(ctx context.Context, name string, n int) (string, error) {
	m, err := c.open(ctx, name)
	if err != nil {
		return "", err
	}
	defer func() { _ = m.Release(ctx, c.s) }() // cleanup: the measurement is over
	local, err := pool.New(c.rt, c.dev, pool.WithHandleType(cudart.HandleTypeNone))
	if err != nil {
		return "", err
	}
	defer func() { _, _ = local.Close(ctx, pool.Force()) }() // cleanup: nothing is left to do if closing fails
	dst, err := local.Alloc(ctx, m.Size(), c.s)
	if err != nil {
		return "", err
	}
	defer func() { _ = dst.Free(c.s) }() // cleanup: the measurement is over
	copyOnce := func() error {
		if err := c.rt.MemcpyDtoDAsync(c.dev, dst.Ptr(), m.Ptr(), m.Size(), c.s); err != nil {
			return err
		}
		return c.rt.StreamSynchronize(c.dev, c.s)
	}
	if err := copyOnce(); err != nil {
		return "", err
	}
	gbs := make([]float64, n)
	for i := range n {
		start := time.Now()
		if err := copyOnce(); err != nil {
			return "", err
		}
		gbs[i] = float64(m.Size()) / time.Since(start).Seconds() / 1e9
	}
	return samples("gbs", gbs), nil
}
