//go:build !cgo || !linux

package cudart_test

import (
	"strings"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/cudapool/cudapool/cudart"
)

func TestLoadFailsWithoutCgoBinding(t *testing.T) {
	_, err := cudart.Load()
	var le *cudart.LoadError
	require.ErrorAs(t, err, &le)
	require.ErrorIs(t, err, cudart.ErrNoRuntime)
	require.Len(t, le.Tried, 1, "want one reason")
	require.True(t, strings.Contains(le.Tried[0], "cgo") || strings.Contains(le.Tried[0], "only Linux"),
		"the reason %q says neither cgo nor the OS", le.Tried[0])
}
