package producer

import (
	"context"
	"fmt"
	"path/filepath"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/cudapool/cudapool/cudart"
	"github.com/cudapool/cudapool/export/consumer"
	"github.com/cudapool/cudapool/export/internal/wire"
)

func TestUnknownNameListsPublishedNames(t *testing.T) {
	pr := newProducer(t, nil, nil)
	c := newConsumer(t, pr.path, 0)
	_, err := c.imp.Open(testCtx(t), "kv", c.stream)
	require.ErrorIs(t, err, ErrUnknownName)
	assert.ErrorContains(t, err, `"kv" (nothing is published)`)

	for i := range 7 {
		pr.publish(t, fmt.Sprintf("layer-%d", i), 1<<20, byte(i))
	}
	_, err = c.imp.Open(testCtx(t), "layer-9", c.stream)
	require.ErrorIs(t, err, ErrUnknownName)
	assert.ErrorContains(t, err, `"layer-9" (published: "layer-0", "layer-1", "layer-2", "layer-3", "layer-4" and 2 more)`)
	assert.ErrorContains(t, pr.ex.Unpublish("layer-9"), `published: "layer-0"`)
	assert.ErrorContains(t, pr.ex.Push(testCtx(t), "layer-9", 1), `published: "layer-0"`)
	pr.checkClean(t)
}

func TestOpenWaitsForName(t *testing.T) {
	pr := newProducer(t, nil, nil)
	c := newConsumer(t, pr.path, 0)
	opened := make(chan error, 1)
	go func() {
		m, err := c.imp.Open(testCtx(t), "late", c.stream, consumer.WaitForName())
		if err == nil {
			err = m.Release(context.Background(), c.stream)
		}
		opened <- err
	}()
	// Publishing after a pause lets Open ask and be refused first, as a replica that
	// started early would be; the test holds in either order.
	time.Sleep(20 * time.Millisecond)
	pr.publish(t, "late", 1<<20, 5)
	select {
	case err := <-opened:
		require.NoError(t, err)
	case <-time.After(hangGuard):
		t.Fatal("Open with WaitForName did not return after the name was published")
	}

	// The error wraps ErrUnknownName whether or not the exporter answered before the
	// deadline (on a loaded machine the first try may come after it), and even when
	// ctx had ended before Open was called.
	ctx, cancel := context.WithTimeout(testCtx(t), 200*time.Millisecond)
	defer cancel()
	_, err := c.imp.Open(ctx, "never", c.stream, consumer.WaitForName())
	require.ErrorIs(t, err, context.DeadlineExceeded)
	require.ErrorIs(t, err, ErrUnknownName)
	_, err = c.imp.Open(ended(), "never", c.stream, consumer.WaitForName())
	require.ErrorIs(t, err, context.Canceled)
	require.ErrorIs(t, err, ErrUnknownName)

	// Other errors end the wait at once.
	b := pr.publish(t, "freed", 1<<20, 6)
	require.NoError(t, b.Free(pr.stream))
	_, err = c.imp.Open(testCtx(t), "freed", c.stream, consumer.WaitForName())
	require.ErrorIs(t, err, ErrBufferGone)
	pr.checkClean(t)
}

func TestDialWaitsForExporter(t *testing.T) {
	path := filepath.Join(shortDir(t), "x.sock")
	s := newSide(t, 0)

	_, err := consumer.Dial(testCtx(t), path, s.dev, 0)
	require.ErrorIs(t, err, wire.ErrExporterGone, "without WaitForExporter Dial does not wait")

	ctx, cancel := context.WithTimeout(testCtx(t), 200*time.Millisecond)
	defer cancel()
	_, err = consumer.Dial(ctx, path, s.dev, 0, consumer.WaitForExporter())
	require.ErrorIs(t, err, context.DeadlineExceeded)
	require.ErrorIs(t, err, wire.ErrExporterGone)
	// The same when ctx ends before the first try (as a loaded machine can make it).
	_, err = consumer.Dial(ended(), path, s.dev, 0, consumer.WaitForExporter())
	require.ErrorIs(t, err, context.Canceled)
	require.ErrorIs(t, err, wire.ErrExporterGone)

	dialed := make(chan error, 1)
	go func() {
		imp, err := consumer.Dial(testCtx(t), path, s.dev, 0, consumer.WaitForExporter(), consumer.WithLogger(discardLogger))
		if err == nil {
			err = imp.Close(context.Background())
		}
		dialed <- err
	}()
	time.Sleep(20 * time.Millisecond) // as in TestOpenWaitsForName; either order holds
	exporting := newSide(t, 0)        // a process of its own: this one's would be refused
	ex, err := Listen(path, exporting.dev, WithoutAnnounce(), WithLogger(discardLogger))
	require.NoError(t, err)
	select {
	case err := <-dialed:
		require.NoError(t, err)
	case <-time.After(hangGuard):
		t.Fatal("Dial with WaitForExporter did not return after the exporter listened")
	}
	require.NoError(t, ex.Close(testCtx(t)))

	// A refusal ends the wait at once.
	other := newSide(t, 0)
	ex, err = Listen(path, other.dev, WithoutAnnounce(), WithLogger(discardLogger), WithPolicy(Policy{AllowUIDs: []uint32{1 << 30}}))
	require.NoError(t, err)
	_, err = consumer.Dial(testCtx(t), path, s.dev, 0, consumer.WaitForExporter())
	require.ErrorIs(t, err, ErrRefused)
	require.NoError(t, ex.Close(testCtx(t)))
	s.checkClean(t)
}

