package granularity

import "errors"

// ErrZeroGranularity means a granularity of 0 was given or reported: nothing can be
// rounded to it, and a driver that reports it is broken.
var ErrZeroGranularity = errors.New("granularity: granularity is 0")

// ErrOverflow means rounding up would pass 2^64-1.
var ErrOverflow = errors.New("granularity: rounded size overflows 64 bits")
