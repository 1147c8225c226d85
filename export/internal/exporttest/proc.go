package exporttest

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"os"
	"os/exec"
	"strconv"
	"strings"
	"syscall"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/cudapool/cudapool/cudart"
	"github.com/cudapool/cudapool/cudart/cudarttest"
	"github.com/cudapool/cudapool/export"
	"github.com/cudapool/cudapool/export/consumer"
	"github.com/cudapool/cudapool/export/producer"
	"github.com/cudapool/cudapool/internal/proctest"
	"github.com/cudapool/cudapool/internal/unixfd"
	"github.com/cudapool/cudapool/pool"
)

// ChildRuntime is the runtime a child role runs on: "test" for a software device of
// its own (a process of its own, as on a GPU host), "gpu" for the real runtime.
func ChildRuntime(kind string) (cudart.Runtime, func(), error) {
	if kind == "gpu" {
		rt, err := cudart.Load()
		return rt, func() {}, err
	}
	d := cudarttest.New()
	return d, func() { _ = d.Close() }, nil // cleanup: what is tested is above
}

// RuntimeErr is the software device's violations, nil on the real runtime.
func RuntimeErr(rt cudart.Runtime) error {
	if d, ok := rt.(interface{ Err() error }); ok {
		return d.Err()
	}
	return nil
}

// RoleProducer: producer KIND SOCKET POLICY NAME=SIZE:FILL...
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
func RoleProducer(args []string) int {
	fail := func(err error) int { fmt.Fprintln(os.Stderr, "producer:", err); return 1 }
	if len(args) < 3 {
		return fail(errors.New("want KIND SOCKET POLICY and NAME=SIZE:FILL for each buffer"))
	}
	rt, done, err := ChildRuntime(args[0])
	if err != nil {
		return fail(err)
	}
	defer done()
	r, err := startProducerRole(rt, args[1], args[2], args[3:])
	if err != nil {
		return fail(err)
	}
	fmt.Println("ready")
	for line := range proctest.Commands() {
		f := strings.Fields(line)
		var c producerCommand
		if len(f) > 0 {
			c = producerCommands[f[0]]
		}
		if c.do == nil || len(f) != 1+c.args {
			return fail(fmt.Errorf("unknown command %q", line))
		}
		reply, err := c.do(r, f[1:])
		if err != nil {
			return fail(err)
		}
		if f[0] == "quit" {
			return 0
		}
		fmt.Println(reply)
	}
	return 0
}

// producerRole is what [RoleProducer] works with: its stream, pool and exporter and
// the buffers it published, by name.
type producerRole struct {
	ctx    context.Context
	rt     cudart.Runtime
	stream cudart.Stream
	p      *pool.Pool
	ex     *producer.Exporter
	bufs   map[string]*pool.Buffer
}

// producerCommand is one command of [RoleProducer]: it takes args words after its
// name, and do obeys it and returns the line to say.
type producerCommand struct {
	args int
	do   func(r *producerRole, f []string) (string, error)
}

// producerCommands are [RoleProducer]'s commands by name, as its doc comment lists them.
var producerCommands = map[string]producerCommand{
	"free":     {1, (*producerRole).free},
	"refill":   {2, (*producerRole).refill},
	"stats":    {0, (*producerRole).stats},
	"recycle":  {2, (*producerRole).recycle},
	"ranges":   {2, (*producerRole).ranges},
	"trim":     {0, (*producerRole).trim},
	"retained": {0, (*producerRole).retained},
	"quit":     {0, (*producerRole).quit},
}

