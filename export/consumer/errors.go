package consumer

import (
	"errors"
	"fmt"

	"github.com/cudapool/cudapool/export"
)

// Errors of the consumer side; those it shares with the producer side are package
// export's ([export.ErrExporterGone], [export.ErrStaleLease], ...). Every error this package returns about one of these
// conditions wraps the sentinel, so callers match with [errors.Is]; the message around it
// says which name or lease. An exporter's refusal of a request is an *export.RemoteError that
// wraps the sentinel it stands for.
var (
	// ErrMappingLost means a [Mapping] on another GPU than its exporter's must not be
	// used any more: the exporter is gone, and a read of its memory from another GPU
	// would lose this process's CUDA context ([cudart.ErrContextLost], FACTS 14). Release
	// it; [WithLocalCopy] avoids it. It wraps [export.ErrExporterGone].
	ErrMappingLost = fmt.Errorf("%w: this mapping lives on another GPU than its exporter's, and reading it now would lose this process's CUDA context; release it", export.ErrExporterGone)
	// ErrDuplicateImporter means this process already has an [Importer] connected to
	// the same exporter on the same runtime: two would import the same pointers and
	// free each other's mappings (FACTS 4). Share the first one.
	ErrDuplicateImporter = errors.New("consumer: this process already has an Importer for that exporter")
	// ErrStreamDevice means a stream given to Open (or [WithPushes]) belongs to another
	// device than the [Importer]'s: the import's free could not be ordered after it.
	ErrStreamDevice = errors.New("consumer: stream is on another device than the Importer's")
	// ErrOwnExporter means [Dial] was asked for an exporter of this very process on the
	// same runtime: its buffers are already this process's, and CUDA imports none of
	// its own pools or events. Use the buffer (its Ptr) directly.
	ErrOwnExporter = errors.New("consumer: the exporter is this process's own: use its buffers' pointers directly, they need no import")
	// ErrReleased means a [Mapping] was released more times than it was opened, or
	// after its [Importer] closed.
	ErrReleased = errors.New("consumer: mapping already released")
)
