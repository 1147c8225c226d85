// Package vmm owns the VMM route: device memory made as chunks (cuMemCreate), shared
// as file descriptors or FABRIC handles, and mapped contiguously into a Reservation
// of device addresses that grows and shrinks in place at its end.
//
// It is the second way cudapool shares device memory, beside the pool route (package
// pool and the sharing protocol): a pool import of more than about 4.5 GiB kills the
// importer (FACTS 17), where a chunk of any size imports whole, and a 100 GiB slab of
// 2 GiB chunks maps in another process as one range (FACTS 25).
//
// What holds:
//
//   - Sizes are multiples of the granularity (Granularity; 2 MiB on the H200), for
//     chunks and reservations alike; a Reservation maps each chunk whole.
//   - A chunk's memory lives while any process holds its descriptor or a mapping of
//     it: a Chunk's Close gives up only the handle. A process that keeps memory for
//     others needs no CUDA context, only the descriptors (FACTS 26).
//   - An imported chunk cannot be exported again: pass its descriptor on.
//   - A FABRIC handle crosses the nodes of an NVLink fabric, but the driver makes
//     and imports FABRIC chunks only where an IMEX channel is granted (nvidia-imex
//     running, /dev/nvidia-caps-imex-channels/channel0): elsewhere they fail with
//     ErrFabricNotPermitted.
//   - Work queued on a stream that touches a mapping must have run before the
//     mapping is unmapped (Shrink, Close).
//
// Every call takes the cudart.Runtime and the device whose context the driver calls
// use; the runtime must have the VMM route (cudart.VMMOf).
package vmm

import (
	"errors"
	"fmt"

	"github.com/cudapool/cudapool/cudart"
)

// Granularity is the size every chunk and reservation of dev shareable as ht is a
// multiple of (the driver's minimum granularity).
func Granularity(rt cudart.Runtime, dev int, ht cudart.HandleType) (uint64, error) {
	g, err := rt.AllocationGranularity(dev, ht, false)
	if err != nil {
		return 0, fmt.Errorf("vmm: granularity of device %d: %w", dev, err)
	}
	return g, nil
}

// vmmOf is rt's VMM and dev's granularity for ht.
func vmmOf(rt cudart.Runtime, dev int, ht cudart.HandleType) (cudart.VMM, uint64, error) {
	v, err := cudart.VMMOf(rt)
	if err != nil {
		return nil, 0, err
	}
	g, err := Granularity(rt, dev, ht)
	return v, g, err
}

// granular is ErrGranularity unless size is a positive multiple of g.
func granular(what string, size, g uint64) error {
	if size == 0 || size%g != 0 {
		return fmt.Errorf("%w: %s of %d bytes, granularity %d", ErrGranularity, what, size, g)
	}
	return nil
}

// fabricErr wraps ErrFabricNotPermitted around the driver's refusal of a FABRIC call.
func fabricErr(ht cudart.HandleType, err error) error {
	if ht&cudart.HandleTypeFabric != 0 && errors.Is(err, cudart.ErrNotPermitted) {
		return fmt.Errorf("%w: %w", ErrFabricNotPermitted, err)
	}
	return err
}
