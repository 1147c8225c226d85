package export

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"testing"

	"github.com/cudapool/cudapool/cudart"
	"github.com/cudapool/cudapool/cudart/cudarttest"
	"github.com/cudapool/cudapool/internal/proctest"
	"github.com/cudapool/cudapool/pool"
)

func TestMain(m *testing.M) {
	proctest.Main(m, map[string]func([]string) int{
		"producer":       roleProducer,
		"consumer":       roleConsumer,
		"bench-consumer": roleBenchConsumer,
	})
}

// childRuntime is the runtime a child role runs on: "test" for a software device of
// its own (a process of its own, as on a GPU host), "gpu" for the real runtime.
func childRuntime(kind string) (cudart.Runtime, func(), error) {
	if kind == "gpu" {
		rt, err := cudart.Load()
		return rt, func() {}, err
	}
	d := cudarttest.New()
	return d, func() { d.Close() }, nil
}

// runtimeErr is the software device's violations, nil on the real runtime.
func runtimeErr(rt cudart.Runtime) error {
	if d, ok := rt.(interface{ Err() error }); ok {
		return d.Err()
	}
	return nil
}

// roleProducer: producer KIND SOCKET POLICY NAME=SIZE:FILL...
// It publishes each buffer on device 0, says "ready", and then obeys stdin:
//
//	free NAME         free the buffer (deferred while leased), say "freed"
//	refill SIZE FILL  allocate SIZE bytes, fill them on the stream, synchronise, say "refilled"
//	stats             say "stats LIVE LEASES DEFERRED"
//	quit              close the exporter (waiting for releases) and exit
//
// POLICY is "default" or "other-uid" (admit only a uid that is not ours).
func roleProducer(args []string) int {
	fail := func(err error) int { fmt.Fprintln(os.Stderr, "producer:", err); return 1 }
	if len(args) < 3 {
		return fail(errors.New("want KIND SOCKET POLICY NAME=SIZE:FILL..."))
	}
	rt, done, err := childRuntime(args[0])
	if err != nil {
		return fail(err)
	}
	defer done()
	ctx := context.Background()
	stream, err := rt.StreamCreate(0, cudart.StreamNonBlocking)
	if err != nil {
		return fail(err)
	}
	p, err := pool.New(rt, 0)
	if err != nil {
		return fail(err)
	}
	// Refusals are this role's job in some tests: only errors are worth a line.
	quiet := slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: slog.LevelError}))
	opts := []Option{WithoutAnnounce(), WithLogger(quiet)}
	if args[2] == "other-uid" {
		opts = append(opts, WithPolicy(Policy{AllowUIDs: []uint32{uint32(os.Getuid()) + 1}}))
	}
	ex, err := Listen(args[1], rt, opts...)
	if err != nil {
		return fail(err)
	}
	bufs := map[string]*pool.Buffer{}
	for _, spec := range args[3:] {
		var name string
		var size uint64
		var fill byte
		if _, err := fmt.Sscanf(strings.Replace(strings.Replace(spec, "=", " ", 1), ":", " ", 1), "%s %d %d", &name, &size, &fill); err != nil {
			return fail(fmt.Errorf("spec %q: %w", spec, err))
		}
		b, err := p.Alloc(ctx, size, stream)
		if err == nil {
			err = rt.MemsetAsync(0, b.Ptr(), fill, size, stream)
		}
		if err == nil {
			err = ex.Publish(ctx, name, b, stream)
		}
		if err != nil {
			return fail(err)
		}
		bufs[name] = b
	}
	fmt.Println("ready")
	in := bufio.NewScanner(os.Stdin)
	for in.Scan() {
		f := strings.Fields(in.Text())
		switch {
		case len(f) == 2 && f[0] == "free":
			if err := bufs[f[1]].Free(stream); err != nil {
				return fail(err)
			}
			fmt.Println("freed")
		case len(f) == 3 && f[0] == "refill":
			size, _ := strconv.ParseUint(f[1], 10, 64)
			fill, _ := strconv.ParseUint(f[2], 10, 8)
			b, err := p.Alloc(ctx, size, stream)
			if err == nil {
				err = rt.MemsetAsync(0, b.Ptr(), byte(fill), size, stream)
			}
			if err == nil {
				err = rt.StreamSynchronize(0, stream)
			}
			if err != nil {
				return fail(err)
			}
			fmt.Println("refilled")
		case len(f) == 1 && f[0] == "stats":
			s, err := p.Stats()
			if err != nil {
				return fail(err)
			}
			fmt.Println("stats", s.LiveBuffers, s.ActiveLeases, s.DeferredFrees)
		case len(f) == 1 && f[0] == "quit":
			if err := ex.Close(ctx); err != nil {
				return fail(err)
			}
			if err := runtimeErr(rt); err != nil {
				return fail(err)
			}
			return 0
		default:
			return fail(fmt.Errorf("unknown command %q", in.Text()))
		}
	}
	return 0
}

