package proctest

import (
	"fmt"
	"os"
	"path/filepath"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/cudapool/cudapool/export/discover"
)

// announceDirRole prints the default announce directory it sees.
func announceDirRole([]string) int {
	fmt.Println(discover.DefaultDir())
	return 0
}

// Under Main, the default announce directory, in the tests and in the children they
// start, is one that cannot be made: an exporter announcing there fails, naming it,
// and nothing reaches the user's real directory.
func TestAnnounceDirIsTrapped(t *testing.T) {
	require.Equal(t, discover.DirEnv, announceDirEnv, "proctest sets the variable discover reads")
	dir := discover.DefaultDir()
	require.Equal(t, trapName, filepath.Base(dir))
	err := discover.EnsureDir(dir)
	require.Error(t, err, "the trapped directory %s could be made", dir)
	assert.Contains(t, err.Error(), trapName, "the error names the trap")
	_, err = os.Stat(dir)
	assert.Error(t, err)

	c := Start(t, "announce-dir")
	c.Expect(dir)
	c.Finish()

	own := t.TempDir()
	t.Setenv(discover.DirEnv, own)
	c = Start(t, "announce-dir")
	c.Expect(own)
	c.Finish()
}
