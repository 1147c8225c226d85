package producer

import (
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strconv"

	"github.com/cudapool/cudapool/export/discover"
	"github.com/cudapool/cudapool/internal/privdir"
)

// ensureDir creates dir with mode 0700 if it is missing, and checks that it is
// private to this user (privdir.Check). On failure the error wraps ErrBadDir, or says
// why dir could not be created.
func ensureDir(dir string) error {
	reason, err := privdir.Check(dir)
	if err != nil {
		return fmt.Errorf("producer: %w", err)
	}
	if reason != "" {
		return fmt.Errorf("%w: %s", discover.ErrBadDir, reason)
	}
	return nil
}

// announce writes a's file into dir atomically (a reader sees all of it or none) and
// returns its path.
func announce(dir string, a discover.Announcement) (string, error) {
	body, err := json.Marshal(a)
	if err != nil {
		return "", err
	}
	path := filepath.Join(dir, strconv.Itoa(a.PID)+".json")
	tmp, err := os.CreateTemp(dir, ".announce-*")
	if err != nil {
		return "", fmt.Errorf("producer: announce: %w", err)
	}
	_, err = tmp.Write(append(body, '\n'))
	err = errors.Join(err, tmp.Close())
	if err == nil {
		err = os.Rename(tmp.Name(), path)
	}
	if err != nil {
		_ = os.Remove(tmp.Name()) // best effort: a leftover file is harmless, and the first error is the one returned
		return "", fmt.Errorf("producer: announce: %w", err)
	}
	return path, nil
}
