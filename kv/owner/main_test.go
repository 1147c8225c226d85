package owner_test

import (
	"testing"

	"github.com/cudapool/cudapool/internal/proctest"
)

// TestMain runs the child roles of the tests (writer: restart_test.go), and the tests
// with the default announce directory trapped (proctest.TrapAnnounceDir): a test whose
// owner announces its slab exporter gives it a directory of its own, or none.
func TestMain(m *testing.M) { proctest.Main(m, map[string]func([]string) int{"writer": writer}) }
