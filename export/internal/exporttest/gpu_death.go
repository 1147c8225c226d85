package exporttest

import (
	"context"
	"errors"
	"fmt"
	"os"
	"time"

	"github.com/cudapool/cudapool/cudart"
	"github.com/cudapool/cudapool/export"
	"github.com/cudapool/cudapool/export/consumer"
	"github.com/cudapool/cudapool/internal/proctest"
)

// RolePeerConsumer: peer-consumer KIND SOCKET MODE FILL
// It opens "a" on device 1 (MODE "replica" or "replica-kill": WithLocalCopy), checks
// the bytes, says "opened", and on "check" (the producer is dead by then) reports,
// line by line: for a replica whether it still reads FILL, for a plain mapping
// whether its Context ended with ErrMappingLost; then whether fresh work on devices 1
// and 0 still runs. On "loop" (MODE "replica-kill") it says "looping" and makes
// replicas until an Open fails, as the producer is killed, and reports how many it
// made, whether each read FILL, and how the Open failed; then the same as "check". It
// ends with "done".
func RolePeerConsumer(args []string) int {
	fail := func(err error) int { fmt.Fprintln(os.Stderr, "peer-consumer:", err); return 1 }
	if len(args) != 4 {
		return fail(errors.New("want KIND SOCKET MODE FILL"))
	}
	rt, done, err := ChildRuntime(args[0])
	if err != nil {
		return fail(err)
	}
	defer done()
	var fill byte
	_, _ = fmt.Sscan(args[3], &fill) // a bad FILL shows as bytes that do not match
	const dev = 1
	ctx := context.Background()
	s, err := rt.StreamCreate(dev, cudart.StreamNonBlocking)
	if err != nil {
		return fail(err)
	}
	imp, err := consumer.Dial(ctx, args[1], rt, dev)
	if err != nil {
		return fail(err)
	}
	var opts []consumer.OpenOption
	if args[2] != "plain" {
		opts = append(opts, consumer.WithLocalCopy(nil))
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
	readsFill := func() error { return Holds(rt, dev, m, fill, s) }
	if err := readsFill(); err != nil {
		return fail(err)
	}
	fmt.Println("opened")
	for line := range proctest.Commands() {
		switch {
		case line == "loop" && args[2] == "replica-kill":
			fmt.Println("looping")
			ReplicateThroughKill(ctx, rt, imp, s, fill, check)
		case line != "check":
			return fail(fmt.Errorf("unknown command %q", line))
		}
		if args[2] != "plain" {
			check("replica reads the right bytes after the producer died", readsFill())
		} else {
			start := time.Now()
			select {
			case <-m.Context().Done():
				fmt.Printf("mapping told lost %v after the test reported the kill\n", time.Since(start).Round(time.Microsecond))
				if !errors.Is(m.Err(), consumer.ErrMappingLost) {
					check("told with ErrMappingLost", m.Err())
				}
			case <-time.After(5 * time.Second):
				check("told", errors.New("the mapping's context did not end within 5 s"))
			}
		}
		check("release", m.Release(ctx, s))
		check("close", imp.Close(ctx))
		check("context ok (fresh work on device 1)", FreshWork(rt, dev))
		check("context ok (fresh work on device 0)", FreshWork(rt, 0))
		fmt.Println("done")
		return 0
	}
	return 0
}

// Holds checks m's first, middle and last MiB (at most) for fill, on s.
func Holds(rt cudart.Runtime, dev int, m *consumer.Mapping, fill byte, s cudart.Stream) error {
	n := min(m.Size(), 1<<20)
	got := make([]byte, n)
	for _, off := range []uint64{0, (m.Size() - n) / 2, m.Size() - n} {
		if err := rt.MemcpyDtoHAsync(dev, got, m.Ptr()+cudart.DevicePtr(off), s); err != nil {
			return err
		}
		if !AllAre(got, fill) {
			return fmt.Errorf("bytes from %d on are not all %d", off, fill)
		}
	}
	return nil
}

// ReplicateThroughKill makes replicas of "a", four copies queued at a time, until an
// Open fails (the producer is killed meanwhile), and reports them: each must read
// fill, and the failure must be export.ErrExporterGone.
func ReplicateThroughKill(ctx context.Context, rt cudart.Runtime, imp *consumer.Importer, s cudart.Stream, fill byte, check func(string, error)) {
	const dev = 1
	var (
		made    int
		openErr error
		bad     []error
	)
	deadline := time.Now().Add(10 * time.Second)
	for openErr == nil && time.Now().Before(deadline) {
		var batch []*consumer.Mapping
		for range 4 {
			r, err := imp.Open(ctx, "a", s, consumer.WithLocalCopy(nil))
			if err != nil {
				openErr = err
				break
			}
			batch = append(batch, r)
		}
		for _, r := range batch {
			made++
			if err := Holds(rt, dev, r, fill, s); err != nil {
				bad = append(bad, fmt.Errorf("replica %d: %w", made, err))
			}
			if err := r.Release(ctx, s); err != nil {
				bad = append(bad, fmt.Errorf("release replica %d: %w", made, err))
			}
		}
	}
	fmt.Printf("replicas made as the producer was killed: %d\n", made)
	check("every replica made around the kill reads the right bytes", errors.Join(bad...))
	switch {
	case openErr == nil:
		check("an Open after the kill failed", errors.New("the Opens went on succeeding for 10 s"))
	case !errors.Is(openErr, export.ErrExporterGone):
		check("the Open after the kill failed with export.ErrExporterGone", openErr)
	default:
		fmt.Printf("the Open after the kill: %v\n", openErr)
	}
}

// FreshWork allocates, sets and reads back memory on dev: it fails once the process's
// context is lost.
func FreshWork(rt cudart.Runtime, dev int) error {
	p, err := rt.MemPoolCreate(cudart.PoolProps{Location: cudart.DeviceLocation(dev)})
	if err != nil {
		return err
	}
	defer func() { _ = rt.MemPoolDestroy(dev, p) }() // cleanup: what is tested is above
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
	if !AllAre(got, 3) {
		return errors.New("read back other bytes")
	}
	if err := rt.FreeAsync(dev, ptr, 0); err != nil {
		return err
	}
	return rt.StreamSynchronize(dev, 0)
}
