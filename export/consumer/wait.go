package consumer

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/cudapool/cudapool/cudart"
	"github.com/cudapool/cudapool/export"
	"github.com/cudapool/cudapool/internal/session"
)

// Backoff between opens of a name not yet published: doubling from the first delay up
// to the last. (Dials back off as session.Dial does.)
const (
	openRetryFirst = 1 * time.Millisecond
	openRetryMost  = 100 * time.Millisecond
)

// openWaiting is open that tries again while the name is not published.
func (imp *Importer) openWaiting(ctx context.Context, name string, s cudart.Stream) (*Mapping, error) {
	var m *Mapping
	notYet := fmt.Errorf("%w: %q: the exporter has not answered", export.ErrUnknownName, name)
	last, ctxErr := session.Retry(ctx, openRetryFirst, openRetryMost, notYet, func() (bool, error) {
		var err error
		m, err = imp.open(ctx, name, s)
		// A freed buffer's name is unknown too, but its producer freed it: no wait.
		return errors.Is(err, export.ErrUnknownName) && !errors.Is(err, export.ErrBufferGone), err
	})
	if ctxErr != nil {
		return nil, fmt.Errorf("%w (waited for it to be published until %w)", last, ctxErr)
	}
	return m, last
}
