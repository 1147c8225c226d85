package discover

import (
	"errors"

	"github.com/cudapool/cudapool/export/internal/wire"
)

// Errors of discovery.
var (
	// ErrBadDir means the announce directory is not private to this user.
	ErrBadDir = errors.New("discover: announce directory is not private")
)

// The protocol's errors QueryState meets, the same values as package consumer's.
var (
	// ErrRefused means the exporter did not admit this process; the message carries
	// the exporter's reason.
	ErrRefused = wire.ErrRefused
	// ErrVersionMismatch means the two sides speak different protocol versions; the
	// message names both.
	ErrVersionMismatch = wire.ErrVersionMismatch
	// ErrProtocol means a peer sent something the protocol does not allow: a malformed,
	// oversized or unexpected frame, or an unexpected file descriptor. The connection
	// it came on is closed.
	ErrProtocol = wire.ErrProtocol
)
