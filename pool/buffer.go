package pool

import (
	"fmt"
	"sync/atomic"

	"github.com/dustin/go-humanize"

	"github.com/cudapool/cudapool/cudart"
)

type bufState uint8

const (
	bufLive     bufState = iota
	bufFreeing           // Free called; the driver's free waits for leases or is being issued
	bufFreed             // returned to the driver
	bufReleased          // freed or abandoned by Close(Force)
	bufFailed            // a deferred free failed; the memory stays reserved
)

// Buffer is device memory from a [Pool], or from another [Allocator] that made it with
// [NewBuffer]. Its accessors are safe for concurrent use; it stays valid to read after
// Free, but not to free, lease or export.
//
// Its layout is kept within 96 bytes: Alloc makes one per call, and that is the whole
// of what it allocates.
type Buffer struct {
	pool     *Pool    // nil for a buffer made by NewBuffer
	foreign  *foreign // set for a buffer made by NewBuffer only
	ptr      cudart.DevicePtr
	size     uint64
	reserved uint64
	id       uint64

	// Guarded by pool.mu.
	state     bufState
	shared    bool
	abandoned bool // a lease ended after Close began: its completion was not waited on
	// ordered: the release stream waited for a completion of one of its leases, so a
	// reuse of its memory must follow the release stream (the completions its leases
	// still owe, which EndAt left, are in pool.owed).
	ordered    bool
	leases     int32         // bounded by the leases a process can hold
	freeEvent  cudart.Event  // recorded by a deferred Free; 0 until then
	freeStream cudart.Stream // the stream a deferred Free was given
	retained   *retainSet    // the memory's retentions; nil until its first
	slot       int           // its index in pool.live while in it

	// record is set once, under pool.exportMu; atomic so that Free can carry it
	// into the cache.
	record atomic.Pointer[cudart.PtrExportData]
}

// foreign is the allocator of a buffer made by NewBuffer, and its device: kept apart
// from Buffer, whose pool gives both.
type foreign struct {
	owner Allocator
	dev   int
}

// Ptr is the device address of the buffer.
func (b *Buffer) Ptr() cudart.DevicePtr { return b.ptr }

// Size is the size that was asked for.
func (b *Buffer) Size() uint64 { return b.size }

// Reserved is the size after rounding to the pool's granularity: the bytes the buffer
// owns.
func (b *Buffer) Reserved() uint64 { return b.reserved }

// Device is the ordinal of the device the buffer is on.
func (b *Buffer) Device() int {
	switch {
	case b.pool != nil:
		return b.pool.dev
	case b.foreign != nil:
		return b.foreign.dev
	}
	return 0
}

// ID is unique among the buffers of this process.
func (b *Buffer) ID() uint64 { return b.id }

// Pool is the pool the buffer came from; nil for a buffer made by [NewBuffer].
func (b *Buffer) Pool() *Pool { return b.pool }

// NewBuffer makes a [Buffer] of the size bytes at ptr on owner's device, for an
// [Allocator] that is not a [Pool] (a wrapper or a test double) to hand out. Its Free
// calls owner.Free; it cannot be leased or exported ([ErrNotShareable]).
func NewBuffer(owner Allocator, ptr cudart.DevicePtr, size uint64) *Buffer {
	return &Buffer{foreign: &foreign{owner, owner.Device()}, ptr: ptr, size: size, reserved: size, id: newIDs().next}
}

// Free is b's allocator's Free(b, s).
func (b *Buffer) Free(s cudart.Stream) error {
	switch {
	case b.pool != nil:
		return b.pool.Free(b, s)
	case b.foreign == nil:
		return unpooled("free", b)
	}
	return b.foreign.owner.Free(b, s)
}

// Shared reports whether the buffer has ever been leased.
func (b *Buffer) Shared() bool {
	if b.pool == nil {
		return false
	}
	b.pool.mu.Lock()
	defer b.pool.mu.Unlock()
	return b.shared
}

func (b *Buffer) String() string {
	switch {
	case b == nil:
		return "nil buffer"
	case b.pool == nil && b.foreign == nil:
		return "buffer not from an allocator"
	case b.pool == nil:
		return fmt.Sprintf("buffer %d (%s at %#x on device %d, not from a pool)", b.id, human(b.size), uintptr(b.ptr), b.foreign.dev)
	}
	return fmt.Sprintf("buffer %d (%s at %#x on device %d of pool %q)", b.id, human(b.size), uintptr(b.ptr), b.pool.dev, b.pool.name)
}

// unpooled is the error for a Buffer that no pool made: one from NewBuffer cannot be
// shared, a zero Buffer belongs to nobody.
func unpooled(op string, b *Buffer) error {
	if b.foreign != nil {
		return fmt.Errorf("pool: %s %v: %w", op, b, ErrNotShareable)
	}
	return fmt.Errorf("pool: %s %v: %w", op, b, ErrForeignBuffer)
}

// human prints a size in bytes the way people read it ("16 MiB").
func human(n uint64) string { return humanize.IBytes(n) }

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
