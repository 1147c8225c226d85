package exporttest

import (
	"context"
	"errors"
	"fmt"
	"os"
	"strconv"
	"strings"
	"time"

	"github.com/cudapool/cudapool/cudart"
	"github.com/cudapool/cudapool/export/consumer"
	"github.com/cudapool/cudapool/internal/proctest"
	"github.com/cudapool/cudapool/pool"
)

// RoleBenchConsumer: bench-consumer KIND SOCKET DEVICE, then commands on stdin, each
// answered with "ns TOTAL" (nanoseconds the consumer spent on the timed part):
//
//	open NAME COUNT N     N times: Open NAME<i%COUNT> (timed), Release
//	fresh NAME FROM TO    Open NAME<i> for i in [FROM,TO) (timed), then Release each
//	release NAME N        N times: Open NAME, Release (timed)
//	read NAME N           Open NAME, then N copies of it into a local buffer (timed)
func RoleBenchConsumer(args []string) int {
	fail := func(err error) int { fmt.Fprintln(os.Stderr, "bench-consumer:", err); return 1 }
	if len(args) != 3 {
		return fail(errors.New("want KIND SOCKET DEVICE"))
	}
	rt, done, err := ChildRuntime(args[0])
	if err != nil {
		return fail(err)
	}
	defer done()
	dev, _ := strconv.Atoi(args[2])
	ctx := context.Background()
	s, err := rt.StreamCreate(dev, cudart.StreamNonBlocking)
	if err != nil {
		return fail(err)
	}
	imp, err := consumer.Dial(ctx, args[1], rt, dev)
	if err != nil {
		return fail(err)
	}
	defer func() { _ = imp.Close(ctx) }() // cleanup: what is tested is above
	for line := range proctest.Commands() {
		f := strings.Fields(line)
		if len(f) == 0 {
			continue
		}
		num := func(i int) int { n, _ := strconv.Atoi(f[i]); return n }
		var spent time.Duration
		var err error
		switch f[0] {
		case "open":
			spent, err = BenchOpen(ctx, imp, s, f[1], num(2), num(3))
		case "fresh":
			spent, err = BenchFresh(ctx, imp, s, f[1], num(2), num(3))
		case "release":
			spent, err = BenchRelease(ctx, imp, s, f[1], num(2))
		case "read":
			spent, err = BenchRead(ctx, rt, dev, imp, s, f[1], num(2))
		default:
			err = fmt.Errorf("unknown command %q", line)
		}
		if err != nil {
			return fail(err)
		}
		fmt.Println("ns", spent.Nanoseconds())
	}
	return 0
}

func BenchOpen(ctx context.Context, imp *consumer.Importer, s cudart.Stream, name string, count, n int) (time.Duration, error) {
	var spent time.Duration
	for i := range n {
		start := time.Now()
		m, err := imp.Open(ctx, fmt.Sprint(name, i%count), s)
		spent += time.Since(start)
		if err != nil {
			return 0, err
		}
		if err := m.Release(ctx, s); err != nil {
			return 0, err
		}
	}
	return spent, nil
}

func BenchFresh(ctx context.Context, imp *consumer.Importer, s cudart.Stream, name string, from, to int) (time.Duration, error) {
	ms := make([]*consumer.Mapping, 0, to-from)
	start := time.Now()
	for i := from; i < to; i++ {
		m, err := imp.Open(ctx, fmt.Sprint(name, i), s)
		if err != nil {
			return 0, err
		}
		ms = append(ms, m)
	}
	spent := time.Since(start)
	for _, m := range ms {
		if err := m.Release(ctx, s); err != nil {
			return 0, err
		}
	}
	return spent, nil
}

func BenchRelease(ctx context.Context, imp *consumer.Importer, s cudart.Stream, name string, n int) (time.Duration, error) {
	var spent time.Duration
	for range n {
		m, err := imp.Open(ctx, name, s)
		if err != nil {
			return 0, err
		}
		start := time.Now()
		err = m.Release(ctx, s)
		spent += time.Since(start)
		if err != nil {
			return 0, err
		}
	}
	return spent, nil
}

func BenchRead(ctx context.Context, rt cudart.Runtime, dev int, imp *consumer.Importer, s cudart.Stream, name string, n int) (time.Duration, error) {
	m, err := imp.Open(ctx, name, s)
	if err != nil {
		return 0, err
	}
	defer func() { _ = m.Release(ctx, s) }() // cleanup: what is tested is above
	local, err := pool.New(rt, dev, pool.WithHandleType(cudart.HandleTypeNone))
	if err != nil {
		return 0, err
	}
	defer func() { _, _ = local.Close(ctx, pool.Force()) }() // cleanup: what is tested is above
	dst, err := local.Alloc(ctx, m.Size(), s)
	if err != nil {
		return 0, err
	}
	// One untimed copy first, so that first-touch costs are not counted.
	if err := rt.MemcpyDtoDAsync(dev, dst.Ptr(), m.Ptr(), m.Size(), s); err != nil {
		return 0, err
	}
	if err := rt.StreamSynchronize(dev, s); err != nil {
		return 0, err
	}
	start := time.Now()
	for range n {
		if err := rt.MemcpyDtoDAsync(dev, dst.Ptr(), m.Ptr(), m.Size(), s); err != nil {
			return 0, err
		}
	}
	err = rt.StreamSynchronize(dev, s)
	spent := time.Since(start)
	_ = dst.Free(s) // cleanup: what is tested is above
	return spent, err
}
