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
	opts := []producer.ListenOption{producer.WithoutAnnounce(), producer.WithLogger(quiet)}
	switch args[2] {
	case "other-uid":
		opts = append(opts, producer.WithPolicy(export.Policy{AllowUIDs: []uint32{uint32(os.Getuid()) + 1}}))
	case "retain":
		opts = append(opts, producer.WithRetainedImports())
	}
	ex, err := producer.Listen(args[1], rt, opts...)
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
			entries := make([]producer.Entry, n)
			for i := range entries {
				size := b.Size() / n
				entries[i] = producer.Entry{Name: fmt.Sprintf("%s-%d", f[1], i), Buffer: b, Options: []producer.PublishOption{producer.Range(uint64(i)*size, size)}}
			}
			if err := ex.PublishAll(ctx, entries, stream); err != nil {
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
			if err := RuntimeErr(rt); err != nil {
				return fail(err)
			}
			return 0
		default:
			return fail(fmt.Errorf("unknown command %q", line))
		}
	}
	return 0
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
