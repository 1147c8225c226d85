package main

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"os"
	"strconv"
	"strings"

	"github.com/cudapool/cudapool/cudart"
	"github.com/cudapool/cudapool/cudart/choose"
	"github.com/cudapool/cudapool/cudart/cudarttest"
	"github.com/cudapool/cudapool/export/consumer"
	"github.com/cudapool/cudapool/export/producer"
	"github.com/cudapool/cudapool/pool"
	"github.com/cudapool/cudapool/vmm"
)

// The processes poolstat is tested against: an exporter and consumers that do what the
// test tells them on stdin, step by step, and say on stdout when each step is done, so
// that every look poolstat takes sees a known state.

// The exporter's buffers: a 3 MiB one rounds up to 4 MiB in a 2 MiB-granular pool, so
// the table has a rounding overhead to show.
var exporterBuffers = []struct {
	name string
	size uint64
}{{"alpha", 4 << 20}, {"beta", 3 << 20}}

const exporterPoolMax = 16 << 20

// exporterRole: args socket. It publishes exporterBuffers from one pool on device 0,
// says "ready", then on "free NAME" unpublishes and frees that buffer (a free that waits
// for its importers) and says "freed NAME". At the end of stdin it shuts down in order.
func exporterRole(args []string) int {
	return roleMain("exporter", func(ctx context.Context, rt cudart.Runtime) error {
		stream, err := rt.StreamCreate(0, cudart.StreamNonBlocking)
		if err != nil {
			return err
		}
		p, err := pool.New(rt, 0, pool.WithName("test-pool"), pool.WithMaxSize(exporterPoolMax))
		if err != nil {
			return err
		}
		ex, err := producer.Listen(args[0], rt, producer.WithName("test-exporter"))
		if err != nil {
			return err
		}
		bufs := map[string]*pool.Buffer{}
		for _, b := range exporterBuffers {
			buf, err := p.Alloc(ctx, b.size, stream)
			if err != nil {
				return err
			}
			if err := rt.MemsetAsync(0, buf.Ptr(), 0x5a, b.size, stream); err != nil {
				return err
			}
			if err := ex.Publish(ctx, b.name, buf, stream); err != nil {
				return err
			}
			bufs[b.name] = buf
		}
		// And a VMM allocation of two chunks, which the table shows by its route.
		var chunks []*vmm.Chunk
		defer func() {
			for _, c := range chunks {
				_ = c.Close() // the publication held the memory; the exporter is closed by now
			}
		}()
		for range 2 {
			c, err := vmm.NewChunk(rt, 0, 2<<20)
			if err != nil {
				return err
			}
			chunks = append(chunks, c)
		}
		if err := ex.PublishChunks(ctx, "gamma", chunks, stream); err != nil {
			return err
		}
		fmt.Println("ready")
		in := bufio.NewScanner(os.Stdin)
		for in.Scan() {
			name, ok := strings.CutPrefix(in.Text(), "free ")
			if !ok || bufs[name] == nil {
				return fmt.Errorf("bad command %q", in.Text())
			}
			if err := errors.Join(ex.Unpublish(name), bufs[name].Free(stream)); err != nil {
				return err
			}
			delete(bufs, name)
			fmt.Println("freed", name)
		}
		err = ex.Close(ctx)
		for _, b := range bufs {
			err = errors.Join(err, b.Free(stream))
		}
		_, cerr := p.Close(ctx)
		return errors.Join(err, cerr, rt.StreamSynchronize(0, stream), rt.StreamDestroy(0, stream))
	})
}

// consumerRole: args socket, device, names. It opens each name, says "holding", and at
// the end of stdin releases them, says "released" and exits.
func consumerRole(args []string) int {
	return roleMain("consumer", func(ctx context.Context, rt cudart.Runtime) error {
		dev, err := strconv.Atoi(args[1])
		if err != nil {
			return err
		}
		imp, err := consumer.Dial(ctx, args[0], rt, dev)
		if err != nil {
			return err
		}
		var maps []*consumer.Mapping
		for _, name := range args[2:] {
			m, err := imp.Open(ctx, name, 0)
			if err != nil {
				return err
			}
			maps = append(maps, m)
		}
		fmt.Println("holding")
		in := bufio.NewScanner(os.Stdin)
		for in.Scan() {
		}
		for _, m := range maps {
			err = errors.Join(err, m.Release(ctx, 0))
		}
		err = errors.Join(err, imp.Close(ctx))
		fmt.Println("released")
		return err
	})
}

// roleMain runs body on the runtime the test runs on, and fails on any error or any rule
// the software device saw broken.
func roleMain(role string, body func(ctx context.Context, rt cudart.Runtime) error) int {
	picked, err := testRuntime()
	rt := picked.Runtime
	if err == nil {
		err = errors.Join(body(context.Background(), rt), choose.Violations(rt))
	}
	if err != nil {
		fmt.Fprintf(os.Stderr, "%s: %v\n", role, err)
		return 1
	}
	return 0
}

// softDevicesEnv, set by a test, gives the software device of the test and of its
// children that many devices, as a host with fewer GPUs has.
const softDevicesEnv = "POOLSTAT_TEST_DEVICES"

// testRuntime is the runtime the tests and their children run on: choose.Auto's, with
// the software device's devices counted by softDevicesEnv where it is set.
func testRuntime() (choose.Choice, error) {
	picked, err := choose.Runtime(choose.Auto)
	n, nerr := strconv.Atoi(os.Getenv(softDevicesEnv))
	if err != nil || picked.OnGPU || nerr != nil {
		return picked, err
	}
	if err := picked.Runtime.(*cudarttest.Device).Close(); err != nil {
		return choose.Choice{}, err
	}
	picked.Runtime = cudarttest.New(cudarttest.WithDevices(n))
	return picked, nil
}