// startProducerRole makes a stream and a pool on device 0 of rt (with a cache for
// policy "retain"), listens on socket under policy, and publishes each buffer of
// specs (NAME=SIZE:FILL), filled, its writes done before it returns.
func startProducerRole(rt cudart.Runtime, socket, policy string, specs []string) (*producerRole, error) {
	r := &producerRole{ctx: context.Background(), rt: rt, bufs: map[string]*pool.Buffer{}}
	var err error
	if r.stream, err = rt.StreamCreate(0, cudart.StreamNonBlocking); err != nil {
		return nil, err
	}
	var poolOpts []pool.Option
	if policy == "retain" {
		poolOpts = append(poolOpts, pool.WithCache(1<<30))
	}
	if r.p, err = pool.New(rt, 0, poolOpts...); err != nil {
		return nil, err
	}
	// Refusals are this role's job in some tests: only errors are worth a line.
	quiet := slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: slog.LevelError}))
	opts := []producer.ListenOption{producer.WithoutAnnounce(), producer.WithLogger(quiet)}
	switch policy {
	case "other-uid":
		opts = append(opts, producer.WithPolicy(export.Policy{AllowUIDs: []uint32{uint32(os.Getuid()) + 1}}))
	case "retain":
		opts = append(opts, producer.WithRetainedImports())
	}
	if r.ex, err = producer.Listen(socket, rt, opts...); err != nil {
		return nil, err
	}
	for _, spec := range specs {
		var name string
		var size uint64
		var fill byte
		if _, err := fmt.Sscanf(strings.Replace(strings.Replace(spec, "=", " ", 1), ":", " ", 1), "%s %d %d", &name, &size, &fill); err != nil {
			return nil, fmt.Errorf("spec %q: %w", spec, err)
		}
		b, err := r.filled(size, fill)
		if err == nil {
			err = r.ex.Publish(r.ctx, name, b, r.stream)
		}
		if err != nil {
			return nil, err
		}
		r.bufs[name] = b
	}
	// Written before "ready": a test that kills the producer then kills it after its
	// writes, not (on a deferred software device) before they ran.
	return r, rt.StreamSynchronize(0, r.stream)
}

// filled allocates size bytes and fills them with fill on the stream.
func (r *producerRole) filled(size uint64, fill byte) (*pool.Buffer, error) {
	b, err := r.p.Alloc(r.ctx, size, r.stream)
	if err != nil {
		return nil, err
	}
	return b, r.rt.MemsetAsync(0, b.Ptr(), fill, size, r.stream)
}

// free NAME: free the buffer (deferred while leased).
func (r *producerRole) free(f []string) (string, error) {
	return "freed", r.bufs[f[0]].Free(r.stream)
}

// refill SIZE FILL: allocate SIZE bytes, fill them, synchronise.
func (r *producerRole) refill(f []string) (string, error) {
	size, _ := strconv.ParseUint(f[0], 10, 64)
	fill, _ := strconv.ParseUint(f[1], 10, 8)
	if _, err := r.filled(size, byte(fill)); err != nil {
		return "", err
	}
	return "refilled", r.rt.StreamSynchronize(0, r.stream)
}

// stats: the pool's live buffers, active leases and deferred frees.
func (r *producerRole) stats([]string) (string, error) {
	s, err := r.p.Stats()
	return fmt.Sprintf("stats %v %v %v", s.LiveBuffers, s.ActiveLeases, s.DeferredFrees), err
}

// recycle NAME FILL: unpublish NAME and free it, allocate its size again, fill it
// and publish it under NAME; "recycled same" if the memory is the same.
func (r *producerRole) recycle(f []string) (string, error) {
	old := r.bufs[f[0]]
	fill, _ := strconv.ParseUint(f[1], 10, 8)
	err := r.ex.Unpublish(f[0])
	if err == nil {
		err = old.Free(r.stream)
	}
	var b *pool.Buffer
	if err == nil {
		b, err = r.filled(old.Size(), byte(fill))
	}
	if err == nil {
		err = r.ex.Publish(r.ctx, f[0], b, r.stream)
	}
	if err != nil {
		return "", err
	}
	r.bufs[f[0]] = b
	if b.Ptr() == old.Ptr() {
		return "recycled same", nil
	}
	return "recycled new", nil
}

// ranges NAME N: publish N equal ranges of NAME as NAME-0..NAME-(N-1) in one
// PublishAll.
func (r *producerRole) ranges(f []string) (string, error) {
	b := r.bufs[f[0]]
	n, _ := strconv.ParseUint(f[1], 10, 32)
	if n == 0 || b.Size()%n != 0 {
		return "", fmt.Errorf("%d ranges of %d bytes", n, b.Size())
	}
	entries := make([]producer.Entry, n)
	for i := range entries {
		size := b.Size() / n
		entries[i] = producer.Entry{Name: fmt.Sprintf("%s-%d", f[0], i), Buffer: b, Options: []producer.PublishOption{producer.Range(uint64(i)*size, size)}}
	}
	return "ranged", r.ex.PublishAll(r.ctx, entries, r.stream)
}

// trim: trim the pool's cache.
func (r *producerRole) trim([]string) (string, error) { return "trimmed", r.p.Trim() }

