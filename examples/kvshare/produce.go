package main

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"time"

	"github.com/cudapool/cudapool/cudart"
	"github.com/cudapool/cudapool/export/producer"
	"github.com/cudapool/cudapool/pool"
)

// ProducerConfig says what a producer builds and where it publishes it.
type ProducerConfig struct {
	Socket string // the exporter's Unix socket
	Name   string // the name consumers open
	Device int
	Shape  Shape
	Seed   uint64 // selects the pattern; consumers must use the same
	// Notify, if set, is told in a sentence what the producer waits for while it stops.
	Notify func(string)
}

// Published describes a cache a producer has published; it is the producer's -json line.
type Published struct {
	PID      int    `json:"pid"`
	Socket   string `json:"socket"`
	Name     string `json:"name"`
	Device   int    `json:"device"`
	Size     uint64 `json:"size"`
	Shape    string `json:"shape"`
	Checksum string `json:"checksum"`
}

// hostChunk bounds the host memory the producer and consumer stage through: big enough
// that per-copy overheads vanish, small enough to be nothing next to the cache. A whole
// number of pattern words.
const hostChunk = 16 << 20

// shutdownTimeout bounds the clean-up after the caller's context has ended (Ctrl-C): it
// only guards against a hang, clean-up itself takes milliseconds.
const shutdownTimeout = 30 * time.Second

// Produce builds the cache on cfg.Device, fills it with the pattern, publishes it under
// cfg.Name on cfg.Socket, calls ready, and serves consumers until ctx ends. Then it shuts
// down in order: the exporter (which ends every lease), the buffer (whose free waits for
// the consumers' releases), the pool. It returns nil when it served until ctx ended and
// released everything; otherwise the first failure, joined with any failure to release.
func Produce(ctx context.Context, rt cudart.Runtime, cfg ProducerConfig, ready func(Published)) (err error) {
	if err := cfg.Shape.Validate(); err != nil {
		return err
	}
	size := cfg.Shape.Bytes()

	stream, err := rt.StreamCreate(cfg.Device, cudart.StreamNonBlocking)
	if err != nil {
		return err
	}
	defer func() { err = errors.Join(err, rt.StreamDestroy(cfg.Device, stream)) }()

	p, err := pool.New(rt, cfg.Device, pool.WithName(cfg.Name), pool.WithMaxSize(size))
	if err != nil {
		return err
	}
	defer func() {
		err = errors.Join(err, afterCancel(ctx, func(c context.Context) error {
			_, err := p.Close(c)
			return err
		}))
	}()

	buf, err := p.Alloc(ctx, size, stream)
	if err != nil {
		return err
	}
	defer func() {
		// The free is issued after the exporter closed (deferred calls run in reverse),
		// so it waits for nothing but the consumers' releases the exporter collected.
		err = errors.Join(err, buf.Free(stream), rt.StreamSynchronize(cfg.Device, stream))
	}()
	sum, err := upload(ctx, rt, cfg.Device, buf.Ptr(), size, cfg.Seed, stream)
	if err != nil {
		return err
	}

	// A program asks for the library's log: peers lost or refused, on its stderr.
	ex, err := producer.Listen(cfg.Socket, rt, producer.WithLogger(slog.Default()))
	if err != nil {
		return err
	}
	defer func() { err = errors.Join(err, afterCancel(ctx, ex.Close)) }()
	if err := ex.Publish(ctx, cfg.Name, buf, stream); err != nil {
		return err
	}
	ready(Published{
		PID: os.Getpid(), Socket: cfg.Socket, Name: cfg.Name, Device: cfg.Device,
		Size: size, Shape: cfg.Shape.String(), Checksum: sum.String(),
	})
	<-ctx.Done()
	if held := leasesHeld(ex); held > 0 && cfg.Notify != nil {
		cfg.Notify(fmt.Sprintf("stopping: waiting up to %v for consumers to release %d lease(s)", shutdownTimeout, held))
	}
	return nil
}

func leasesHeld(ex *producer.Exporter) int {
	n := 0
	for _, p := range ex.Peers() {
		n += p.Leases
	}
	return n
}

// upload writes the pattern into size bytes at dst on stream, staging it through one
// host chunk, and returns its checksum. When it returns the host chunk is free (a copy
// from pageable memory is staged before the call returns) but the device may still be
// copying: readers must order after stream.
func upload(ctx context.Context, rt cudart.Runtime, dev int, dst cudart.DevicePtr, size, seed uint64, stream cudart.Stream) (checksum, error) {
	sum := newChecksum()
	host := make([]byte, min(size, hostChunk))
	for off := uint64(0); off < size; off += uint64(len(host)) {
		if err := ctx.Err(); err != nil {
			return sum, err
		}
		chunk := host[:min(uint64(len(host)), size-off)]
		fill(chunk, seed, off, &sum)
		if err := rt.MemcpyHtoDAsync(dev, dst+cudart.DevicePtr(off), chunk, stream); err != nil {
			return sum, fmt.Errorf("kv: filling the cache at offset %d: %w", off, err)
		}
	}
	return sum, nil
}

// afterCancel runs a clean-up step under ctx's values but not its cancellation, since
// clean-up must still run after Ctrl-C ended ctx, bounded by shutdownTimeout.
func afterCancel(ctx context.Context, step func(context.Context) error) error {
	c, cancel := context.WithTimeout(context.WithoutCancel(ctx), shutdownTimeout)
	defer cancel()
	return step(c)
}
