package cudart_test

import (
	"testing"

	"github.com/cudapool/cudapool/internal/proctest"
)

// TestMain lets the GPU tests and benchmarks re-execute this binary as the other
// process of a pair.
func TestMain(m *testing.M) {
	proctest.Main(m, childRoles)
}
