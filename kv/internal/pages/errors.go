package pages

import "errors"

// The errors a [Table] returns. Each is returned wrapped, with what was asked; the
// table is unchanged by an operation that returns one.
var (
	// ErrWait means the reattach window is open: Alloc, Match (and so a restore) wait
	// until [Table.CloseWindow], or until every holder expected back has declared its
	// leases ([Table.Declared]) or is dead ([Table.HolderDead]).
	ErrWait = errors.New("pages: the reattach window is open")
	// ErrNoSpace means not enough pages are free or evictable, and pages that settle
	// would not make up the difference: the table may grow ([Table.Grow]).
	ErrNoSpace = errors.New("pages: not enough free pages")
	// ErrSettling means the pages asked for are not free or evictable now, but will be
	// once pages that settle have settled: ask again after a SealDone or ReleaseDone.
	ErrSettling = errors.New("pages: pages settle")
	// ErrInUse means a shrink is not over: a page it gives back is still leased or
	// read by a copy ([Table.Shrunk]); ask again once leases end and copies complete.
	ErrInUse = errors.New("pages: pages given back are in use")
	// ErrStale means the lease named is not the holder's (ended, never granted, or
	// another holder's), or is not in a state that allows the operation.
	ErrStale = errors.New("pages: stale lease")
	// ErrInput means an argument does not fit the table: a page count out of range,
	// more hashes than pages, a hash listed twice.
	ErrInput = errors.New("pages: bad input")
	// ErrLost means a Reattach names no lease the table holds for that holder from
	// before the restart, or not with those pages and hashes.
	ErrLost = errors.New("pages: lease lost")
	// ErrJournal means the records a restart is given do not describe one state: a
	// page out of range, a read lease of a page not sealed under its hash, a page in
	// two leases.
	ErrJournal = errors.New("pages: the journal is inconsistent")
)