// roleConsumer: consumer KIND SOCKET DEVICE NAME FILL MODE
// It opens NAME on DEVICE, checks every byte is FILL and then, for MODE "release",
// releases, closes and says "ok"; for MODE "hold" says "holding" and waits to be
// killed.
func roleConsumer(args []string) int {
	fail := func(err error) int { fmt.Fprintln(os.Stderr, "consumer:", err); return 1 }
	if len(args) != 6 {
		return fail(errors.New("want KIND SOCKET DEVICE NAME FILL MODE"))
	}
	rt, done, err := childRuntime(args[0])
	if err != nil {
		return fail(err)
	}
	defer done()
	dev, _ := strconv.Atoi(args[2])
	fill, _ := strconv.Atoi(args[4])
	ctx := context.Background()
	stream, err := rt.StreamCreate(dev, cudart.StreamNonBlocking)
	if err != nil {
		return fail(err)
	}
	imp, err := Dial(ctx, args[1], rt, dev)
	if err != nil {
		return fail(err)
	}
	m, err := imp.Open(ctx, args[3], stream)
	if err != nil {
		return fail(err)
	}
	got := make([]byte, m.Size())
	if err := rt.MemcpyDtoHAsync(dev, got, m.Ptr(), stream); err != nil {
		return fail(err)
	}
	if !allAre(got, byte(fill)) {
		return fail(fmt.Errorf("%s: bytes are not all %#x", args[3], fill))
	}
	if args[5] == "hold" {
		fmt.Println("holding")
		io.Copy(io.Discard, os.Stdin)
		return 0
	}
	if err := m.Release(ctx, stream); err != nil {
		return fail(err)
	}
	if err := imp.Close(ctx); err != nil {
		return fail(err)
	}
	if err := runtimeErr(rt); err != nil {
		return fail(err)
	}
	fmt.Println("ok")
	return 0
}

// child is a started role with its stdin and stdout lines at hand.
type child struct {
	t   testing.TB
	cmd *exec.Cmd
	in  io.WriteCloser
	out *bufio.Scanner
}

func startChild(t testing.TB, role string, args ...string) *child {
	t.Helper()
	cmd := proctest.Command(t, role, args...)
	in, err := cmd.StdinPipe()
	if err != nil {
		t.Fatal(err)
	}
	out, err := cmd.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	return &child{t: t, cmd: cmd, in: in, out: bufio.NewScanner(out)}
}

// expect reads the child's next line and checks that it begins with want.
func (c *child) expect(want string) string {
	c.t.Helper()
	if !c.out.Scan() {
		c.t.Fatalf("child %s ended before saying %q: %v", c.cmd.Args[1:], want, c.cmd.Wait())
	}
	line := c.out.Text()
	if !strings.HasPrefix(line, want) {
		c.t.Fatalf("child said %q, want %q", line, want)
	}
	return line
}

func (c *child) say(line string) {
	c.t.Helper()
	if _, err := io.WriteString(c.in, line+"\n"); err != nil {
		c.t.Fatal(err)
	}
}

// wait waits for the child to exit and fails the test unless it exited 0.
func (c *child) wait() {
	c.t.Helper()
	c.in.Close()
	if err := c.cmd.Wait(); err != nil {
		c.t.Fatalf("child %v: %v", c.cmd.Args[1:], err)
	}
}

func (c *child) kill() {
	c.t.Helper()
	c.cmd.Process.Signal(syscall.SIGKILL)
	c.cmd.Wait()
}

// Real processes, real sockets, real descriptors: a producer here and several
// consumers in child processes, on both devices, each checking every byte.
func TestProcessesShareBuffers(t *testing.T) {
	pr := newProducer(t, nil, nil)
	pr.publish(t, "a", 1<<20, 0x0a)
	pr.publish(t, "b", 3<<20, 0x0b)
	var kids []*child
	for _, spec := range []struct{ dev, name, fill string }{{"0", "a", "10"}, {"1", "a", "10"}, {"1", "b", "11"}, {"0", "b", "11"}} {
		kids = append(kids, startChild(t, "consumer", "test", pr.path, spec.dev, spec.name, spec.fill, "release"))
	}
	for _, k := range kids {
		k.expect("ok")
		k.wait()
	}
	waitFor(t, "the consumers to leave", func() bool { return len(pr.ex.Peers()) == 0 })
	if n := pr.activeLeases(t); n != 0 {
		t.Fatalf("%d leases after every consumer released", n)
	}
	pr.checkClean(t)
}

