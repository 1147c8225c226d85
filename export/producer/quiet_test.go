package producer_test

import (
	"bytes"
	"path/filepath"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/cudapool/cudapool/export/internal/exporttest"
	"github.com/cudapool/cudapool/internal/proctest"
)

// The library writes nothing to its process's stderr unless asked (WithLogger): a
// second exporter probing a live socket, a connection that is not admitted (garbage
// for a Hello) and a refused Importer log only through a logger the caller set.
func TestNothingOnStderrUnlessAsked(t *testing.T) {
	var stderr bytes.Buffer
	cmd := proctest.Command(t, "quiet", filepath.Join(exporttest.ShortDir(t), "q.sock"))
	cmd.Stderr = &stderr
	err := cmd.Run()
	require.NoError(t, err, "the quiet role: %s", stderr.String())
	require.Empty(t, stderr.String(), "the library wrote to stderr")
}
