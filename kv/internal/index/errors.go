package index

import "errors"

// Errors of the index. Every error about one of these conditions wraps the sentinel,
// with a message that names the file.
var (
	// ErrNoIndex means there is no index file at the path: a first start.
	ErrNoIndex = errors.New("kv/internal/index: no index")
	// ErrNotRegular means something other than a regular file is at the path (a
	// named pipe, a device, a socket, a directory or a symbolic link): it is refused,
	// never opened for reading or writing, and left alone.
	ErrNotRegular = errors.New("kv/internal/index: not a regular file")
	// ErrCorrupt means the file is not an index, or one whose records do not check: a
	// checksum, a length, a record past the bound of its shape, or a record that
	// makes no sense (a page out of range, two pages under one hash).
	ErrCorrupt = errors.New("kv/internal/index: corrupt")
	// ErrOtherShape means the index was written for another geometry or other
	// devices.
	ErrOtherShape = errors.New("kv/internal/index: written for another geometry")
	// ErrFailed means the index could not be written: it stopped, and its file was
	// removed (or emptied), so no start reads any record of it again.
	ErrFailed = errors.New("kv/internal/index: failed")
	// ErrStale comes with ErrFailed where the failed index's file could be neither
	// removed nor emptied: a start may read records of it that no longer hold.
	ErrStale = errors.New("kv/internal/index: a failed index's file is left behind")
	// ErrClosed means the index was closed before the record was written.
	ErrClosed = errors.New("kv/internal/index: closed")
)
