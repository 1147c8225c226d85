package e2e_test

import (
	"fmt"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/cudapool/cudapool/cudart"
	"github.com/cudapool/cudapool/export/internal/exporttest"
)

// Releases from many goroutines, each on its own stream with copies of its mapping
// still queued: each import is freed after the work on its own stream, never after
// another stream's later work alone. With one ordering event recorded on every
// caller's stream, the software device saw imports freed under queued reads in
// every run.
func TestConcurrentReleasesOnManyStreams(t *testing.T) {
	pr := exporttest.NewProducer(t, nil, nil)
	const n = 8
	for i := range n {
		pr.Publish(t, fmt.Sprint("b", i), 1<<20, byte(0x50+i))
	}
	c := exporttest.NewConsumer(t, pr.Path, 1)
	ctx := exporttest.Ctx(t)
	c.EachOnItsStream(t, n, func(i int, s cudart.Stream) error {
		p, err := c.Dev.MemPoolCreate(cudart.PoolProps{Location: cudart.DeviceLocation(1)})
		if err != nil {
			return err
		}
		dst, err := c.Dev.MallocFromPoolAsync(1, 1<<20, p, s)
		if err != nil {
			return err
		}
		for range 5 {
			m, err := c.Imp.Open(ctx, fmt.Sprint("b", i), s)
			if err != nil {
				return err
			}
			for range 4 { // reads still queued at Release
				if err := c.Dev.MemcpyDtoDAsync(1, dst, m.Ptr(), m.Size(), s); err != nil {
					return err
				}
			}
			if err := m.Release(ctx, s); err != nil {
				return err
			}
		}
		return c.Dev.FreeAsync(1, dst, s)
	})
	require.NoError(t, c.Imp.Close(ctx))
	require.NoError(t, c.Dev.Synchronize())
	c.CheckClean(t)
}
