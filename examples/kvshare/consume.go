package main

import (
	"context"
	"errors"
	"fmt"
	"os"
	"time"

	"github.com/cudapool/cudapool/cudart"
	"github.com/cudapool/cudapool/export/consumer"
	"github.com/cudapool/cudapool/pool"
)

// ConsumerConfig says which cache a consumer opens and how it measures it.
type ConsumerConfig struct {
	Socket string
	Name   string
	Device int    // the consumer's own device; the producer's may differ
	Seed   uint64 // must be the producer's
	// Reps is how many times each copy is timed; the best is reported, as the others
	// only add the noise of a shared machine. At least 1.
	Reps int
	// Hold, if set, is called while the consumer holds its mapping, after the check and
	// before the release: the window in which poolstat shows the lease.
	Hold func(ctx context.Context) error
}

// Result is what one consumer measured; it is the consumer's -json line.
type Result struct {
	PID      int    `json:"pid"`
	Device   int    `json:"device"`
	Name     string `json:"name"`
	Size     uint64 `json:"size"`
	Checksum string `json:"checksum"`
	// ImportRead is the best time to copy the imported cache into a local buffer (the
	// read from the producer's memory); LocalCopy the best time to copy that local
	// buffer into another one of this device, the yardstick.
	ImportRead time.Duration `json:"import_read_ns"`
	LocalCopy  time.Duration `json:"local_copy_ns"`
}

// ImportGBps is the rate of the read from the producer's memory, in GB/s (10^9 bytes).
func (r Result) ImportGBps() float64 { return rate(r.Size, r.ImportRead) }

// LocalGBps is the rate of a copy within the consumer's device, in GB/s.
func (r Result) LocalGBps() float64 { return rate(r.Size, r.LocalCopy) }

func rate(n uint64, d time.Duration) float64 {
	if d <= 0 {
		return 0
	}
	return float64(n) / d.Seconds() / 1e9
}

// Consume opens cfg.Name on cfg.Socket from cfg.Device, copies the cache into local
// memory (timed, against a local copy of the same size), checks every byte of it against
// the pattern from the host, calls cfg.Hold if set, releases the mapping and returns what
// it measured. On failure, including ctx ending, it still releases everything it took
// and returns the first failure joined with any failure to release.
func Consume(ctx context.Context, rt cudart.Runtime, cfg ConsumerConfig) (res Result, err error) {
	if cfg.Reps < 1 {
		return res, fmt.Errorf("kv: reps must be at least 1, got %d", cfg.Reps)
	}
	stream, err := rt.StreamCreate(cfg.Device, cudart.StreamNonBlocking)
	if err != nil {
		return res, err
	}
	defer func() { err = errors.Join(err, rt.StreamDestroy(cfg.Device, stream)) }()

	imp, err := consumer.Dial(ctx, cfg.Socket, rt, cfg.Device)
	if err != nil {
		return res, err
	}
	defer func() { err = errors.Join(err, afterCancel(ctx, imp.Close)) }()
	m, err := imp.Open(ctx, cfg.Name, stream)
	if err != nil {
		return res, err
	}
	defer func() {
		err = errors.Join(err, afterCancel(ctx, func(c context.Context) error { return m.Release(c, stream) }))
	}()
	size := m.Size()
	if size%wordBytes != 0 {
		return res, fmt.Errorf("kv: %q is %d bytes, not a whole number of 8-byte words: not a cache of this example", cfg.Name, size)
	}

	local, err := pool.New(rt, cfg.Device, pool.WithHandleType(cudart.HandleTypeNone), pool.WithName("kv-local"))
	if err != nil {
		return res, err
	}
	defer func() {
		err = errors.Join(err, afterCancel(ctx, func(c context.Context) error {
			_, err := local.Close(c)
			return err
		}))
	}()
	// Frees are stream-ordered: wait for them before the pool closes.
	defer func() { err = errors.Join(err, rt.StreamSynchronize(cfg.Device, stream)) }()
	copyOf, err := local.Alloc(ctx, size, stream)
	if err != nil {
		return res, err
	}
	defer func() { err = errors.Join(err, copyOf.Free(stream)) }()
	scratch, err := local.Alloc(ctx, size, stream)
	if err != nil {
		return res, err
	}
	defer func() { err = errors.Join(err, scratch.Free(stream)) }()

	res = Result{PID: os.Getpid(), Device: cfg.Device, Name: cfg.Name, Size: size}
	copyTimer := func(dst, src cudart.DevicePtr) func() error {
		return func() error {
			if err := rt.MemcpyDtoDAsync(cfg.Device, dst, src, size, stream); err != nil {
				return err
			}
			return rt.StreamSynchronize(cfg.Device, stream)
		}
	}
	if res.ImportRead, err = best(ctx, cfg.Reps, copyTimer(copyOf.Ptr(), m.Ptr())); err != nil {
		return res, fmt.Errorf("kv: reading the imported cache: %w", err)
	}
	if res.LocalCopy, err = best(ctx, cfg.Reps, copyTimer(scratch.Ptr(), copyOf.Ptr())); err != nil {
		return res, fmt.Errorf("kv: copying locally: %w", err)
	}
	sum, err := download(ctx, rt, cfg.Device, copyOf.Ptr(), size, cfg.Seed, stream)
	res.Checksum = sum.String()
	if err != nil {
		return res, err
	}
	if cfg.Hold != nil {
		if err := cfg.Hold(ctx); err != nil {
			return res, err
		}
	}
	return res, nil
}

// best runs op reps times, after one untimed run that takes first-touch costs out of the
// figure, and returns the shortest time, measured with the host clock.
func best(ctx context.Context, reps int, op func() error) (time.Duration, error) {
	if err := op(); err != nil {
		return 0, err
	}
	var fastest time.Duration
	for i := range reps {
		if err := ctx.Err(); err != nil {
			return 0, err
		}
		start := time.Now()
		if err := op(); err != nil {
			return 0, err
		}
		if d := time.Since(start); i == 0 || d < fastest {
			fastest = d
		}
	}
	return fastest, nil
}

// download brings size bytes at src to the host one chunk at a time, checks them against
// the pattern for seed and returns their checksum; the error says where they differ.
func download(ctx context.Context, rt cudart.Runtime, dev int, src cudart.DevicePtr, size, seed uint64, stream cudart.Stream) (checksum, error) {
	c := newChecker(seed)
	host := make([]byte, min(size, hostChunk))
	for off := uint64(0); off < size; off += uint64(len(host)) {
		if err := ctx.Err(); err != nil {
			return c.sum, err
		}
		chunk := host[:min(uint64(len(host)), size-off)]
		if err := rt.MemcpyDtoHAsync(dev, chunk, src+cudart.DevicePtr(off), stream); err != nil {
			return c.sum, fmt.Errorf("kv: reading the cache back at offset %d: %w", off, err)
		}
		c.check(chunk)
	}
	return c.sum, c.err()
}
