package vmm

import "errors"

// ErrClosed means the Chunk or Reservation was closed.
var ErrClosed = errors.New("vmm: closed")

// ErrGranularity means a size is not a positive multiple of the device's allocation
// granularity (Granularity).
var ErrGranularity = errors.New("vmm: size is not a multiple of the allocation granularity")

// ErrFull means a Grow would map past the end of the reserved addresses.
var ErrFull = errors.New("vmm: the reservation has no room for the chunks")

// ErrNotMapped means a Shrink asked to unmap more chunks than are mapped.
var ErrNotMapped = errors.New("vmm: fewer chunks are mapped than asked")

// ErrFabricNotPermitted means the driver refused a FABRIC allocation or import
// (CUDA_ERROR_NOT_PERMITTED): the host has no IMEX channel (FACTS 25). The error
// also wraps cudart.ErrNotPermitted.
var ErrFabricNotPermitted = errors.New("vmm: FABRIC handles refused: this host has no IMEX channel (nvidia-imex must run and grant /dev/nvidia-caps-imex-channels/channel0)")

// ErrImported means an imported Chunk was asked for a handle: the driver exports
// only the chunks its process made (FACTS 25). Pass the descriptor it was imported
// from on instead.
var ErrImported = errors.New("vmm: an imported chunk cannot be exported again")
