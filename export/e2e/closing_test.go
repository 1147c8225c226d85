package e2e_test

import (
	"errors"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/cudapool/cudapool/export"
	"github.com/cudapool/cudapool/export/consumer"
	"github.com/cudapool/cudapool/export/internal/exporttest"
	"github.com/cudapool/cudapool/internal/intercept"
	"github.com/cudapool/cudapool/internal/testwait"
)

// An Open in flight when Importer.Close begins (here, inside its import) fails with
// export.ErrClosed, and what it leased is given back; Close frees nothing under it.
func TestOpenInFlightDuringCloseFailsClosed(t *testing.T) {
	for _, batch := range []bool{false, true} {
		name := "Open"
		if batch {
			name = "OpenAll"
		}
		t.Run(name, func(t *testing.T) {
			pr := exporttest.NewProducer(t, nil, nil)
			pr.Publish(t, "a", 1<<20, 1)
			s := exporttest.NewSide(t, 0)
			// The first import is held until release is closed, saying on entered
			// that it is inside.
			entered, release := make(chan struct{}), make(chan struct{})
			rt := intercept.Wrap(s.Dev)
			rt.On.MemPoolImportPointer.Once(func() {
				close(entered)
				<-release
			})
			ctx := exporttest.Ctx(t)
			imp, err := consumer.Dial(ctx, pr.Path, rt, 0, consumer.WithLogger(exporttest.DiscardLogger))
			require.NoError(t, err)
			opened := make(chan error, 1)
			go func() {
				var err error
				if batch {
					_, err = imp.OpenAll(ctx, []string{"a"}, s.Stream)
				} else {
					_, err = imp.Open(ctx, "a", s.Stream)
				}
				opened <- err
			}()
			testwait.Recv(t, entered, "the Open to reach its import")
			closed := make(chan error, 1)
			go func() { closed <- imp.Close(ctx) }()
			exporttest.WaitFor(t, "Close to begin", func() bool {
				_, err := imp.Open(ctx, "nope", s.Stream) // unknown until Close begins, then refused at once
				return errors.Is(err, export.ErrClosed)
			})
			close(release)
			require.ErrorIs(t, testwait.Recv(t, opened, "the Open in flight to return"), export.ErrClosed, "the Open in flight")
			require.NoError(t, testwait.Recv(t, closed, "Close to return"))
			exporttest.WaitFor(t, "the lease to end", func() bool { return pr.ActiveLeases(t) == 0 })
			s.CheckClean(t)
			pr.CheckClean(t)
		})
	}
}
