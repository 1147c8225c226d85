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
	"os"
	"sync"
	"unsafe"

	"github.com/cudapool/cudapool/cudart"
	"github.com/cudapool/cudapool/export"
	"github.com/cudapool/cudapool/export/consumer"
	"github.com/cudapool/cudapool/export/discover"
	"github.com/cudapool/cudapool/export/producer"
	"github.com/cudapool/cudapool/pool"
)

var (
	exporters = newTable[*producer.Exporter](kindExporter)
	importers = newTable[*importer](kindImporter)
	mappings  = newTable[*consumer.Mapping](kindMapping)
)

// importer is an Importer with its death notice for C: a pipe whose write end is
// closed when the Importer's Done is, made at the first cudapool_importer_done_fd.
type importer struct {
	*consumer.Importer
	mu    sync.Mutex
	r     *os.File // nil until asked for
	stop  chan struct{}
	ended chan struct{} // closed once the goroutine closed the write end
}

// doneFD returns the read end of the death notice, making it the first time.
func (imp *importer) doneFD() (int, error) {
	imp.mu.Lock()
	defer imp.mu.Unlock()
	if imp.r == nil {
		r, w, err := os.Pipe()
		if err != nil {
			return -1, fmt.Errorf("cudapool: the importer's done descriptor: %w", err)
		}
		imp.r, imp.stop, imp.ended = r, make(chan struct{}), make(chan struct{})
		go func() {
			defer close(imp.ended)
			select {
			case <-imp.Done():
			case <-imp.stop:
			}
			_ = w.Close() // the signal: the descriptor is closed even when close reports an error
		}()
	}
	return int(imp.r.Fd()), nil
}

// closeFD closes the death notice, once the Importer is closed.
func (imp *importer) closeFD() {
	imp.mu.Lock()
	defer imp.mu.Unlock()
	if imp.r != nil {
		close(imp.stop)
		<-imp.ended
		_ = imp.r.Close() // cleanup: nothing is left to do if closing fails
		imp.r = nil
	}
}

// The flags of cudapool_listen_options, cudapool_dial_options and cudapool_open_options.
const (
	listenRetainImports       = C.CUDAPOOL_LISTEN_RETAIN_IMPORTS
	listenNoAnnounce          = C.CUDAPOOL_LISTEN_NO_ANNOUNCE
	listenSocketFollowsPolicy = C.CUDAPOOL_LISTEN_SOCKET_FOLLOWS_POLICY
	listenFlags               = listenRetainImports | listenNoAnnounce | listenSocketFollowsPolicy

	dialWaitForExporter = C.CUDAPOOL_DIAL_WAIT_FOR_EXPORTER

	openWaitForName = C.CUDAPOOL_OPEN_WAIT_FOR_NAME
	openLocalCopy   = C.CUDAPOOL_OPEN_LOCAL_COPY
)

// maxMeta bounds the metadata a publish carries (CUDAPOOL_MAX_META).
const maxMeta = export.MaxMetaLen

//export cpgo_protocol_version
func cpgo_protocol_version(out *C.int) (rc C.int) {
	defer recoverTo(&rc)
	if out == nil {
		return fail(invalid("version is NULL"))
	}
	*out = C.int(export.ProtocolVersion)
	return statusOK
}

// listenOptions turns cudapool_listen_options into Listen's options.
func listenOptions(o *C.cudapool_listen_options) ([]producer.ListenOption, error) {
	opts := []producer.ListenOption{producer.WithLogger(logger)}
	if o == nil {
		return opts, nil
	}
	if err := options(unsafe.Pointer(o), C.sizeof_cudapool_listen_options, "listen options"); err != nil {
		return nil, err
	}
	if o.name != nil {
		opts = append(opts, producer.WithName(C.GoString(o.name)))
	}
	flags := int(o.flags)
	if flags&^listenFlags != 0 {
		return nil, invalid("unknown listen flags %#x", flags&^listenFlags)
	}
	if flags&listenRetainImports != 0 {
		opts = append(opts, producer.WithRetainedImports())
	}
	if flags&listenNoAnnounce != 0 {
		opts = append(opts, producer.WithoutAnnounce())
	}
	if flags&listenSocketFollowsPolicy != 0 {
		opts = append(opts, producer.SocketFollowsPolicy())
	}
	uids, err := ids(o.allow_uids, o.uid_count, "allow_uids")
	if err != nil {
		return nil, err
	}
	gids, err := ids(o.allow_gids, o.gid_count, "allow_gids")
	if err != nil {
		return nil, err
	}
	if len(uids) > 0 || len(gids) > 0 {
		opts = append(opts, producer.WithPolicy(export.Policy{AllowUIDs: uids, AllowGIDs: gids}))
	}
	switch n := int(o.max_grants); {
	case n < 0:
		return nil, invalid("max_grants %d is negative (0: the default)", n)
	case n > 0:
		opts = append(opts, producer.WithMaxGrants(n))
	}
	return opts, nil
}

