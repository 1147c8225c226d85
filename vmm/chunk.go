package vmm

import (
	"fmt"
	"sync"

	"github.com/cudapool/cudapool/cudart"
)

// Chunk is one physical allocation of device memory on the VMM route: made here
// (NewChunk) or imported from another process's descriptor or FABRIC handle. It has
// no address: a Reservation maps it. Its methods are safe for concurrent use.
type Chunk struct {
	v        cudart.VMM
	dev      int
	size     uint64
	ht       cudart.HandleType
	imported bool

	mu sync.Mutex
	h  cudart.MemHandle
	// closed is set by Close: h is released and the Chunk answers ErrClosed.
	closed bool
}

// ChunkOption changes how NewChunk makes a chunk.
type ChunkOption func(*chunkOptions)

type chunkOptions struct{ ht cudart.HandleType }

// WithFabric makes the chunk exportable as a FABRIC handle too (ExportFabric). The
// driver refuses it where the host has no IMEX channel: NewChunk fails with
// ErrFabricNotPermitted.
func WithFabric() ChunkOption {
	return func(o *chunkOptions) { o.ht |= cudart.HandleTypeFabric }
}

// NewChunk makes a chunk of size bytes of pinned memory on dev, exportable as a POSIX
// descriptor (and a FABRIC handle WithFabric). size must be a multiple of
// Granularity (ErrGranularity). On failure nothing is made.
func NewChunk(rt cudart.Runtime, dev int, size uint64, opts ...ChunkOption) (*Chunk, error) {
	o := chunkOptions{ht: cudart.HandleTypePosixFD}
	for _, opt := range opts {
		if opt != nil {
			opt(&o)
		}
	}
	v, g, err := vmmOf(rt, dev, o.ht)
	if err != nil {
		return nil, err
	}
	if err := granular("chunk", size, g); err != nil {
		return nil, err
	}
	h, err := v.MemCreate(dev, size, o.ht)
	if err != nil {
		return nil, fmt.Errorf("vmm: make a chunk of %d bytes on device %d: %w", size, dev, fabricErr(o.ht, err))
	}
	return &Chunk{v: v, dev: dev, size: size, ht: o.ht, h: h}, nil
}

// Import imports the chunk of size bytes that another process exported as the
// descriptor fd (Export), for use on dev. The caller keeps fd, and may close it once
// Import returns. size is the exporter's: the descriptor does not carry it, so it
// travels beside it. On failure nothing is imported.
func Import(rt cudart.Runtime, dev int, fd int, size uint64) (*Chunk, error) {
	return importChunk(rt, dev, cudart.ShareableHandle{Type: cudart.HandleTypePosixFD, FD: fd}, size)
}

// ImportFabric is Import of a FABRIC handle (ExportFabric), from this node or another
// of the fabric. Where the host has no IMEX channel it fails with
// ErrFabricNotPermitted.
func ImportFabric(rt cudart.Runtime, dev int, h cudart.FabricHandle, size uint64) (*Chunk, error) {
	return importChunk(rt, dev, cudart.ShareableHandle{Type: cudart.HandleTypeFabric, FD: -1, Fabric: h}, size)
}

func importChunk(rt cudart.Runtime, dev int, sh cudart.ShareableHandle, size uint64) (*Chunk, error) {
	v, g, err := vmmOf(rt, dev, sh.Type)
	if err != nil {
		return nil, err
	}
	if err := granular("chunk", size, g); err != nil {
		return nil, err
	}
	h, err := v.MemImportFromShareableHandle(dev, sh)
	if err != nil {
		return nil, fmt.Errorf("vmm: import a chunk (%v) on device %d: %w", sh.Type, dev, fabricErr(sh.Type, err))
	}
	return &Chunk{v: v, dev: dev, size: size, ht: sh.Type, imported: true, h: h}, nil
}

// Size is the chunk's size in bytes.
func (c *Chunk) Size() uint64 { return c.size }

// Device is the device the chunk's driver calls use: its own, or its importer's.
func (c *Chunk) Device() int { return c.dev }

// HandleType is how the chunk can be shared: cudart.HandleTypePosixFD, with
// cudart.HandleTypeFabric too for a chunk made WithFabric; for an imported chunk, the
// type it was imported from.
func (c *Chunk) HandleType() cudart.HandleType { return c.ht }

// Imported reports whether the chunk was imported (Import, ImportFabric).
func (c *Chunk) Imported() bool { return c.imported }

// Export returns a new POSIX descriptor of the chunk, which the caller owns and
// closes: send it to another process (internal/unixfd), which Imports it. While any
// process holds it, the memory lives, whether or not this Chunk is closed. An
// imported chunk fails with ErrImported.
func (c *Chunk) Export() (int, error) {
	sh, err := c.export(cudart.HandleTypePosixFD)
	if err != nil {
		return -1, err
	}
	return sh.FD, nil
}

// ExportFabric returns the chunk's FABRIC handle (a chunk made WithFabric), which
// names the memory while this Chunk is open. An imported chunk fails with
// ErrImported.
func (c *Chunk) ExportFabric() (cudart.FabricHandle, error) {
	sh, err := c.export(cudart.HandleTypeFabric)
	return sh.Fabric, err
}

func (c *Chunk) export(ht cudart.HandleType) (cudart.ShareableHandle, error) {
	if c.imported {
		return cudart.ShareableHandle{}, fmt.Errorf("%w: pass the descriptor it came from on", ErrImported)
	}
	var sh cudart.ShareableHandle
	err := c.with(func(h cudart.MemHandle) error {
		var err error
		sh, err = c.v.MemExportToShareableHandle(c.dev, h, ht)
		return err
	})
	if err != nil {
		return cudart.ShareableHandle{}, fmt.Errorf("vmm: export a chunk as %v: %w", ht, err)
	}
	return sh, nil
}

// with runs f with the chunk's handle, which stays valid until f returns; ErrClosed
// once the Chunk is closed.
func (c *Chunk) with(f func(h cudart.MemHandle) error) error {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.closed {
		return ErrClosed
	}
	return f(c.h)
}

// Close gives up this process's handle of the chunk. Its memory lives on while a
// mapping of it (a Reservation's, here or elsewhere) or an exported descriptor
// remains. Closing twice is a no-op. On failure the handle is given up all the same
// (the driver's release cannot be retried meaningfully) and the error says why.
func (c *Chunk) Close() error {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.closed {
		return nil
	}
	c.closed = true
	if err := c.v.MemRelease(c.dev, c.h); err != nil {
		return fmt.Errorf("vmm: release a chunk: %w", err)
	}
	return nil
}
