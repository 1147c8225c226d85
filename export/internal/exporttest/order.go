package exporttest

import (
	"testing"

	"github.com/stretchr/testify/require"
	"golang.org/x/sync/errgroup"

	"github.com/cudapool/cudapool/cudart"
)

// EachOnItsStream runs f(i, s) for every i below n at once, each with a stream of its
// own on the consumer's device, which is synchronised after.
func (c *Consumer) EachOnItsStream(t *testing.T, n int, f func(i int, s cudart.Stream) error) {
	t.Helper()
	var g errgroup.Group
	for i := range n {
		g.Go(func() error {
			s, err := c.Dev.StreamCreate(c.Ord, cudart.StreamNonBlocking)
			if err != nil {
				return err
			}
			if err := f(i, s); err != nil {
				return err
			}
			return c.Dev.StreamSynchronize(c.Ord, s)
		})
	}
	require.NoError(t, g.Wait())
}
