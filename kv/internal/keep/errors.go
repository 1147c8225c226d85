package keep

import (
	"errors"

	"github.com/cudapool/cudapool/kv/internal/kvwire"
)

// The sentinels of the keeper protocol. Every error a [Client] returns for the keeper's
// answer wraps one of them, or [ErrGone] where the connection ended.
var (
	// ErrNotKept means the keeper keeps nothing under the name (Take, Drop).
	ErrNotKept = errors.New("keep: nothing is kept under the name")
	// ErrRefused means the keeper did not admit the connection: another user, another
	// protocol version, or a first frame that is not Hello.
	ErrRefused = errors.New("keep: refused")
	// ErrLimit means a cap of the keeper's is full: the names it keeps, or its
	// connections.
	ErrLimit = errors.New("keep: a limit is reached")
	// ErrName means a name breaks the rule: printable, 1 to [MaxName] bytes.
	ErrName = errors.New("keep: a bad name")
	// ErrInternal means the keeper failed for a reason of its own.
	ErrInternal = errors.New("keep: the keeper failed")
	// ErrGone means the connection to the keeper has ended: the keeper stopped or
	// died (what it kept is gone with it), or the [Client] was closed.
	ErrGone = errors.New("keep: the connection to the keeper has ended")
	// ErrNoTier means the owner has no host tier on the device asked for (the host
	// tier socket).
	ErrNoTier = errors.New("keep: the device has no host tier here")
	// ErrMalformed is kvwire's: a frame does not follow its layout, and the connection
	// it came on is closed.
	ErrMalformed = kvwire.ErrMalformed
)

// codes are the Error and Refused codes, by sentinel.
var codes = map[uint16]error{CodeInternal: ErrInternal, CodeNotKept: ErrNotKept, CodeRefused: ErrRefused, CodeLimit: ErrLimit, CodeName: ErrName,
	CodeNoTier: ErrNoTier}

// codeOf is the code for err, CodeInternal for an error of no sentinel.
func codeOf(err error) uint16 {
	for c, e := range codes {
		if errors.Is(err, e) {
			return c
		}
	}
	return CodeInternal
}
