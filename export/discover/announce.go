package discover

import (
	"encoding/json"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"syscall"
	"time"

	"github.com/cudapool/cudapool/internal/privdir"
	"github.com/cudapool/cudapool/internal/session"
)

// DirEnv names the environment variable that overrides [DefaultDir].
const DirEnv = "CUDAPOOL_DIR"

// DefaultDir is where exporters announce themselves and cmd/poolstat looks for them:
// $CUDAPOOL_DIR, else $XDG_RUNTIME_DIR/cudapool, else <os.TempDir()>/cudapool-<uid>.
// It does not create the directory.
func DefaultDir() string {
	if d := os.Getenv(DirEnv); d != "" {
		return d
	}
	if d := os.Getenv("XDG_RUNTIME_DIR"); d != "" {
		return filepath.Join(d, "cudapool")
	}
	return filepath.Join(os.TempDir(), "cudapool-"+strconv.Itoa(os.Getuid()))
}

// MaxAnnouncement bounds an announcement file, in bytes: a larger one is not read.
const MaxAnnouncement = 64 << 10

// Announcement is what an exporter writes to <dir>/<pid>.json while it listens, so
// that tools can find it. Its JSON form is a stable schema.
type Announcement struct {
	PID     int       `json:"pid"`
	Socket  string    `json:"socket"`
	Name    string    `json:"name"`
	Started time.Time `json:"started"`
	// Path is the announcement file, set by Discover, never written: what a tool
	// removes once the exporter is dead, or names when the file is unreadable.
	Path string `json:"-"`
	// Live is set by Discover, never written: the process exists and its socket
	// accepts connections.
	Live bool `json:"-"`
	// Dead says why Discover found the exporter not live, else "".
	Dead string `json:"-"`
}

// Discover lists the exporters announced in dir, ordered by pid, each with the Path of
// its file. Each is marked Live only if its process exists and its socket accepts a
// connection; any other, or one that could not be checked, is marked dead with the
// reason, never live. A file that is not a readable announcement is listed with PID 0
// and the reason in Dead. Only regular files are read, opened without following a
// link and without blocking: a link, FIFO or device named N.json is skipped. A missing
// dir lists nothing.
//
// dir must be private to this user, as Listen requires of the directory it announces
// in: a directory that another user owns, that group or others can write, or that is a
// symbolic link fails with [ErrBadDir], and nothing in it is read. (Under the temp
// directory, another user can make the default directory first; what it holds is then
// theirs to fill.)
func Discover(dir string) ([]Announcement, error) {
	reason, err := privdir.Inspect(dir)
	switch {
	case errors.Is(err, fs.ErrNotExist):
		return nil, nil
	case err != nil:
		return nil, fmt.Errorf("discover: discover: %w", err)
	case reason != "":
		return nil, fmt.Errorf("%w: %s", ErrBadDir, reason)
	}
	entries, err := os.ReadDir(dir)
	if err != nil {
		return nil, fmt.Errorf("discover: discover: %w", err)
	}
	var out []Announcement
	for _, e := range entries {
		name := e.Name()
		if !strings.HasSuffix(name, ".json") || strings.HasPrefix(name, ".") || !e.Type().IsRegular() {
			continue
		}
		if a, ok := readAnnouncement(filepath.Join(dir, name)); ok {
			out = append(out, a)
		}
	}
	slices.SortFunc(out, func(a, b Announcement) int { return a.PID - b.PID })
	return out, nil
}

// readAnnouncement reads the announcement at path. It reports false for what is not
// a regular file (a link, a FIFO, a device), which it opens without following or
// blocking and does not read.
func readAnnouncement(path string) (Announcement, bool) {
	var a Announcement
	body, regular, err := privdir.ReadRegular(path, MaxAnnouncement)
	if !regular {
		return a, false
	}
	if err == nil {
		err = json.Unmarshal(body, &a)
	}
	if err == nil && a.PID <= 0 {
		err = fmt.Errorf("pid %d", a.PID)
	}
	if err != nil {
		return Announcement{Socket: a.Socket, Path: path, Dead: fmt.Sprintf("unreadable announcement %s: %v", path, err)}, true
	}
	a.Path = path
	a.Dead = liveness(a)
	a.Live = a.Dead == ""
	return a, true
}

// liveness says why the announced exporter is not live, or "".
func liveness(a Announcement) string {
	if err := syscall.Kill(a.PID, 0); err != nil && !errors.Is(err, syscall.EPERM) {
		return fmt.Sprintf("process %d is gone", a.PID)
	}
	live, err := session.Answers(a.Socket)
	switch {
	case err != nil:
		return fmt.Sprintf("socket %s could not be checked: %v", a.Socket, err)
	case !live:
		return fmt.Sprintf("socket %s refuses connections", a.Socket)
	}
	return ""
}

// EnsureDir creates dir with mode 0700 if it is missing, and checks that it is
// private to this user (privdir.Check). On failure the error wraps [ErrBadDir], or says
// why dir could not be created.
func EnsureDir(dir string) error {
	reason, err := privdir.Check(dir)
	if err != nil {
		return fmt.Errorf("discover: %w", err)
	}
	if reason != "" {
		return fmt.Errorf("%w: %s", ErrBadDir, reason)
	}
	return nil
}

// Announce writes a's file, <dir>/<a.PID>.json, into dir atomically (a reader sees all
// of it or none) and returns its path: what producer.Listen does while it listens.
// Check dir with [EnsureDir] first. On failure no file is left behind.
func Announce(dir string, a Announcement) (string, error) {
	body, err := json.Marshal(a)
	if err != nil {
		return "", err
	}
	path := filepath.Join(dir, strconv.Itoa(a.PID)+".json")
	tmp, err := os.CreateTemp(dir, ".announce-*")
	if err != nil {
		return "", fmt.Errorf("discover: announce: %w", err)
	}
	_, err = tmp.Write(append(body, '\n'))
	err = errors.Join(err, tmp.Close())
	if err == nil {
		err = os.Rename(tmp.Name(), path)
	}
	if err != nil {
		_ = os.Remove(tmp.Name()) // best effort: a leftover file is harmless, and the first error is the one returned
		return "", fmt.Errorf("discover: announce: %w", err)
	}
	return path, nil
}
