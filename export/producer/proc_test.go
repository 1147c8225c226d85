package producer

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"testing"

	"golang.org/x/sys/unix"

	"github.com/stretchr/testify/require"

	"github.com/cudapool/cudapool/cudart"
	"github.com/cudapool/cudapool/cudart/cudarttest"
	"github.com/cudapool/cudapool/export/consumer"
	"github.com/cudapool/cudapool/export/internal/inspect"
	"github.com/cudapool/cudapool/export/internal/wire"
	"github.com/cudapool/cudapool/internal/proctest"
	"github.com/cudapool/cudapool/internal/testwait"
	"github.com/cudapool/cudapool/internal/unixfd"
	"github.com/cudapool/cudapool/pool"
)

func TestMain(m *testing.M) {
	proctest.Main(m, map[string]func([]string) int{
		"producer":           roleProducer,
		"consumer":           roleConsumer,
		"bench-consumer":     roleBenchConsumer,
		"roundtrip-consumer": roleRoundTripConsumer,
		"connector":          roleConnector,
		"lingering-consumer": roleLingeringConsumer,
		"peer-consumer":      rolePeerConsumer,
		"dialer":             roleDialer,
		"quiet":              roleQuiet,
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
//	recycle NAME FILL unpublish NAME and free it, allocate its size again, fill it and
//	                  publish it under NAME; say "recycled same" if the memory is the
//	                  same (from the cache), else "recycled new"
//	trim              trim the pool's cache, say "trimmed"
//	ranges NAME N     publish N equal ranges of NAME as NAME-0..NAME-(N-1) in one
//	                  PublishAll, say "ranged"
//	retained          say "retained RETENTIONS REVOKING"
//	quit              close the exporter (waiting for releases) and exit
//
// POLICY is "default", "other-uid" (admit only a uid that is not ours) or "retain"
// (a pool with a cache, an exporter WithRetainedImports).
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
	var poolOpts []pool.Option
	if args[2] == "retain" {
		poolOpts = append(poolOpts, pool.WithCache(1<<30))
	}
	p, err := pool.New(rt, 0, poolOpts...)
	if err != nil {
		return fail(err)
	}
	// Refusals are this role's job in some tests: only errors are worth a line.
	quiet := slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: slog.LevelError}))
	opts := []ListenOption{WithoutAnnounce(), WithLogger(quiet)}
	switch args[2] {
	case "other-uid":
		opts = append(opts, WithPolicy(Policy{AllowUIDs: []uint32{uint32(os.Getuid()) + 1}}))
	case "retain":
		opts = append(opts, WithRetainedImports())
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
	// Written before "ready": a test that kills the producer then kills it after its
	// writes, not (on a deferred software device) before they ran.
	if err := rt.StreamSynchronize(0, stream); err != nil {
		return fail(err)
	}
	fmt.Println("ready")
	for line := range proctest.Commands() {
		f := strings.Fields(line)
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
		case len(f) == 3 && f[0] == "recycle":
			old := bufs[f[1]]
			fill, _ := strconv.ParseUint(f[2], 10, 8)
			err := ex.Unpublish(f[1])
			if err == nil {
				err = old.Free(stream)
			}
			var b *pool.Buffer
			if err == nil {
				b, err = p.Alloc(ctx, old.Size(), stream)
			}
			if err == nil {
				err = rt.MemsetAsync(0, b.Ptr(), byte(fill), b.Size(), stream)
			}
			if err == nil {
				err = ex.Publish(ctx, f[1], b, stream)
			}
			if err != nil {
				return fail(err)
			}
			bufs[f[1]] = b
			if b.Ptr() == old.Ptr() {
				fmt.Println("recycled same")
			} else {
				fmt.Println("recycled new")
			}
		case len(f) == 3 && f[0] == "ranges":
			b := bufs[f[1]]
			n, _ := strconv.ParseUint(f[2], 10, 32)
			if n == 0 || b.Size()%n != 0 {
				return fail(fmt.Errorf("%d ranges of %d bytes", n, b.Size()))
			}
			entries := make([]Entry, n)
			for i := range entries {
				size := b.Size() / n
				entries[i] = Entry{Name: fmt.Sprintf("%s-%d", f[1], i), Buffer: b, Options: []PublishOption{Range(uint64(i)*size, size)}}
			}
			if err := ex.PublishAll(ctx, stream, entries...); err != nil {
				return fail(err)
			}
			fmt.Println("ranged")
		case len(f) == 1 && f[0] == "trim":
			if err := p.Trim(); err != nil {
				return fail(err)
			}
			fmt.Println("trimmed")
		case len(f) == 1 && f[0] == "retained":
			s, err := p.Stats()
			if err != nil {
				return fail(err)
			}
			fmt.Println("retained", s.Retentions, s.RevokingBuffers)
		case len(f) == 1 && f[0] == "quit":
			if err := ex.Close(ctx); err != nil {
				return fail(err)
			}
			if err := runtimeErr(rt); err != nil {
				return fail(err)
			}
			return 0
		default:
			return fail(fmt.Errorf("unknown command %q", line))
		}
	}
	return 0
}

