package main

/*
#include "cp.h"
*/
import "C"

import (
	"context"
	"fmt"
	"unsafe"

	"github.com/cudapool/cudapool/cudart"
	"github.com/cudapool/cudapool/export"
	"github.com/cudapool/cudapool/export/producer"
	"github.com/cudapool/cudapool/vmm"
)

// The VMM route for C (package vmm): chunks, the reservations a producer maps them
// into to write them, and their publication (producer.Exporter.PublishChunks). A
// consumer's side needs nothing of its own: cudapool_importer_open maps a published
// allocation as one range and gives the usual mapping.
var (
	chunks       = newTable[*vmm.Chunk](kindChunk)
	reservations = newTable[*vmm.Reservation](kindReservation)
)

// chunkFabric is CUDAPOOL_CHUNK_FABRIC, the one flag of cudapool_chunk_create and
// cudapool_vmm_granularity.
const chunkFabric = C.CUDAPOOL_CHUNK_FABRIC

// handleTypeOf is the handle type flags ask for.
func handleTypeOf(flags C.int) (cudart.HandleType, error) {
	switch f := int(flags); f {
	case 0:
		return cudart.HandleTypePosixFD, nil
	case chunkFabric:
		return cudart.HandleTypePosixFD | cudart.HandleTypeFabric, nil
	default:
		return 0, invalid("unknown chunk flags %#x (CUDAPOOL_CHUNK_FABRIC is %#x)", f&^chunkFabric, chunkFabric)
	}
}

// vmmDevice is the runtime, after checking dev.
func vmmDevice(dev C.int) (cudart.Runtime, error) {
	if dev < 0 {
		return nil, invalid("device %d is negative", int(dev))
	}
	return runtimeNow()
}

//export cpgo_vmm_granularity
func cpgo_vmm_granularity(dev C.int, flags C.int, out *C.uint64_t) (rc C.int) {
	defer recoverTo(&rc)
	if out == nil {
		return fail(invalid("granularity is NULL"))
	}
	ht, err := handleTypeOf(flags)
	if err != nil {
		return fail(err)
	}
	rt, err := vmmDevice(dev)
	if err != nil {
		return fail(err)
	}
	if _, err := cudart.VMMOf(rt); err != nil {
		return fail(err)
	}
	g, err := vmm.Granularity(rt, int(dev), ht)
	if err != nil {
		return fail(err)
	}
	*out = C.uint64_t(g)
	return statusOK
}

//export cpgo_chunk_create
func cpgo_chunk_create(dev C.int, size C.uint64_t, flags C.int, out *C.uint64_t) (rc C.int) {
	defer recoverTo(&rc)
	if out == nil {
		return fail(invalid("chunk is NULL"))
	}
	ht, err := handleTypeOf(flags)
	if err != nil {
		return fail(err)
	}
	rt, err := vmmDevice(dev)
	if err != nil {
		return fail(err)
	}
	var opts []vmm.ChunkOption
	if ht&cudart.HandleTypeFabric != 0 {
		opts = append(opts, vmm.WithFabric())
	}
	c, err := vmm.NewChunk(rt, int(dev), uint64(size), opts...)
	if err != nil {
		return fail(err)
	}
	*out = C.uint64_t(chunks.add(c))
	return statusOK
}

//export cpgo_chunk_info
func cpgo_chunk_info(h C.uint64_t, dev *C.int, size *C.uint64_t, fabric *C.int) (rc C.int) {
	defer recoverTo(&rc)
	c, err := chunks.get(uint64(h))
	if err != nil {
		return fail(err)
	}
	if dev != nil {
		*dev = C.int(c.Device())
	}
	if size != nil {
		*size = C.uint64_t(c.Size())
	}
	if fabric != nil {
		*fabric = 0
		if c.HandleType()&cudart.HandleTypeFabric != 0 {
			*fabric = 1
		}
	}
	return statusOK
}

//export cpgo_chunk_close
func cpgo_chunk_close(h C.uint64_t) (rc C.int) {
	defer recoverTo(&rc)
	c, err := chunks.remove(uint64(h))
	if err != nil {
		return fail(err)
	}
	return result(c.Close())
}

//export cpgo_reservation_create
func cpgo_reservation_create(dev C.int, size C.uint64_t, out *C.uint64_t) (rc C.int) {
	defer recoverTo(&rc)
	if out == nil {
		return fail(invalid("reservation is NULL"))
	}
	rt, err := vmmDevice(dev)
	if err != nil {
		return fail(err)
	}
	r, err := vmm.Reserve(rt, int(dev), uint64(size))
	if err != nil {
		return fail(err)
	}
	*out = C.uint64_t(reservations.add(r))
	return statusOK
}