// ids copies a C array of n ids (called what).
func ids(p *C.uint32_t, n C.size_t, what string) ([]uint32, error) {
	switch {
	case n == 0:
		return nil, nil
	case p == nil:
		return nil, invalid("%s is NULL with a count of %d", what, uint64(n))
	case n > 1<<16:
		return nil, invalid("%d %s: at most %d", uint64(n), what, 1<<16)
	}
	out := make([]uint32, n)
	for i, id := range unsafe.Slice(p, int(n)) {
		out[i] = uint32(id)
	}
	return out, nil
}

//export cpgo_exporter_listen
func cpgo_exporter_listen(path *C.char, o *C.cudapool_listen_options, out *C.uint64_t) (rc C.int) {
	defer recoverTo(&rc)
	if out == nil {
		return fail(invalid("exporter is NULL"))
	}
	p, err := goString(path, "path")
	if err != nil {
		return fail(err)
	}
	opts, err := listenOptions(o)
	if err != nil {
		return fail(err)
	}
	syncEnv() // the announce directory
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
	b, opts, err := publication(ptr, size, meta, metaLen)
	if err != nil {
		return fail(err)
	}
	ex, err := exporters.get(uint64(h))
	if err != nil {
		return fail(err)
	}
	return result(ex.Publish(context.Background(), n, b, cudart.Stream(s), opts...))
}

// publication finds the buffer that holds [ptr, ptr+size) and makes the options that
// publish that range with meta.
func publication(ptr C.uintptr_t, size C.uint64_t, meta unsafe.Pointer, metaLen C.size_t) (*pool.Buffer, []producer.PublishOption, error) {
	if ptr == 0 {
		return nil, nil, invalid("ptr is NULL")
	}
	metaOpts, err := metaOptions(meta, metaLen)
	if err != nil {
		return nil, nil, err
	}
	b, off, ok := buffers.containing(uintptr(ptr))
	if !ok {
		return nil, nil, fmt.Errorf("%w: %#x lies in no buffer of a cudapool pool of this process", errPointer, uintptr(ptr))
	}
	if uint64(size) > b.Size()-off {
		return nil, nil, invalid("%d bytes at offset %d run past the end of its %d-byte buffer", uint64(size), off, b.Size())
	}
	return b, append(metaOpts, producer.Range(off, uint64(size))), nil
}

// metaOptions checks the metadata of a publish (meta_len bytes at meta) and makes the
// option that sends it, none for none.
func metaOptions(meta unsafe.Pointer, metaLen C.size_t) ([]producer.PublishOption, error) {
	switch {
	case metaLen == 0:
		return nil, nil
	case metaLen > maxMeta:
		return nil, invalid("metadata of %d bytes is longer than %d", uint64(metaLen), maxMeta)
	case meta == nil:
		return nil, invalid("meta is NULL with meta_len %d", uint64(metaLen))
	}
	return []producer.PublishOption{producer.WithMeta(C.GoBytes(meta, C.int(metaLen)))}, nil
}

// checkBatch checks the array of n items (called what) at p of a batch call.
func checkBatch(n C.size_t, p unsafe.Pointer, what string) error {
	switch {
	case n == 0:
		return invalid("no %s", what)
	case n > export.MaxBatch:
		return invalid("%d %s: at most %d at once", uint64(n), what, export.MaxBatch)
	case p == nil:
		return invalid("%s is NULL", what)
	}
	return nil
}