func TestOpenRefusesStreamOfAnotherDevice(t *testing.T) {
	pr := newProducer(t, nil, nil)
	pr.publish(t, "a", 1<<20, 1)
	c := newConsumer(t, pr.path, 0)
	other, err := c.dev.StreamCreate(1, cudart.StreamNonBlocking)
	require.NoError(t, err)
	_, err = c.imp.Open(testCtx(t), "a", other, consumer.WaitForName())
	require.ErrorIs(t, err, consumer.ErrStreamDevice)
	assert.ErrorContains(t, err, "is on device 1, the Importer on device 0")
	assert.Zero(t, pr.activeLeases(t), "a refused Open took a lease")

	_, err = consumer.Dial(testCtx(t), pr.path, c.dev, 0, consumer.WithPushes(other, func(string, *consumer.Mapping) {}))
	require.ErrorIs(t, err, consumer.ErrStreamDevice)
	require.NoError(t, c.dev.StreamDestroy(1, other))
	c.checkClean(t)
	pr.checkClean(t)
}

// Release and ReleaseAll refuse a stream of another device than the Importer's with
// ErrStreamDevice, as Open does, and release nothing: the Mapping can be released
// after with a right stream.
func TestReleaseRefusesStreamOfAnotherDevice(t *testing.T) {
	pr := newProducer(t, nil, nil)
	pr.publish(t, "a", 1<<20, 1)
	c := newConsumer(t, pr.path, 0)
	other, err := c.dev.StreamCreate(1, cudart.StreamNonBlocking)
	require.NoError(t, err)
	ctx := testCtx(t)
	m, err := c.imp.Open(ctx, "a", c.stream)
	require.NoError(t, err)
	err = m.Release(ctx, other)
	require.ErrorIs(t, err, consumer.ErrStreamDevice, "Release")
	assert.ErrorContains(t, err, "is on device 1, the Importer on device 0")
	err = c.imp.ReleaseAll(ctx, []*consumer.Mapping{m}, other)
	require.ErrorIs(t, err, consumer.ErrStreamDevice, "ReleaseAll")
	assert.Equal(t, 1, pr.activeLeases(t), "a refused Release ended the lease")
	require.NoError(t, m.Release(ctx, c.stream), "Release after the refusals")
	assert.Zero(t, pr.activeLeases(t))
	require.NoError(t, c.dev.StreamDestroy(1, other))
	c.checkClean(t)
	pr.checkClean(t)
}

// Dialing an exporter of this very process on the same runtime is refused at once,
// saying so: its pools and events cannot be imported by the process that made them,
// and its buffers need no import. A consumer on another runtime (a simulated process
// of its own) is served as before.
func TestDialOfOwnExporterIsRefused(t *testing.T) {
	pr := newProducer(t, nil, nil)
	pr.publish(t, "a", 1<<20, 1)
	_, err := consumer.Dial(testCtx(t), pr.path, pr.dev, 0, consumer.WithLogger(discardLogger))
	require.ErrorIs(t, err, consumer.ErrOwnExporter)
	assert.ErrorContains(t, err, "pointers directly")
	c := newConsumer(t, pr.path, 0)
	m, err := c.imp.Open(testCtx(t), "a", c.stream)
	require.NoError(t, err, "an Open from another runtime")
	require.NoError(t, m.Release(testCtx(t), c.stream))
	require.NoError(t, pr.ex.Close(testCtx(t)))
	_, err = consumer.Dial(testCtx(t), pr.path, pr.dev, 0)
	require.NotErrorIs(t, err, consumer.ErrOwnExporter, "a closed exporter is no longer this process's")
}