// chunkList is the chunks of the n handles at hs (called what), at most max of them.
func chunkList(hs *C.uint64_t, n C.size_t, max int, what string) ([]*vmm.Chunk, error) {
	switch {
	case n == 0:
		return nil, invalid("no %s", what)
	case uint64(n) > uint64(max):
		return nil, invalid("%d %s: at most %d", uint64(n), what, max)
	case hs == nil:
		return nil, invalid("%s is NULL with a count of %d", what, uint64(n))
	}
	cs := make([]*vmm.Chunk, n)
	for i, h := range unsafe.Slice(hs, int(n)) {
		c, err := chunks.get(uint64(h))
		if err != nil {
			return nil, fmt.Errorf("%s[%d]: %w", what, i, err)
		}
		cs[i] = c
	}
	return cs, nil
}

//export cpgo_reservation_grow
func cpgo_reservation_grow(h C.uint64_t, hs *C.uint64_t, n C.size_t) (rc C.int) {
	defer recoverTo(&rc)
	cs, err := chunkList(hs, n, export.MaxChunks, "chunks")
	if err != nil {
		return fail(err)
	}
	r, err := reservations.get(uint64(h))
	if err != nil {
		return fail(err)
	}
	return result(r.Grow(cs...))
}

//export cpgo_reservation_shrink
func cpgo_reservation_shrink(h C.uint64_t, n C.size_t) (rc C.int) {
	defer recoverTo(&rc)
	r, err := reservations.get(uint64(h))
	if err != nil {
		return fail(err)
	}
	if uint64(n) > uint64(r.Chunks()) {
		return fail(invalid("%d chunks to unmap, %d mapped", uint64(n), r.Chunks()))
	}
	return result(r.Shrink(int(n)))
}

//export cpgo_reservation_info
func cpgo_reservation_info(h C.uint64_t, ptr *C.uintptr_t, reserved, mapped *C.uint64_t, n *C.size_t) (rc C.int) {
	defer recoverTo(&rc)
	r, err := reservations.get(uint64(h))
	if err != nil {
		return fail(err)
	}
	if ptr != nil {
		*ptr = C.uintptr_t(r.Ptr())
	}
	if reserved != nil {
		*reserved = C.uint64_t(r.Reserved())
	}
	if mapped != nil {
		*mapped = C.uint64_t(r.Mapped())
	}
	if n != nil {
		*n = C.size_t(r.Chunks())
	}
	return statusOK
}

//export cpgo_reservation_close
func cpgo_reservation_close(h C.uint64_t) (rc C.int) {
	defer recoverTo(&rc)
	r, err := reservations.remove(uint64(h))
	if err != nil {
		return fail(err)
	}
	return result(r.Close())
}

//export cpgo_exporter_publish_chunks
func cpgo_exporter_publish_chunks(h C.uint64_t, name *C.char, hs *C.uint64_t, n C.size_t, offset, size C.uint64_t, s C.uintptr_t, meta unsafe.Pointer, metaLen C.size_t) (rc C.int) {
	defer recoverTo(&rc)
	nm, err := goString(name, "name")
	if err != nil {
		return fail(err)
	}
	cs, err := chunkList(hs, n, export.MaxChunks, "chunks")
	if err != nil {
		return fail(err)
	}
	opts, err := metaOptions(meta, metaLen)
	if err != nil {
		return fail(err)
	}
	opts = append(opts, producer.Range(uint64(offset), uint64(size)))
	ex, err := exporters.get(uint64(h))
	if err != nil {
		return fail(err)
	}
	return result(ex.PublishChunks(context.Background(), nm, cs, cudart.Stream(s), opts...))
}

//export cpgo_exporter_publish_chunks_all
func cpgo_exporter_publish_chunks_all(h C.uint64_t, hs *C.uint64_t, n C.size_t, entries *C.cudapool_chunk_entry, nEntries C.size_t, s C.uintptr_t) (rc C.int) {
	defer recoverTo(&rc)
	cs, err := chunkList(hs, n, export.MaxChunks, "chunks")
	if err != nil {
		return fail(err)
	}
	if err := checkBatch(nEntries, unsafe.Pointer(entries), "entries"); err != nil {
		return fail(err)
	}
	es := make([]producer.ChunkEntry, nEntries)
	for i, e := range unsafe.Slice(entries, int(nEntries)) {
		name, err := goString(e.name, fmt.Sprintf("entries[%d].name", i))
		if err != nil {
			return fail(err)
		}
		opts, err := metaOptions(e.meta, e.meta_len)
		if err != nil {
			return fail(fmt.Errorf("entries[%d] (%q): %w", i, name, err))
		}
		es[i] = producer.ChunkEntry{Name: name, Options: append(opts, producer.Range(uint64(e.offset), uint64(e.size)))}
	}
	ex, err := exporters.get(uint64(h))
	if err != nil {
		return fail(err)
	}
	return result(ex.PublishChunksAll(context.Background(), cs, es, cudart.Stream(s)))
}

// cudapoolMaxChunks is the header's bound, which TestVMMCInterface holds to export's.
const cudapoolMaxChunks = C.CUDAPOOL_MAX_CHUNKS
