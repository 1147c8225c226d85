package e2e_test

import (
	"context"
	"fmt"
	"path/filepath"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/cudapool/cudapool/cudart"
	"github.com/cudapool/cudapool/export"
	"github.com/cudapool/cudapool/export/consumer"
	"github.com/cudapool/cudapool/export/internal/exporttest"
	"github.com/cudapool/cudapool/export/producer"
)

func TestUnknownNameListsPublishedNames(t *testing.T) {
	pr := exporttest.NewProducer(t, nil, nil)
	c := exporttest.NewConsumer(t, pr.Path, 0)
	_, err := c.Imp.Open(exporttest.Ctx(t), "kv", c.Stream)
	require.ErrorIs(t, err, export.ErrUnknownName)
	assert.ErrorContains(t, err, `"kv" (nothing is published)`)

	for i := range 7 {
		pr.Publish(t, fmt.Sprintf("layer-%d", i), 1<<20, byte(i))
	}
	_, err = c.Imp.Open(exporttest.Ctx(t), "layer-9", c.Stream)
	require.ErrorIs(t, err, export.ErrUnknownName)
	assert.ErrorContains(t, err, `"layer-9" (published: "layer-0", "layer-1", "layer-2", "layer-3", "layer-4" and 2 more)`)
	assert.ErrorContains(t, pr.Ex.Unpublish("layer-9"), `published: "layer-0"`)
	assert.ErrorContains(t, pr.Ex.Push(exporttest.Ctx(t), "layer-9", 1), `published: "layer-0"`)
	pr.CheckClean(t)
}

func TestOpenWaitsForName(t *testing.T) {
	pr := exporttest.NewProducer(t, nil, nil)
	c := exporttest.NewConsumer(t, pr.Path, 0)
	opened := make(chan error, 1)
	go func() {
		m, err := c.Imp.Open(exporttest.Ctx(t), "late", c.Stream, consumer.WaitForName())
		if err == nil {
			err = m.Release(context.Background(), c.Stream)
		}
		opened <- err
	}()
	// Publishing after a pause lets Open ask and be refused first, as a replica that
	// started early would be; the test holds in either order.
	time.Sleep(20 * time.Millisecond)
	pr.Publish(t, "late", 1<<20, 5)
	select {
	case err := <-opened:
		require.NoError(t, err)
	case <-time.After(exporttest.HangGuard):
		t.Fatal("Open with WaitForName did not return after the name was published")
	}

	// The error wraps export.ErrUnknownName whether or not the exporter answered before the
	// deadline (on a loaded machine the first try may come after it), and even when
	// ctx had ended before Open was called.
	ctx, cancel := context.WithTimeout(exporttest.Ctx(t), 200*time.Millisecond)
	defer cancel()
	_, err := c.Imp.Open(ctx, "never", c.Stream, consumer.WaitForName())
	require.ErrorIs(t, err, context.DeadlineExceeded)
	require.ErrorIs(t, err, export.ErrUnknownName)
	_, err = c.Imp.Open(exporttest.Ended(), "never", c.Stream, consumer.WaitForName())
	require.ErrorIs(t, err, context.Canceled)
	require.ErrorIs(t, err, export.ErrUnknownName)

	// Other errors end the wait at once.
	b := pr.Publish(t, "freed", 1<<20, 6)
	require.NoError(t, b.Free(pr.Stream))
	_, err = c.Imp.Open(exporttest.Ctx(t), "freed", c.Stream, consumer.WaitForName())
	require.ErrorIs(t, err, export.ErrBufferGone)
	pr.CheckClean(t)
}

func TestDialWaitsForExporter(t *testing.T) {
	path := filepath.Join(exporttest.ShortDir(t), "x.sock")
	s := exporttest.NewSide(t, 0)

	_, err := consumer.Dial(exporttest.Ctx(t), path, s.Dev, 0)
	require.ErrorIs(t, err, export.ErrExporterGone, "without WaitForExporter Dial does not wait")

	ctx, cancel := context.WithTimeout(exporttest.Ctx(t), 200*time.Millisecond)
	defer cancel()
	_, err = consumer.Dial(ctx, path, s.Dev, 0, consumer.WaitForExporter())
	require.ErrorIs(t, err, context.DeadlineExceeded)
	require.ErrorIs(t, err, export.ErrExporterGone)
	// The same when ctx ends before the first try (as a loaded machine can make it).
	_, err = consumer.Dial(exporttest.Ended(), path, s.Dev, 0, consumer.WaitForExporter())
	require.ErrorIs(t, err, context.Canceled)
	require.ErrorIs(t, err, export.ErrExporterGone)

	dialed := make(chan error, 1)
	go func() {
		imp, err := consumer.Dial(exporttest.Ctx(t), path, s.Dev, 0, consumer.WaitForExporter(), consumer.WithLogger(exporttest.DiscardLogger))
		if err == nil {
			err = imp.Close(context.Background())
		}
		dialed <- err
	}()
	time.Sleep(20 * time.Millisecond)     // as in TestOpenWaitsForName; either order holds
	exporting := exporttest.NewSide(t, 0) // a process of its own: this one's would be refused
	ex, err := producer.Listen(path, exporting.Dev, producer.WithoutAnnounce(), producer.WithLogger(exporttest.DiscardLogger))
	require.NoError(t, err)
	select {
	case err := <-dialed:
		require.NoError(t, err)
	case <-time.After(exporttest.HangGuard):
		t.Fatal("Dial with WaitForExporter did not return after the exporter listened")
	}
	require.NoError(t, ex.Close(exporttest.Ctx(t)))

	// A refusal ends the wait at once.
	other := exporttest.NewSide(t, 0)
	ex, err = producer.Listen(path, other.Dev, producer.WithoutAnnounce(), producer.WithLogger(exporttest.DiscardLogger), producer.WithPolicy(export.Policy{AllowUIDs: []uint32{1 << 30}}))
	require.NoError(t, err)
	_, err = consumer.Dial(exporttest.Ctx(t), path, s.Dev, 0, consumer.WaitForExporter())
	require.ErrorIs(t, err, export.ErrRefused)
	require.NoError(t, ex.Close(exporttest.Ctx(t)))
	s.CheckClean(t)
}