//export cpgo_exporter_publish_all
func cpgo_exporter_publish_all(h C.uint64_t, entries *C.cudapool_publish_entry, n C.size_t, s C.uintptr_t) (rc C.int) {
	defer recoverTo(&rc)
	if err := checkBatch(n, unsafe.Pointer(entries), "entries"); err != nil {
		return fail(err)
	}
	ex, err := exporters.get(uint64(h))
	if err != nil {
		return fail(err)
	}
	es := make([]producer.Entry, n)
	for i, e := range unsafe.Slice(entries, int(n)) {
		name, err := goString(e.name, fmt.Sprintf("entries[%d].name", i))
		if err != nil {
			return fail(err)
		}
		b, opts, err := publication(C.uintptr_t(uintptr(e.ptr)), e.size, e.meta, e.meta_len)
		if err != nil {
			return fail(fmt.Errorf("entries[%d] (%q): %w", i, name, err))
		}
		es[i] = producer.Entry{Name: name, Buffer: b, Options: opts}
	}
	return result(ex.PublishAll(context.Background(), es, cudart.Stream(s)))
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
	st, err := discover.QueryState(ctx, path, discover.WithLogger(logger))
	if err != nil {
		return fail(err)
	}
	return result(writeJSON(st, buf, capacity, n))
}

func writeJSON(st *export.State, buf *C.char, capacity C.size_t, n *C.size_t) error {
	b, err := json.Marshal(st)
	if err != nil {
		return err
	}
	return writeOut(unsafe.Pointer(buf), capacity, n, b, true)
}

//export cpgo_importer_dial
func cpgo_importer_dial(path *C.char, device C.int, o *C.cudapool_dial_options, timeoutMs C.int64_t, out *C.uint64_t) (rc C.int) {
	defer recoverTo(&rc)
	if out == nil {
		return fail(invalid("importer is NULL"))
	}
	p, ctx, cancel, err := nameAndContext(path, "path", timeoutMs)
	if err != nil {
		return fail(err)
	}
	defer cancel()
	opts := []consumer.DialOption{consumer.WithLogger(logger)}
	if o != nil {
		if err := options(unsafe.Pointer(o), C.sizeof_cudapool_dial_options, "dial options"); err != nil {
			return fail(err)
		}
		switch f := int(o.flags); {
		case f&^dialWaitForExporter != 0:
			return fail(invalid("unknown dial flags %#x", f&^dialWaitForExporter))
		case f&dialWaitForExporter != 0 && !noWait(ctx):
			opts = append(opts, consumer.WaitForExporter())
		}
	}
	rt, err := runtimeNow()
	if err != nil {
		return fail(err)
	}
	imp, err := consumer.Dial(ctx, p, rt, int(device), opts...)
	if err != nil {
		return fail(err)
	}
	*out = C.uint64_t(importers.add(&importer{Importer: imp}))
	return statusOK
}

// openOptions turns cudapool_open_options into Open's options.
func openOptions(ctx context.Context, o *C.cudapool_open_options) ([]consumer.OpenOption, error) {
	if o == nil {
		return nil, nil
	}
	if err := options(unsafe.Pointer(o), C.sizeof_cudapool_open_options, "open options"); err != nil {
		return nil, err
	}
	f := int(o.flags)
	if f&^(openWaitForName|openLocalCopy) != 0 {
		return nil, invalid("unknown open flags %#x", f&^(openWaitForName|openLocalCopy))
	}
	var opts []consumer.OpenOption
	if f&openWaitForName != 0 && !noWait(ctx) {
		opts = append(opts, consumer.WaitForName())
	}
	switch {
	case f&openLocalCopy == 0 && o.replica_pool.h != 0:
		return nil, invalid("replica_pool without CUDAPOOL_OPEN_LOCAL_COPY")
	case f&openLocalCopy != 0 && o.replica_pool.h == 0:
		opts = append(opts, consumer.WithLocalCopy(nil)) // the Importer's own pool
	case f&openLocalCopy != 0:
		p, err := pools.get(uint64(o.replica_pool.h))
		if err != nil {
			return nil, fmt.Errorf("replica_pool: %w", err)
		}
		opts = append(opts, consumer.WithLocalCopy(p))
	}
	return opts, nil
}

