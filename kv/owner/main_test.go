package owner_test

import (
	"os"
	"testing"

	"github.com/cudapool/cudapool/internal/proctest"
)

// TestMain traps the default announce directory (proctest.TrapAnnounceDir): a test
// whose owner announces its slab exporter gives it a directory of its own, or none.
func TestMain(m *testing.M) { os.Exit(proctest.TrapAnnounceDir(m)) }
