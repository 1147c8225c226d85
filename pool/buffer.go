package pool

import (
	"fmt"

	"github.com/cudapool/cudapool/cudart"
)

type bufState int

const (
	bufLive     bufState = iota
	bufFreeing           // Free called; the driver's free waits for leases or is being issued
	bufFreed             // returned to the driver
	bufReleased          // freed or abandoned by Close(Force)
	bufFailed            // a deferred free failed; the memory stays reserved
)

// Buffer is device memory from a Pool. Its accessors are safe for concurrent use; it
// stays valid to read after Free, but not to free, lease or export.
type Buffer struct {
	pool     *Pool
	ptr      cudart.DevicePtr
	size     uint64
	reserved uint64
	id       uint64

	// Guarded by pool.mu.
	state      bufState
	leases     int
	shared     bool
	abandoned  bool         // a lease ended after Close began: its completion was not waited on
	freeEvent  cudart.Event // recorded by a deferred Free; 0 until then
	prev, next *Buffer      // in pool.live

	record *cudart.PtrExportData // guarded by pool.exportMu
}

// Ptr is the device address of the buffer.
func (b *Buffer) Ptr() cudart.DevicePtr { return b.ptr }

// Size is the size that was asked for.
func (b *Buffer) Size() uint64 { return b.size }

// Reserved is the size after rounding to the pool's granularity: the bytes the buffer
// owns.
func (b *Buffer) Reserved() uint64 { return b.reserved }

// Device is the ordinal of the device the buffer is on.
func (b *Buffer) Device() int { return b.pool.dev }

// ID is unique among the buffers of this process.
func (b *Buffer) ID() uint64 { return b.id }

// Pool is the pool the buffer came from.
func (b *Buffer) Pool() *Pool { return b.pool }

// Free is b.Pool().Free(b, s).
func (b *Buffer) Free(s cudart.Stream) error {
	if b.pool == nil {
		return unpooled("free", b)
	}
	return b.pool.Free(b, s)
}

// Shared reports whether the buffer has ever been leased.
func (b *Buffer) Shared() bool {
	b.pool.mu.Lock()
	defer b.pool.mu.Unlock()
	return b.shared
}

func (b *Buffer) String() string {
	switch {
	case b == nil:
		return "nil buffer"
	case b.pool == nil:
		return "buffer not from a pool"
	}
	return fmt.Sprintf("buffer %d (%d bytes at %#x on device %d of pool %q)", b.id, b.size, uintptr(b.ptr), b.pool.dev, b.pool.name)
}

// unpooled is the error for a Buffer that no pool made (a zero Buffer).
func unpooled(op string, b *Buffer) error {
	return fmt.Errorf("pool: %s %v: %w", op, b, ErrForeignBuffer)
}

// stateError says why a buffer that is not live cannot be used. Call with pool.mu held.
func (b *Buffer) stateError(op string) error {
	why := "freed"
	switch b.state {
	case bufFreeing:
		why = "freed; the free waits for its leases to end"
	case bufReleased:
		why = "released by Close"
	case bufFailed:
		why = "freed; its deferred free failed"
	}
	return b.pool.errorf("%s %v: %w (%s)", op, b, ErrFreed, why)
}