// SIGKILL a consumer mid-lease: the exporter sees the socket close, ends its lease,
// and the free the producer asked for meanwhile proceeds.
func TestProcessConsumerKilled(t *testing.T) {
	pr := newProducer(t, nil, nil)
	before, _ := pr.pool.Stats()
	b := pr.publish(t, "a", 1<<20, 0x0a)
	k := startChild(t, "consumer", "test", pr.path, "1", "a", "10", "hold")
	k.expect("holding")
	if err := b.Free(pr.stream); err != nil {
		t.Fatal(err)
	}
	if s, _ := pr.pool.Stats(); s.DeferredFrees != 1 {
		t.Fatalf("free of a leased buffer not deferred: %+v", s)
	}
	k.kill()
	waitFor(t, "the killed consumer's lease to end", func() bool { return len(pr.ex.Peers()) == 0 })
	after, _ := pr.pool.Stats()
	if after.LiveBuffers != before.LiveBuffers || after.DeferredFrees != 0 || after.ActiveLeases != 0 || after.UsedCurrent != before.UsedCurrent {
		t.Fatalf("pool after the kill %+v, before %+v", after, before)
	}
	pr.checkClean(t)
}

// SIGKILL the producer: this consumer's mapping stays readable, new opens say the
// exporter is gone, and release and close complete without error.
func TestProcessProducerKilled(t *testing.T) {
	path := filepath.Join(shortDir(t), "p.sock")
	k := startChild(t, "producer", "test", path, "default", "a=1048576:90")
	k.expect("ready")
	c := newConsumer(t, path, 1)
	ctx := testCtx(t)
	m, err := c.imp.Open(ctx, "a", c.stream)
	if err != nil {
		t.Fatal(err)
	}
	k.kill()
	<-c.imp.readerDone
	if b := c.read(t, m); !allAre(b, 90) {
		t.Fatal("mapping unreadable after the producer was killed")
	}
	if _, err := c.imp.Open(ctx, "a", c.stream); !errors.Is(err, ErrExporterGone) || !strings.Contains(err.Error(), "exporter is gone") {
		t.Fatalf("Open after the producer was killed = %v, want ErrExporterGone", err)
	}
	if err := m.Release(ctx, c.stream); err != nil {
		t.Fatalf("Release = %v, want nil", err)
	}
	if err := c.imp.Close(ctx); err != nil {
		t.Fatalf("Close = %v, want nil", err)
	}
	c.checkClean(t)
}

// A producer in another process whose policy does not admit our uid refuses us, and
// says why.
func TestProcessPolicyRefusal(t *testing.T) {
	path := filepath.Join(shortDir(t), "p.sock")
	k := startChild(t, "producer", "test", path, "other-uid", "a=4096:1")
	k.expect("ready")
	s := newSide(t, 0)
	_, err := Dial(testCtx(t), path, s.dev, 0)
	if !errors.Is(err, ErrRefused) || !strings.Contains(err.Error(), fmt.Sprintf("uid %d gid %d is not allowed", os.Getuid(), os.Getgid())) {
		t.Fatalf("Dial = %v, want ErrRefused naming our uid", err)
	}
	k.say("quit")
	k.wait()
}

// A producer in another process, closed cleanly, waits for our release first.
func TestProcessProducerClosesAfterRelease(t *testing.T) {
	path := filepath.Join(shortDir(t), "p.sock")
	k := startChild(t, "producer", "test", path, "default", "a=2097152:3", "b=4096:4")
	k.expect("ready")
	c := newConsumer(t, path, 0)
	ctx := testCtx(t)
	m, err := c.imp.Open(ctx, "a", c.stream)
	if err != nil {
		t.Fatal(err)
	}
	k.say("free a")
	k.expect("freed")
	k.say("stats")
	if got := k.expect("stats"); got != "stats 2 1 1" {
		t.Fatalf("producer %q, want 2 live buffers, 1 lease, 1 deferred free", got)
	}
	if b := c.read(t, m); !allAre(b, 3) {
		t.Fatal("freed-while-leased buffer changed")
	}
	if err := m.Release(ctx, c.stream); err != nil {
		t.Fatal(err)
	}
	k.say("stats")
	if got := k.expect("stats"); got != "stats 1 0 0" {
		t.Fatalf("producer %q after release, want 1 live buffer, no lease, no deferred free", got)
	}
	if err := c.imp.Close(ctx); err != nil {
		t.Fatal(err)
	}
	k.say("quit")
	k.wait()
	c.checkClean(t)
}
