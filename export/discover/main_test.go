package discover_test

import (
	"testing"

	"github.com/cudapool/cudapool/export/internal/exporttest"
	"github.com/cudapool/cudapool/internal/proctest"
)

func TestMain(m *testing.M) { proctest.Main(m, exporttest.Roles) }