//export cpgo_importer_open
func cpgo_importer_open(h C.uint64_t, name *C.char, s C.uintptr_t, o *C.cudapool_open_options, timeoutMs C.int64_t, out *C.uint64_t) (rc C.int) {
	defer recoverTo(&rc)
	if out == nil {
		return fail(invalid("mapping is NULL"))
	}
	n, ctx, cancel, err := nameAndContext(name, "name", timeoutMs)
	if err != nil {
		return fail(err)
	}
	defer cancel()
	opts, err := openOptions(ctx, o)
	if err != nil {
		return fail(err)
	}
	imp, err := importers.get(uint64(h))
	if err != nil {
		return fail(err)
	}
	m, err := imp.Open(ctx, n, cudart.Stream(s), opts...)
	if err != nil {
		return fail(err)
	}
	*out = C.uint64_t(mappings.add(m))
	return statusOK
}

//export cpgo_importer_open_all
func cpgo_importer_open_all(h C.uint64_t, names **C.char, n C.size_t, s C.uintptr_t, timeoutMs C.int64_t, out *C.uint64_t) (rc C.int) {
	defer recoverTo(&rc)
	if err := checkBatch(n, unsafe.Pointer(names), "names"); err != nil {
		return fail(err)
	}
	if out == nil {
		return fail(invalid("mappings is NULL"))
	}
	ctx, cancel, err := ctxFor(timeoutMs)
	if err != nil {
		return fail(err)
	}
	defer cancel()
	ns := make([]string, n)
	for i, p := range unsafe.Slice(names, int(n)) {
		if ns[i], err = goString(p, fmt.Sprintf("names[%d]", i)); err != nil {
			return fail(err)
		}
	}
	imp, err := importers.get(uint64(h))
	if err != nil {
		return fail(err)
	}
	ms, err := imp.OpenAll(ctx, ns, cudart.Stream(s))
	if err != nil {
		return fail(err)
	}
	hs := unsafe.Slice(out, int(n))
	for i, m := range ms {
		hs[i] = C.uint64_t(mappings.add(m))
	}
	return statusOK
}

//export cpgo_importer_release_all
func cpgo_importer_release_all(h C.uint64_t, hs *C.uint64_t, n C.size_t, s C.uintptr_t, timeoutMs C.int64_t) (rc C.int) {
	defer recoverTo(&rc)
	if err := checkBatch(n, unsafe.Pointer(hs), "mappings"); err != nil {
		return fail(err)
	}
	ctx, cancel, err := ctxFor(timeoutMs)
	if err != nil {
		return fail(err)
	}
	defer cancel()
	imp, err := importers.get(uint64(h))
	if err != nil {
		return fail(err)
	}
	handles := unsafe.Slice(hs, int(n))
	ms := make([]*consumer.Mapping, n)
	seen := make(map[C.uint64_t]int, n)
	for i, mh := range handles {
		if j, ok := seen[mh]; ok {
			return fail(invalid("mappings[%d] and mappings[%d] are one handle, which holds one reference", j, i))
		}
		seen[mh] = i
		if ms[i], err = mappings.get(uint64(mh)); err != nil {
			return fail(fmt.Errorf("mappings[%d]: %w", i, err))
		}
	}
	err = imp.ReleaseAll(ctx, ms, cudart.Stream(s))
	if errors.Is(err, consumer.ErrReleased) || errors.Is(err, export.ErrBadRequest) {
		return fail(err) // refused before anything was released
	}
	for _, mh := range handles {
		_, _ = mappings.remove(uint64(mh)) // a concurrent release may have removed it
	}
	return result(err)
}

//export cpgo_importer_done_fd
func cpgo_importer_done_fd(h C.uint64_t, out *C.int) (rc C.int) {
	defer recoverTo(&rc)
	if out == nil {
		return fail(invalid("fd is NULL"))
	}
	imp, err := importers.get(uint64(h))
	if err != nil {
		return fail(err)
	}
	fd, err := imp.doneFD()
	if err != nil {
		return fail(err)
	}
	*out = C.int(fd)
	return statusOK
}

//export cpgo_importer_err
func cpgo_importer_err(h C.uint64_t) (rc C.int) {
	defer recoverTo(&rc)
	imp, err := importers.get(uint64(h))
	if err != nil {
		return fail(err)
	}
	return result(imp.Err())
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
	err = imp.Close(ctx)
	imp.closeFD()
	return result(err)
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

//export cpgo_mapping_err
func cpgo_mapping_err(h C.uint64_t) (rc C.int) {
	defer recoverTo(&rc)
	m, err := mappings.get(uint64(h))
	if err != nil {
		return fail(err)
	}
	return result(m.Err())
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
