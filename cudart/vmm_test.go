package cudart_test

import (
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/cudapool/cudapool/cudart"
	"github.com/cudapool/cudapool/cudart/cudarttest"
	"github.com/cudapool/cudapool/internal/intercept"
)

// VMMOf finds the route behind a Runtime that wraps another, and says when there is
// none.
func TestVMMOfFollowsWrappers(t *testing.T) {
	d := cudarttest.ForTest(t)
	v, err := cudart.VMMOf(intercept.Wrap(intercept.Wrap(d)))
	require.NoError(t, err)
	require.Same(t, d, v.(*cudarttest.Device))

	_, err = cudart.VMMOf(noVMM{d})
	require.ErrorIs(t, err, cudart.ErrNoVMM)
	require.ErrorContains(t, err, "cudarttest software device")
	_, err = cudart.VMMOf(nil)
	require.ErrorIs(t, err, cudart.ErrNoVMM)
}

// noVMM is a Runtime that hides the route of the one it embeds.
type noVMM struct{ cudart.Runtime }
