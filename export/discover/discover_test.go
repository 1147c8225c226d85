package discover_test

import (
	"os"
	"path/filepath"
	"strconv"
	"syscall"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/cudapool/cudapool/export/discover"
	"github.com/cudapool/cudapool/export/internal/exporttest"
	"github.com/cudapool/cudapool/export/producer"
	"github.com/cudapool/cudapool/internal/privdir"
	"github.com/cudapool/cudapool/internal/testwait"
)

// plantAnnouncement writes an announcement of this process into dir, as another
// user squatting the directory could.
func plantAnnouncement(t *testing.T, dir string) {
	t.Helper()
	_, err := discover.Announce(dir, discover.Announcement{PID: os.Getpid(), Socket: filepath.Join(dir, "planted.sock"), Name: "planted", Started: time.Now()})
	require.NoError(t, err)
}

// Discover reads only a directory private to this user, as Listen announces only in
// one: what another user can write there is theirs, not an exporter's.
func TestDiscoverRefusesDirectoriesOthersControl(t *testing.T) {
	base := t.TempDir()

	private := filepath.Join(base, "private")
	require.NoError(t, discover.EnsureDir(private))
	plantAnnouncement(t, private)
	anns, err := discover.Discover(private)
	require.NoError(t, err)
	require.Len(t, anns, 1, "the announcement in a private directory")

	open := filepath.Join(base, "open")
	require.NoError(t, discover.EnsureDir(open))
	plantAnnouncement(t, open)
	require.NoError(t, os.Chmod(open, 0o777))
	anns, err = discover.Discover(open)
	require.ErrorIs(t, err, discover.ErrBadDir, "Discover in a world-writable directory")
	assert.ErrorContains(t, err, "group or others can write")
	assert.Empty(t, anns)

	link := filepath.Join(base, "link")
	require.NoError(t, os.Symlink(private, link))
	_, err = discover.Discover(link)
	require.ErrorIs(t, err, discover.ErrBadDir, "Discover through a symbolic link")

	anns, err = discover.Discover(filepath.Join(base, "missing"))
	require.NoError(t, err, "a missing directory: no exporter has run")
	assert.Empty(t, anns)
	assert.NoDirExists(t, filepath.Join(base, "missing"), "Discover created the directory")
}

// A directory another user made first, where this user's would be, is refused: the
// squatted default directory under the temp dir.
func TestDiscoverRefusesAnotherUsersDirectory(t *testing.T) {
	if os.Getuid() != 0 {
		t.Skip("giving a directory to another user needs root")
	}
	squatted := filepath.Join(t.TempDir(), "cudapool-"+strconv.Itoa(os.Getuid()))
	require.NoError(t, discover.EnsureDir(squatted))
	plantAnnouncement(t, squatted)
	require.NoError(t, os.Chown(squatted, 4242, 4242))
	_, err := discover.Discover(squatted)
	require.ErrorIs(t, err, discover.ErrBadDir)
	assert.ErrorContains(t, err, "owned by uid 4242")
	// The exporter, too, refuses to announce there.
	require.ErrorIs(t, discover.EnsureDir(squatted), discover.ErrBadDir)
}

// Listen announces only in a private directory: one others can write to is refused
// before any socket is made.
func TestListenRefusesAnAnnounceDirectoryOthersControl(t *testing.T) {
	dir := exporttest.ShortDir(t)
	open := filepath.Join(dir, "open")
	require.NoError(t, os.Mkdir(open, 0o700))
	require.NoError(t, os.Chmod(open, 0o777))
	sock := filepath.Join(dir, "x.sock")
	rt := exporttest.NewSide(t, 0).Dev
	_, err := producer.Listen(sock, rt, producer.WithAnnounceDir(open))
	require.ErrorIs(t, err, discover.ErrBadDir)
	assert.NoFileExists(t, sock, "Listen left a socket behind")
	entries, err := os.ReadDir(open)
	require.NoError(t, err)
	assert.Empty(t, entries, "Listen wrote into a directory it does not trust")
}

// Discover reads only regular files, without following links and without blocking: a
// FIFO named N.json (whose open would wait for a writer) and a symbolic link named
// N.json are skipped, and a file too large to be an announcement is listed as
// unreadable. Discover returns at once either way.
func TestDiscoverReadsOnlyRegularFiles(t *testing.T) {
	dir := filepath.Join(t.TempDir(), "ann")
	require.NoError(t, discover.EnsureDir(dir))
	plantAnnouncement(t, dir)
	require.NoError(t, syscall.Mkfifo(filepath.Join(dir, "123.json"), 0o600))
	elsewhere := t.TempDir()
	plantAnnouncement(t, elsewhere)
	require.NoError(t, os.Symlink(filepath.Join(elsewhere, strconv.Itoa(os.Getpid())+".json"), filepath.Join(dir, "124.json")))
	big := filepath.Join(dir, "125.json")
	require.NoError(t, os.WriteFile(big, make([]byte, discover.MaxAnnouncement+1), 0o600))

	type result struct {
		anns []discover.Announcement
		err  error
	}
	got := make(chan result, 1)
	go func() {
		anns, err := discover.Discover(dir)
		got <- result{anns, err}
	}()
	r := testwait.Recv(t, got, "Discover to return past a FIFO")
	require.NoError(t, r.err)
	var paths []string
	for _, a := range r.anns {
		paths = append(paths, filepath.Base(a.Path))
	}
	assert.ElementsMatch(t, []string{strconv.Itoa(os.Getpid()) + ".json", "125.json"}, paths, "what Discover listed")
	for _, a := range r.anns {
		if a.Path == big {
			assert.Contains(t, a.Dead, "unreadable announcement", "the oversized file")
		}
	}
	// A file replaced by a FIFO or a link after the directory was listed: the open
	// itself neither blocks nor follows.
	for _, name := range []string{"123.json", "124.json"} {
		done := make(chan bool, 1)
		go func() {
			_, regular, err := privdir.ReadRegular(filepath.Join(dir, name), discover.MaxAnnouncement)
			assert.NoError(t, err, name)
			done <- regular
		}()
		assert.False(t, testwait.Recv(t, done, "readRegular of "+name), "%s read as a regular file", name)
	}
}
