package main

/*
#include "cp.h"
*/
import "C"

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"unsafe"

	"github.com/cudapool/cudapool/consumer"
	"github.com/cudapool/cudapool/cudart"
	"github.com/cudapool/cudapool/discover"
	"github.com/cudapool/cudapool/producer"
)

var (
	exporters = newTable[*producer.Exporter](kindExporter)
	importers = newTable[*consumer.Importer](kindImporter)
	mappings  = newTable[*consumer.Mapping](kindMapping)
)

// The flags of cudapool_exporter_listen.
const (
	listenRetainImports = 1
	listenNoAnnounce    = 2
)

// maxMeta bounds the metadata a publish carries (CUDAPOOL_MAX_META).
const maxMeta = producer.MaxMetaLen

//export cpgo_protocol_version
func cpgo_protocol_version(out *C.int) (rc C.int) {
	defer recoverTo(&rc)
	if out == nil {
		return fail(invalid("version is NULL"))
	}
	*out = C.int(consumer.ProtocolVersion)
	return statusOK
}

//export cpgo_exporter_listen
func cpgo_exporter_listen(path, name *C.char, flags C.int, out *C.uint64_t) (rc C.int) {
	defer recoverTo(&rc)
	if out == nil {
		return fail(invalid("exporter is NULL"))
	}
	p, err := goString(path, "path")
	if err != nil {
		return fail(err)
	}
	syncEnv() // the announce directory
	var opts []producer.ListenOption
	if name != nil {
		opts = append(opts, producer.WithName(C.GoString(name)))
	}
	if flags&^(listenRetainImports|listenNoAnnounce) != 0 {
		return fail(invalid("unknown listen flags %#x", int(flags)&^(listenRetainImports|listenNoAnnounce)))
	}
	if flags&listenRetainImports != 0 {
		opts = append(opts, producer.WithRetainedImports())
	}
	if flags&listenNoAnnounce != 0 {
		opts = append(opts, producer.WithoutAnnounce())
	}
	rt, err := runtimeNow()
	if err != nil {
		return fail(err)
	}
	ex, err := producer.Listen(p, rt, opts...)
	if err != nil {
		return fail(err)
	}
	*out = C.uint64_t(exporters.add(ex))
	return statusOK
}

//export cpgo_exporter_publish
func cpgo_exporter_publish(h C.uint64_t, name *C.char, ptr C.uintptr_t, size C.uint64_t, s C.uintptr_t, meta unsafe.Pointer, metaLen C.size_t) (rc C.int) {
	defer recoverTo(&rc)
	n, err := goString(name, "name")
	if err != nil {
		return fail(err)
	}
	switch {
	case ptr == 0:
		return fail(invalid("ptr is NULL"))
	case metaLen > maxMeta:
		return fail(invalid("metadata of %d bytes is longer than %d", int(metaLen), maxMeta))
	case metaLen > 0 && meta == nil:
		return fail(invalid("meta is NULL with meta_len %d", int(metaLen)))
	}
	ex, err := exporters.get(uint64(h))
	if err != nil {
		return fail(err)
	}
	b, off, ok := buffers.containing(uintptr(ptr))
	if !ok {
		return fail(fmt.Errorf("%w: %#x lies in no buffer of a cudapool pool of this process", errPointer, uintptr(ptr)))
	}
	if uint64(size) > b.Size()-off {
		return fail(invalid("%d bytes at offset %d run past the end of its %d-byte buffer", uint64(size), off, b.Size()))
	}
	opts := []producer.PublishOption{producer.Range(off, uint64(size))}
	if metaLen > 0 {
		opts = append(opts, producer.WithMeta(C.GoBytes(meta, C.int(metaLen))))
	}
	return result(ex.Publish(context.Background(), n, b, cudart.Stream(s), opts...))
}

//export cpgo_exporter_unpublish
func cpgo_exporter_unpublish(h C.uint64_t, name *C.char) (rc C.int) {
	defer recoverTo(&rc)
	n, err := goString(name, "name")
	if err != nil {
		return fail(err)
	}
	ex, err := exporters.get(uint64(h))
	if err != nil {
		return fail(err)
	}
	return result(ex.Unpublish(n))
}

//export cpgo_exporter_push
func cpgo_exporter_push(h C.uint64_t, pid C.int, name *C.char, timeoutMs C.int64_t) (rc C.int) {
	defer recoverTo(&rc)
	n, ctx, cancel, err := nameAndContext(name, "name", timeoutMs)
	if err != nil {
		return fail(err)
	}
	defer cancel()
	ex, err := exporters.get(uint64(h))
	if err != nil {
		return fail(err)
	}
	return result(ex.Push(ctx, n, int(pid)))
}

//export cpgo_exporter_state
func cpgo_exporter_state(h C.uint64_t, buf *C.char, capacity C.size_t, n *C.size_t) (rc C.int) {
	defer recoverTo(&rc)
	ex, err := exporters.get(uint64(h))
	if err != nil {
		return fail(err)
	}
	st, err := ex.State()
	if err != nil {
		return fail(err)
	}
	return result(writeJSON(st, buf, capacity, n))
}

