package export

// On a GPU host with two GPUs: a producer process on GPU 0 is SIGKILLed while a
// consumer process on GPU 1 holds its buffer (FACTS 14). With WithReplica the consumer
// still reads the right bytes afterwards; without, it is told at once (its Mapping's
// Context ends with ErrMappingLost) and releases without losing its CUDA context.
// The consumers run as children: if one did lose its context, this process must not.
//
//	cd export && CUDAPOOL_REQUIRE_GPU=1 ../bin/gpu/export.test -test.v -test.run TestGPUPeerConsumerSurvivesProducerKill

import (
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/cudapool/cudapool/cudart"
	"github.com/cudapool/cudapool/internal/gputest"
	"github.com/cudapool/cudapool/internal/proctest"
)

func TestGPUPeerConsumerSurvivesProducerKill(t *testing.T) {
	gputest.Devices(t, 2)
	peerConsumerSurvivesProducerKill(t, "gpu", 256<<20)
}

// The same with both processes on software devices, which model FACTS 14.
func TestProcessPeerConsumerSurvivesProducerKill(t *testing.T) {
	peerConsumerSurvivesProducerKill(t, "test", 4<<20)
}

func peerConsumerSurvivesProducerKill(t *testing.T, kind string, size int) {
	const fill = 77
	for _, mode := range []string{"replica", "plain"} {
		t.Run(mode, func(t *testing.T) {
			path := filepath.Join(shortDir(t), "g.sock")
			k := proctest.Start(t, "producer", kind, path, "default", fmt.Sprintf("a=%d:%d", size, fill))
			k.Expect("ready")
			c := proctest.Start(t, "peer-consumer", kind, path, mode, fmt.Sprint(fill))
			c.Expect("opened")
			start := time.Now()
			killProducer(t, k)
			t.Logf("producer on GPU 0 SIGKILLed and reaped in %v", time.Since(start).Round(time.Microsecond))
			c.Send("check")
			var lines []string
			for l := c.Next(); l != "done"; l = c.Next() {
				t.Log(l)
				lines = append(lines, l)
			}
			report := strings.Join(lines, "\n")
			assert.NotContains(t, report, "FAILED", "the consumer on GPU 1")
			assert.Contains(t, report, "context ok", "the consumer on GPU 1 kept its CUDA context")
			require.NoError(t, c.Wait())
		})
	}
}

// rolePeerConsumer: peer-consumer KIND SOCKET MODE FILL
// It opens "a" on device 1 (MODE "replica": WithReplica), checks the bytes, says
// "opened", and on "check" (the producer is dead by then) reports, line by line:
// for a replica whether it still reads FILL, for a plain mapping whether its Context
// ended with ErrMappingLost; then whether fresh work on device 1 still runs. It ends
// with "done".
func rolePeerConsumer(args []string) int {
	fail := func(err error) int { fmt.Fprintln(os.Stderr, "peer-consumer:", err); return 1 }
	if len(args) != 4 {
		return fail(errors.New("want KIND SOCKET MODE FILL"))
	}
	rt, done, err := childRuntime(args[0])
	if err != nil {
		return fail(err)
	}
	defer done()
	var fill byte
	fmt.Sscan(args[3], &fill)
	const dev = 1
	ctx := context.Background()
	s, err := rt.StreamCreate(dev, cudart.StreamNonBlocking)
	if err != nil {
		return fail(err)
	}
	imp, err := Dial(ctx, args[1], rt, dev)
	if err != nil {
		return fail(err)
	}
	var opts []OpenOption
	if args[2] == "replica" {
		opts = append(opts, WithReplica(nil))
	}
	m, err := imp.Open(ctx, "a", s, opts...)
	if err != nil {
		return fail(err)
	}
	check := func(what string, err error) {
		if err != nil {
			fmt.Printf("%s: FAILED: %v\n", what, err)
		} else {
			fmt.Printf("%s: ok\n", what)
		}
	}
	readsFill := func() error {
		got := make([]byte, m.Size())
		if err := rt.MemcpyDtoHAsync(dev, got, m.Ptr(), s); err != nil {
			return err
		}
		if !allAre(got, fill) {
			return fmt.Errorf("bytes are not all %d", fill)
		}
		return nil
	}
	if err := readsFill(); err != nil {
		return fail(err)
	}
	fmt.Println("opened")
	for line := range proctest.Commands() {
		if line != "check" {
			return fail(fmt.Errorf("unknown command %q", line))
		}
		if args[2] == "replica" {
			check("replica reads the right bytes after the producer died", readsFill())
		} else {
			start := time.Now()
			select {
			case <-m.Context().Done():
				fmt.Printf("mapping told lost %v after the test reported the kill\n", time.Since(start).Round(time.Microsecond))
				if !errors.Is(m.Err(), ErrMappingLost) {
					check("told with ErrMappingLost", m.Err())
				}
			case <-time.After(5 * time.Second):
				check("told", errors.New("the mapping's context did not end within 5 s"))
			}
		}
		check("release", m.Release(ctx, s))
		check("close", imp.Close(ctx))
		check("context ok (fresh work on device 1)", freshWork(rt, dev))
		fmt.Println("done")
		return 0
	}
	return 0
}

// freshWork allocates, sets and reads back memory on dev: it fails once the process's
// context is lost.
func freshWork(rt cudart.Runtime, dev int) error {
	p, err := rt.MemPoolCreate(cudart.PoolProps{Location: cudart.DeviceLocation(dev)})
	if err != nil {
		return err
	}
	defer rt.MemPoolDestroy(dev, p)
	ptr, err := rt.MallocFromPoolAsync(dev, 1<<20, p, 0)
	if err != nil {
		return err
	}
	got := make([]byte, 1<<20)
	if err := rt.MemsetAsync(dev, ptr, 3, 1<<20, 0); err != nil {
		return err
	}
	if err := rt.MemcpyDtoHAsync(dev, got, ptr, 0); err != nil {
		return err
	}
	if !allAre(got, 3) {
		return errors.New("read back other bytes")
	}
	if err := rt.FreeAsync(dev, ptr, 0); err != nil {
		return err
	}
	return rt.StreamSynchronize(dev, 0)
}