// roleConsumer: consumer KIND SOCKET DEVICE NAME FILL MODE
// It opens NAME on DEVICE, checks every byte is FILL and then, for MODE "release",
// releases, closes and says "ok"; for MODE "hold" says "holding" and waits to be
// killed, obeying stdin meanwhile:
//
//	hang-up  close the connection without Bye, keeping the mapping; say "hung up"
//
// For MODE "retain", NAME is a comma-separated list: it opens, checks and releases each
// (an exporter WithRetainedImports retains their imports), says "retained" and waits,
// its Importer open, until killed or its stdin ends.
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
	imp, err := consumer.Dial(ctx, args[1], rt, dev)
	if err != nil {
		return fail(err)
	}
	if args[5] == "retain" {
		for _, name := range strings.Split(args[3], ",") {
			m, err := imp.Open(ctx, name, stream)
			if err == nil {
				err = m.Release(ctx, stream)
			}
			if err != nil {
				return fail(err)
			}
		}
		fmt.Println("retained")
		for range proctest.Commands() {
		}
		return 0
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
		for line := range proctest.Commands() {
			if line != "hang-up" {
				return fail(fmt.Errorf("unknown command %q", line))
			}
			inspect.Client(imp).C.Close()
			fmt.Println("hung up")
		}
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

// roleConnector: connector SOCKET
// It connects to SOCKET, passes the connection to its parent over the Unix socket at
// descriptor 3, and exits: the exporter then serves a connection whose process is
// gone.
func roleConnector(args []string) int {
	fail := func(err error) int { fmt.Fprintln(os.Stderr, "connector:", err); return 1 }
	nc, err := net.DialUnix("unix", nil, &net.UnixAddr{Name: args[0], Net: "unix"})
	if err != nil {
		return fail(err)
	}
	parent, err := net.FileConn(os.NewFile(3, "parent"))
	if err != nil {
		return fail(err)
	}
	f, err := nc.File()
	if err != nil {
		return fail(err)
	}
	if err := unixfd.Send(parent.(*net.UnixConn), []byte{1}, int(f.Fd())); err != nil {
		return fail(err)
	}
	return 0
}

// Real processes, real sockets, real descriptors: a producer here and several
// consumers in child processes, on both devices, each checking every byte.
func TestProcessesShareBuffers(t *testing.T) {
	pr := newProducer(t, nil, nil)
	pr.publish(t, "a", 1<<20, 0x0a)
	pr.publish(t, "b", 3<<20, 0x0b)
	var kids []*proctest.Child
	for _, spec := range []struct{ dev, name, fill string }{{"0", "a", "10"}, {"1", "a", "10"}, {"1", "b", "11"}, {"0", "b", "11"}} {
		kids = append(kids, proctest.Start(t, "consumer", "test", pr.path, spec.dev, spec.name, spec.fill, "release"))
	}
	for _, k := range kids {
		k.Expect("ok")
		k.Finish()
	}
	waitFor(t, "the consumers to leave", func() bool { return len(pr.ex.Peers()) == 0 })
	n := pr.activeLeases(t)
	require.EqualValues(t, 0, n, "%d leases after every consumer released", n)
	pr.checkClean(t)
}

// killedBySIGKILL fails the test unless reaping k shows it was killed by SIGKILL: then
// nothing reaped it before.
func killedBySIGKILL(t *testing.T, k *proctest.Child) {
	t.Helper()
	var exit *exec.ExitError
	err := k.Wait()
	require.ErrorAs(t, err, &exit, "reaping the killed child")
	require.Equal(t, syscall.SIGKILL, exit.Sys().(syscall.WaitStatus).Signal(), "the killed child's end")
}

// poolBackTo fails the test unless pr's pool holds what it held when it showed before:
// no lease, no free waiting, the same buffers and bytes.
func (pr *producer) poolBackTo(t *testing.T, before pool.Stats) {
	t.Helper()
	require.NoError(t, pr.dev.Synchronize()) // the driver counts memory in use until its free has run
	after, _ := pr.pool.Stats()
	require.EqualValues(t, before.LiveBuffers, after.LiveBuffers, "pool %+v, before %+v", after, before)
	require.EqualValues(t, 0, after.DeferredFrees, "pool %+v, before %+v", after, before)
	require.EqualValues(t, 0, after.ActiveLeases, "pool %+v, before %+v", after, before)
	require.EqualValues(t, before.UsedCurrent, after.UsedCurrent, "pool %+v, before %+v", after, before)
}

// freeWaitingOnChild publishes a buffer, has a consumer child hold it, and frees it: the
// free waits for the child's lease. It returns the producer, its pool's figures from
// before the buffer, and the child.
func freeWaitingOnChild(t *testing.T) (*producer, pool.Stats, *proctest.Child) {
	t.Helper()
	pr := newProducer(t, nil, nil)
	before, _ := pr.pool.Stats()
	b := pr.publish(t, "a", 1<<20, 0x0a)
	k := proctest.Start(t, "consumer", "test", pr.path, "1", "a", "10", "hold")
	k.Expect("holding")
	require.NoError(t, b.Free(pr.stream))
	s, _ := pr.pool.Stats()
	require.EqualValues(t, 1, s.ActiveLeases, "free of a leased buffer not deferred: %+v", s)
	require.EqualValues(t, 1, s.DeferredFrees, "free of a leased buffer not deferred: %+v", s)
	return pr, before, k
}

// SIGKILL a consumer mid-lease: its socket closes while it is still exiting; once it
// has exited, a zombie its parent (this test) has not reaped yet, the exporter ends its
// lease and the free the producer asked for meanwhile proceeds, never while the
// consumer might still map the buffer.
func TestProcessConsumerKilled(t *testing.T) {
	pr, before, k := freeWaitingOnChild(t)
	k.Kill()
	waitFor(t, "the killed consumer's lease to end", func() bool { return len(pr.ex.Peers()) == 0 })
	killedBySIGKILL(t, k)
	pr.poolBackTo(t, before)
	pr.checkClean(t)
}

// A consumer that hangs up without Bye and lives on still maps what it holds: its
// lease, and the producer's free waiting on it, last until it is killed and has exited,
// and Close waits for that. (When the exporter ended leases as soon as a connection
// closed, this freed the buffer at the hang-up, and the software device saw memory
// freed while a live process had it imported: what a SIGKILLed consumer risks in the
// moment between its socket closing and its exit.)
func TestProcessLostConsumerKeepsLeasesUntilExit(t *testing.T) {
	pr, before, k := freeWaitingOnChild(t)
	k.Send("hang-up")
	k.Expect("hung up")
	waitFor(t, "the exporter to see the hang-up", func() bool {
		return len(pr.ex.Peers()) == 0 || strings.Contains(pr.log.String(), "held until its process exits")
	})
	s, _ := pr.pool.Stats()
	require.EqualValues(t, 1, s.ActiveLeases, "after a live consumer hung up the pool shows %+v, want its lease held and the free waiting", s)
	require.EqualValues(t, 1, s.DeferredFrees, "after a live consumer hung up the pool shows %+v, want its lease held and the free waiting", s)
	pr.checkClean(t)
	ps := pr.ex.Peers()
	require.False(t, len(ps) != 1 || ps[0].PID != k.PID() || !ps[0].AwaitingExit || ps[0].Leases != 1, "peers %+v, want pid %d awaiting its exit with its lease", ps, k.PID())
	closed := make(chan error, 1)
	go func() { closed <- pr.ex.Close(testCtx(t)) }()
	k.Kill()
	require.NoError(t, testwait.Recv(t, closed, "Close to return"), "Close, want nil: the lease ended when the consumer exited")
	killedBySIGKILL(t, k)
	require.Contains(t, pr.log.String(), "process exited; ending its leases", "the exit is not logged:\n%s", pr.log.String())
	pr.poolBackTo(t, before)
	pr.checkClean(t)
}

// A connection whose process is gone before its handshake (it passed the socket on and
// exited) cannot be watched: its leases end when it closes, and the log says why.
func TestProcessGoneBeforeHandshake(t *testing.T) {
	pr := newProducer(t, nil, nil)
	before, _ := pr.pool.Stats()
	b := pr.publish(t, "a", 1<<20, 0x0a)
	nc := connectionOfAReapedChild(t, pr.path)
	s := newSide(t, 0)
	ctx := testCtx(t)
	imp, err := consumer.DialConn(ctx, nc, s.dev, 0, consumer.WithLogger(discardLogger))
	require.NoError(t, err)
	_, err = imp.Open(ctx, "a", s.stream)
	require.NoError(t, err)
	require.NoError(t, b.Free(pr.stream))
	// This side dies too: the driver drops its imports, the kernel closes its socket.
	s.dev.Close()
	inspect.Client(imp).C.Close()
	waitFor(t, "the lease to end", func() bool { return len(pr.ex.Peers()) == 0 })
	log := pr.log.String()
	require.Contains(t, log, "cannot watch the process", "the log does not say why the leases ended at once:\n%s", log)
	require.Contains(t, log, "no such process", "the log does not say why the leases ended at once:\n%s", log)
	pr.poolBackTo(t, before)
	pr.checkClean(t)
}

// connectionOfAReapedChild returns a connection to the socket at path that a child
// process made, passed to this one, and exited; the child is reaped.
func connectionOfAReapedChild(t *testing.T, path string) net.Conn {
	t.Helper()
	fds, err := unix.Socketpair(unix.AF_UNIX, unix.SOCK_STREAM|unix.SOCK_CLOEXEC, 0)
	require.NoError(t, err)
	mine, theirs := os.NewFile(uintptr(fds[0]), "mine"), os.NewFile(uintptr(fds[1]), "theirs")
	defer mine.Close()
	cmd := proctest.Command(t, "connector", path)
	cmd.ExtraFiles = []*os.File{theirs}
	err = cmd.Run()
	theirs.Close()
	require.NoError(t, err, "connector: %v", err)
	via, err := net.FileConn(mine)
	require.NoError(t, err)
	defer via.Close()
	_, got, err := unixfd.Recv(via.(*net.UnixConn), make([]byte, 1), 1)
	require.NoError(t, err, "receiving the child's connection: %d descriptors, %v", len(got), err)
	require.Len(t, got, 1, "receiving the child's connection: %d descriptors, %v", len(got), err)
	f := os.NewFile(uintptr(got[0]), "conn")
	defer f.Close()
	nc, err := net.FileConn(f)
	require.NoError(t, err)
	return nc
}

// SIGKILL the producer: this consumer's mapping, on the producer's own GPU, stays
// readable (FACTS 7; on another GPU it would not, FACTS 14), new opens say the
// exporter is gone, and release and close complete without error.
func TestProcessProducerKilled(t *testing.T) {
	path := filepath.Join(shortDir(t), "p.sock")
	k := proctest.Start(t, "producer", "test", path, "default", "a=1048576:90")
	k.Expect("ready")
	c := newConsumer(t, path, 0)
	ctx := testCtx(t)
	m, err := c.imp.Open(ctx, "a", c.stream)
	require.NoError(t, err)
	killProducer(t, k)
	testwait.Recv(t, c.imp.Done(), "the importer to see its connection end")
	require.ErrorIs(t, c.imp.Err(), wire.ErrExporterGone)
	require.NoError(t, m.Err(), "a mapping on the owner GPU outlives its exporter")
	require.NoError(t, m.Context().Err())
	b := c.read(t, m)
	require.True(t, allAre(b, 90), "mapping unreadable after the producer was killed: %v ... %v", b[:8], b[len(b)-8:])
	_, err = c.imp.Open(ctx, "a", c.stream)
	require.ErrorIs(t, err, wire.ErrExporterGone, "Open after the producer was killed = %v, want ErrExporterGone", err)
	require.ErrorContains(t, err, "exporter is gone", "Open after the producer was killed = %v, want ErrExporterGone", err)
	require.NoError(t, m.Release(ctx, c.stream), "Release, want nil")
	require.ErrorIs(t, context.Cause(m.Context()), consumer.ErrReleased)
	require.NoError(t, c.imp.Close(ctx), "Close, want nil")
	c.checkClean(t)
}

// A producer in another process whose policy does not admit our uid refuses us, and
// says why.
func TestProcessPolicyRefusal(t *testing.T) {
	path := filepath.Join(shortDir(t), "p.sock")
	k := proctest.Start(t, "producer", "test", path, "other-uid", "a=4096:1")
	k.Expect("ready")
	s := newSide(t, 0)
	_, err := consumer.Dial(testCtx(t), path, s.dev, 0)
	require.ErrorIs(t, err, ErrRefused, "Dial = %v, want ErrRefused naming our uid", err)
	require.ErrorContains(t, err, fmt.Sprintf("uid %d gid %d is not allowed", os.Getuid(), os.Getgid()), "Dial = %v, want ErrRefused naming our uid", err)
	k.Send("quit")
	k.Finish()
}

// A producer in another process, closed cleanly, waits for our release first.
func TestProcessProducerClosesAfterRelease(t *testing.T) {
	path := filepath.Join(shortDir(t), "p.sock")
	k := proctest.Start(t, "producer", "test", path, "default", "a=2097152:3", "b=4096:4")
	k.Expect("ready")
	c := newConsumer(t, path, 0)
	ctx := testCtx(t)
	m, err := c.imp.Open(ctx, "a", c.stream)
	require.NoError(t, err)
	k.Send("free a")
	k.Expect("freed")
	k.Send("stats")
	got := k.Next()
	require.EqualValues(t, "stats 2 1 1", got, "producer %q, want 2 live buffers, 1 lease, 1 deferred free", got)
	b := c.read(t, m)
	require.True(t, allAre(b, 3), "freed-while-leased buffer changed")
	require.NoError(t, m.Release(ctx, c.stream))
	k.Send("stats")
	got = k.Next()
	require.EqualValues(t, "stats 1 0 0", got, "producer %q after release, want 1 live buffer, no lease, no deferred free", got)
	require.NoError(t, c.imp.Close(ctx))
	k.Send("quit")
	k.Finish()
	c.checkClean(t)
}
