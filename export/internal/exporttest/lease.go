package exporttest

import (
	"testing"

	"github.com/stretchr/testify/require"
)

// ActiveLeases reads the producer pool's lease count.
func (pr *Producer) ActiveLeases(t testing.TB) int {
	t.Helper()
	s, err := pr.Pool.Stats()
	require.NoError(t, err)
	return s.ActiveLeases
}
