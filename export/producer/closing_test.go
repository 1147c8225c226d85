package producer

import (
	"errors"
	"sync"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/cudapool/cudapool/cudart"
	"github.com/cudapool/cudapool/export/consumer"
	"github.com/cudapool/cudapool/internal/testwait"
)

// stalledImports holds the first MemPoolImportPointer until release is closed, saying
// on entered that it is inside.
type stalledImports struct {
	cudart.Runtime
	once             sync.Once
	entered, release chan struct{}
}

func (r *stalledImports) MemPoolImportPointer(dev int, p cudart.MemPool, d cudart.PtrExportData) (cudart.DevicePtr, error) {
	r.once.Do(func() {
		close(r.entered)
		<-r.release
	})
	return r.Runtime.MemPoolImportPointer(dev, p, d)
}

// An Open in flight when Importer.Close begins (here, inside its import) fails with
// ErrClosed, and what it leased is given back; Close frees nothing under it.
func TestOpenInFlightDuringCloseFailsClosed(t *testing.T) {
	for _, batch := range []bool{false, true} {
		name := "Open"
		if batch {
			name = "OpenAll"
		}
		t.Run(name, func(t *testing.T) {
			pr := newProducer(t, nil, nil)
			pr.publish(t, "a", 1<<20, 1)
			s := newSide(t, 0)
			rt := &stalledImports{Runtime: s.dev, entered: make(chan struct{}), release: make(chan struct{})}
			ctx := testCtx(t)
			imp, err := consumer.Dial(ctx, pr.path, rt, 0, consumer.WithLogger(discardLogger))
			require.NoError(t, err)
			opened := make(chan error, 1)
			go func() {
				var err error
				if batch {
					_, err = imp.OpenAll(ctx, []string{"a"}, s.stream)
				} else {
					_, err = imp.Open(ctx, "a", s.stream)
				}
				opened <- err
			}()
			testwait.Recv(t, rt.entered, "the Open to reach its import")
			closed := make(chan error, 1)
			go func() { closed <- imp.Close(ctx) }()
			waitFor(t, "Close to begin", func() bool {
				_, err := imp.Open(ctx, "nope", s.stream) // unknown until Close begins, then refused at once
				return errors.Is(err, consumer.ErrClosed)
			})
			close(rt.release)
			require.ErrorIs(t, testwait.Recv(t, opened, "the Open in flight to return"), consumer.ErrClosed, "the Open in flight")
			require.NoError(t, testwait.Recv(t, closed, "Close to return"))
			waitFor(t, "the lease to end", func() bool { return pr.activeLeases(t) == 0 })
			s.checkClean(t)
			pr.checkClean(t)
		})
	}
}