//export cpgo_exporter_close
func cpgo_exporter_close(h C.uint64_t, timeoutMs C.int64_t) (rc C.int) {
	defer recoverTo(&rc)
	ctx, cancel, err := ctxFor(timeoutMs)
	if err != nil {
		return fail(err)
	}
	defer cancel()
	ex, err := exporters.remove(uint64(h))
	if err != nil {
		return fail(err)
	}
	return result(ex.Close(ctx))
}

//export cpgo_query_state
func cpgo_query_state(socket *C.char, timeoutMs C.int64_t, buf *C.char, capacity C.size_t, n *C.size_t) (rc C.int) {
	defer recoverTo(&rc)
	path, ctx, cancel, err := nameAndContext(socket, "socket", timeoutMs)
	if err != nil {
		return fail(err)
	}
	defer cancel()
	st, err := discover.QueryState(ctx, path)
	if err != nil {
		return fail(err)
	}
	return result(writeJSON(st, buf, capacity, n))
}

func writeJSON(st *discover.State, buf *C.char, capacity C.size_t, n *C.size_t) error {
	b, err := json.Marshal(st)
	if err != nil {
		return err
	}
	return writeOut(unsafe.Pointer(buf), capacity, n, b, true)
}

//export cpgo_importer_dial
func cpgo_importer_dial(path *C.char, device C.int, timeoutMs C.int64_t, out *C.uint64_t) (rc C.int) {
	defer recoverTo(&rc)
	if out == nil {
		return fail(invalid("importer is NULL"))
	}
	p, ctx, cancel, err := nameAndContext(path, "path", timeoutMs)
	if err != nil {
		return fail(err)
	}
	defer cancel()
	rt, err := runtimeNow()
	if err != nil {
		return fail(err)
	}
	imp, err := consumer.Dial(ctx, p, rt, int(device))
	if err != nil {
		return fail(err)
	}
	*out = C.uint64_t(importers.add(imp))
	return statusOK
}

//export cpgo_importer_open
func cpgo_importer_open(h C.uint64_t, name *C.char, s C.uintptr_t, timeoutMs C.int64_t, out *C.uint64_t) (rc C.int) {
	defer recoverTo(&rc)
	if out == nil {
		return fail(invalid("mapping is NULL"))
	}
	n, ctx, cancel, err := nameAndContext(name, "name", timeoutMs)
	if err != nil {
		return fail(err)
	}
	defer cancel()
	imp, err := importers.get(uint64(h))
	if err != nil {
		return fail(err)
	}
	m, err := imp.Open(ctx, n, cudart.Stream(s))
	if err != nil {
		return fail(err)
	}
	*out = C.uint64_t(mappings.add(m))
	return statusOK
}

//export cpgo_importer_close
func cpgo_importer_close(h C.uint64_t, timeoutMs C.int64_t) (rc C.int) {
	defer recoverTo(&rc)
	ctx, cancel, err := ctxFor(timeoutMs)
	if err != nil {
		return fail(err)
	}
	defer cancel()
	imp, err := importers.remove(uint64(h))
	if err != nil {
		return fail(err)
	}
	return result(imp.Close(ctx))
}

//export cpgo_mapping_info
func cpgo_mapping_info(h C.uint64_t, ptr *C.uintptr_t, size *C.uint64_t, metaLen *C.size_t) (rc C.int) {
	defer recoverTo(&rc)
	m, err := mappings.get(uint64(h))
	if err != nil {
		return fail(err)
	}
	if ptr != nil {
		*ptr = C.uintptr_t(m.Ptr())
	}
	if size != nil {
		*size = C.uint64_t(m.Size())
	}
	if metaLen != nil {
		*metaLen = C.size_t(len(m.Meta()))
	}
	return statusOK
}

//export cpgo_mapping_meta
func cpgo_mapping_meta(h C.uint64_t, buf unsafe.Pointer, capacity C.size_t, n *C.size_t) (rc C.int) {
	defer recoverTo(&rc)
	m, err := mappings.get(uint64(h))
	if err != nil {
		return fail(err)
	}
	return result(writeOut(buf, capacity, n, m.Meta(), false))
}

//export cpgo_mapping_release
func cpgo_mapping_release(h C.uint64_t, s C.uintptr_t, timeoutMs C.int64_t) (rc C.int) {
	defer recoverTo(&rc)
	ctx, cancel, err := ctxFor(timeoutMs)
	if err != nil {
		return fail(err)
	}
	defer cancel()
	m, err := mappings.remove(uint64(h))
	if err != nil {
		return fail(err)
	}
	if err := m.Release(ctx, cudart.Stream(s)); err != nil {
		if !errors.Is(err, consumer.ErrReleased) {
			return fail(err)
		}
		return fail(fmt.Errorf("%w: %w", errHandle, err))
	}
	return statusOK
}
