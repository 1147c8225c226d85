package privdir

import (
	"io/fs"
	"os"
	"path/filepath"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

func TestCheck(t *testing.T) {
	base := t.TempDir()

	fresh := filepath.Join(base, "new", "deep")
	reason, err := Check(fresh)
	require.NoError(t, err)
	assert.Empty(t, reason)
	info, err := os.Stat(fresh)
	require.NoError(t, err)
	assert.Equal(t, os.FileMode(0o700), info.Mode().Perm())

	open := filepath.Join(base, "open")
	require.NoError(t, os.Mkdir(open, 0o700))
	require.NoError(t, os.Chmod(open, 0o777))
	reason, err = Check(open)
	require.NoError(t, err)
	assert.Contains(t, reason, "group or others can write")
	assert.ErrorContains(t, Ensure(open), "not private")

	link := filepath.Join(base, "link")
	require.NoError(t, os.Symlink(fresh, link))
	reason, err = Check(link)
	require.NoError(t, err)
	assert.Contains(t, reason, "not a directory")
}

// Inspect finds what Check finds, and creates nothing.
func TestInspect(t *testing.T) {
	base := t.TempDir()
	missing := filepath.Join(base, "missing")
	_, err := Inspect(missing)
	require.ErrorIs(t, err, fs.ErrNotExist)
	assert.NoDirExists(t, missing, "Inspect created the directory")

	reason, err := Inspect(base)
	require.NoError(t, err)
	assert.Empty(t, reason)

	open := filepath.Join(base, "open")
	require.NoError(t, os.Mkdir(open, 0o700))
	require.NoError(t, os.Chmod(open, 0o770))
	reason, err = Inspect(open)
	require.NoError(t, err)
	assert.Contains(t, reason, "group or others can write")

	if os.Getuid() == 0 {
		theirs := filepath.Join(base, "theirs")
		require.NoError(t, os.Mkdir(theirs, 0o700))
		require.NoError(t, os.Chown(theirs, 4242, 4242))
		reason, err = Inspect(theirs)
		require.NoError(t, err)
		assert.Contains(t, reason, "owned by uid 4242")
	}
}