func TestOpenRefusesStreamOfAnotherDevice(t *testing.T) {
	pr := exporttest.NewProducer(t, nil, nil)
	pr.Publish(t, "a", 1<<20, 1)
	c := exporttest.NewConsumer(t, pr.Path, 0)
	other, err := c.Dev.StreamCreate(1, cudart.StreamNonBlocking)
	require.NoError(t, err)
	_, err = c.Imp.Open(exporttest.Ctx(t), "a", other, consumer.WaitForName())
	require.ErrorIs(t, err, consumer.ErrStreamDevice)
	assert.ErrorContains(t, err, "is on device 1, the Importer on device 0")
	assert.Zero(t, pr.ActiveLeases(t), "a refused Open took a lease")

	_, err = consumer.Dial(exporttest.Ctx(t), pr.Path, c.Dev, 0, consumer.WithPushes(func(string, *consumer.Mapping) {}, other))
	require.ErrorIs(t, err, consumer.ErrStreamDevice)
	require.NoError(t, c.Dev.StreamDestroy(1, other))
	c.CheckClean(t)
	pr.CheckClean(t)
}

// Release and ReleaseAll refuse a stream of another device than the Importer's with
// ErrStreamDevice, as Open does, and release nothing: the Mapping can be released
// after with a right stream.
func TestReleaseRefusesStreamOfAnotherDevice(t *testing.T) {
	pr := exporttest.NewProducer(t, nil, nil)
	pr.Publish(t, "a", 1<<20, 1)
	c := exporttest.NewConsumer(t, pr.Path, 0)
	other, err := c.Dev.StreamCreate(1, cudart.StreamNonBlocking)
	require.NoError(t, err)
	ctx := exporttest.Ctx(t)
	m, err := c.Imp.Open(ctx, "a", c.Stream)
	require.NoError(t, err)
	err = m.Release(ctx, other)
	require.ErrorIs(t, err, consumer.ErrStreamDevice, "Release")
	assert.ErrorContains(t, err, "is on device 1, the Importer on device 0")
	err = c.Imp.ReleaseAll(ctx, []*consumer.Mapping{m}, other)
	require.ErrorIs(t, err, consumer.ErrStreamDevice, "ReleaseAll")
	assert.Equal(t, 1, pr.ActiveLeases(t), "a refused Release ended the lease")
	require.NoError(t, m.Release(ctx, c.Stream), "Release after the refusals")
	assert.Zero(t, pr.ActiveLeases(t))
	require.NoError(t, c.Dev.StreamDestroy(1, other))
	c.CheckClean(t)
	pr.CheckClean(t)
}

// Dialing an exporter of this very process on the same runtime is refused at once,
// saying so: its pools and events cannot be imported by the process that made them,
// and its buffers need no import. A consumer on another runtime (a simulated process
// of its own) is served as before.
func TestDialOfOwnExporterIsRefused(t *testing.T) {
	pr := exporttest.NewProducer(t, nil, nil)
	pr.Publish(t, "a", 1<<20, 1)
	_, err := consumer.Dial(exporttest.Ctx(t), pr.Path, pr.Dev, 0, consumer.WithLogger(exporttest.DiscardLogger))
	require.ErrorIs(t, err, consumer.ErrOwnExporter)
	assert.ErrorContains(t, err, "pointers directly")
	c := exporttest.NewConsumer(t, pr.Path, 0)
	m, err := c.Imp.Open(exporttest.Ctx(t), "a", c.Stream)
	require.NoError(t, err, "an Open from another runtime")
	require.NoError(t, m.Release(exporttest.Ctx(t), c.Stream))
	require.NoError(t, pr.Ex.Close(exporttest.Ctx(t)))
	_, err = consumer.Dial(exporttest.Ctx(t), pr.Path, pr.Dev, 0)
	require.NotErrorIs(t, err, consumer.ErrOwnExporter, "a closed exporter is no longer this process's")
}
