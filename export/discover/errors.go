package discover

import (
	"errors"
)

// Errors of discovery.
var (
	// ErrBadDir means the announce directory is not private to this user.
	ErrBadDir = errors.New("discover: announce directory is not private")
)