// retained: the pool's retentions and revoking buffers.
func (r *producerRole) retained([]string) (string, error) {
	s, err := r.p.Stats()
	return fmt.Sprintf("retained %v %v", s.Retentions, s.RevokingBuffers), err
}

// quit: close the exporter (waiting for releases); the software device's
// violations are its error.
func (r *producerRole) quit([]string) (string, error) {
	if err := r.ex.Close(r.ctx); err != nil {
		return "", err
	}
	return "", RuntimeErr(r.rt)
}

// RoleConsumer: consumer KIND SOCKET DEVICE NAME FILL MODE
// It opens NAME on DEVICE, checks every byte is FILL and then, for MODE "release",
// releases, closes and says "ok"; for MODE "hold" says "holding" and waits to be
// killed, obeying stdin meanwhile:
//
//	hang-up  close the connection without Bye, keeping the mapping; say "hung up"
//
// For MODE "retain", NAME is a comma-separated list: it opens, checks and releases each
// (an exporter WithRetainedImports retains their imports), says "retained" and waits,
// its Importer open, until killed or its stdin ends.
func RoleConsumer(args []string) int {
	fail := func(err error) int { fmt.Fprintln(os.Stderr, "consumer:", err); return 1 }
	if len(args) != 6 {
		return fail(errors.New("want KIND SOCKET DEVICE NAME FILL MODE"))
	}
	rt, done, err := ChildRuntime(args[0])
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
	// DialConn over a connection of its own, to hang up without Bye ("hang-up").
	nc, err := net.Dial("unix", args[1])
	if err != nil {
		return fail(err)
	}
	imp, err := consumer.DialConn(ctx, nc, rt, dev)
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
	if !AllAre(got, byte(fill)) {
		return fail(fmt.Errorf("%s: bytes are not all %#x", args[3], fill))
	}
	if args[5] == "hold" {
		fmt.Println("holding")
		for line := range proctest.Commands() {
			if line != "hang-up" {
				return fail(fmt.Errorf("unknown command %q", line))
			}
			if err := nc.Close(); err != nil {
				return fail(err)
			}
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
	if err := RuntimeErr(rt); err != nil {
		return fail(err)
	}
	fmt.Println("ok")
	return 0
}

// RoleConnector: connector SOCKET
// It connects to SOCKET, passes the connection to its parent over the Unix socket at
// descriptor 3, and exits: the exporter then serves a connection whose process is
// gone.
func RoleConnector(args []string) int {
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

// KilledBySIGKILL fails the test unless reaping k shows it was killed by SIGKILL: then
// nothing reaped it before.
func KilledBySIGKILL(t *testing.T, k *proctest.Child) {
	t.Helper()
	var exit *exec.ExitError
	err := k.Wait()
	require.ErrorAs(t, err, &exit, "reaping the killed child")
	require.Equal(t, syscall.SIGKILL, exit.Sys().(syscall.WaitStatus).Signal(), "the killed child's end")
}

// PoolBackTo fails the test unless pr's pool holds what it held when it showed before:
// no lease, no free waiting, the same buffers and bytes.
func (pr *Producer) PoolBackTo(t *testing.T, before pool.Stats) {
	t.Helper()
	require.NoError(t, pr.Dev.Synchronize()) // the driver counts memory in use until its free has run
	after, _ := pr.Pool.Stats()
	require.EqualValues(t, before.LiveBuffers, after.LiveBuffers, "pool %+v, before %+v", after, before)
	require.EqualValues(t, 0, after.DeferredFrees, "pool %+v, before %+v", after, before)
	require.EqualValues(t, 0, after.ActiveLeases, "pool %+v, before %+v", after, before)
	require.EqualValues(t, before.UsedCurrent, after.UsedCurrent, "pool %+v, before %+v", after, before)
}

// Roles are the child processes the tests start (proctest.Start), by name: each test
// package's TestMain hands them to proctest.Main.
var Roles = map[string]func([]string) int{
	"producer":           RoleProducer,
	"consumer":           RoleConsumer,
	"bench-consumer":     RoleBenchConsumer,
	"roundtrip-consumer": RoleRoundTripConsumer,
	"connector":          RoleConnector,
	"lingering-consumer": RoleLingeringConsumer,
	"peer-consumer":      RolePeerConsumer,
	"dialer":             RoleDialer,
	"quiet":              RoleQuiet,
	"vmm-producer":       RoleVMMProducer,
	"vmm-consumer":       RoleVMMConsumer,
}
