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
	"slices"
	"sync"
	"time"
	"unsafe"

	"github.com/cudapool/cudapool/cudart"
	"github.com/cudapool/cudapool/export"
	"github.com/cudapool/cudapool/kv"
	"github.com/cudapool/cudapool/kv/replica"
)

// The KV pages section of cudapool.h: replicas of a KV page pool's owner (package
// kv/replica), known to C by a handle, and their leases, known to C by their ids.

var kvReplicas = newTable[*kvReplica](kindKVReplica)

// The flags of cudapool_kv_dial.
const kvDialWaitForOwner = 1

// The C enum cudapool_kv_dtype, by kv.DType.
var kvDTypes = map[kv.DType]C.int32_t{
	kv.DTypeBF16:    C.CUDAPOOL_KV_BF16,
	kv.DTypeFP16:    C.CUDAPOOL_KV_FP16,
	kv.DTypeFP32:    C.CUDAPOOL_KV_FP32,
	kv.DTypeFP8E4M3: C.CUDAPOOL_KV_FP8E4M3,
}

// kvReplica is a replica as C holds it: C names a lease by its id alone, so the
// replica's live leases are kept here by id, from alloc or match to seal or release.
type kvReplica struct {
	r         *replica.Replica
	ns        string
	device    int
	reconnect bool // CUDAPOOL_KV_RECONNECT

	mu     sync.Mutex
	leases map[uint64]*replica.Lease

	doneOnce  sync.Once
	doneR     *os.File // readable (at EOF) once the owner is gone
	doneErr   error
	closed    chan struct{} // closed by close, the handle's last use
	closeOnce sync.Once
}

func newKVReplica(r *replica.Replica, ns string, device int) *kvReplica {
	return &kvReplica{r: r, ns: ns, device: device, leases: map[uint64]*replica.Lease{}, closed: make(chan struct{})}
}

// gone is why the replica cannot make requests (its owner is gone: an error wrapping
// kv.ErrOwnerGone), or nil while it can: every call that needs the owner says so
// first, before anything about the leases it names.
func (k *kvReplica) gone() error {
	select {
	case <-k.r.Done():
	default:
		return nil
	}
	if err := k.r.Err(); err != nil {
		return err
	}
	return kv.ErrOwnerGone
}

// take removes the leases ids names, all or none: an id the replica does not hold
// (or one given twice) is an ErrStaleLease error and takes nothing.
func (k *kvReplica) take(ids []uint64) ([]*replica.Lease, error) {
	k.mu.Lock()
	defer k.mu.Unlock()
	ls := make([]*replica.Lease, 0, len(ids))
	for i, id := range ids {
		l, ok := k.leases[id]
		if !ok {
			for _, l := range ls {
				k.leases[l.ID()] = l
			}
			if slices.Contains(ids[:i], id) {
				return nil, fmt.Errorf("%w: lease %#x is given twice", kv.ErrStaleLease, id)
			}
			return nil, notHeld(id)
		}
		delete(k.leases, id)
		ls = append(ls, l)
	}
	return ls, nil
}

// notHeld is the error of a lease id the replica does not hold.
func notHeld(id uint64) error {
	return fmt.Errorf("%w: this replica holds no lease %#x (released or sealed already, another replica's, or never issued)", kv.ErrStaleLease, id)
}

// held is the lease id names, which the replica holds.
func (k *kvReplica) held(id uint64) (*replica.Lease, error) {
	k.mu.Lock()
	defer k.mu.Unlock()
	if l, ok := k.leases[id]; ok {
		return l, nil
	}
	return nil, notHeld(id)
}

// fits checks that lease l has room in the caller's array of n pages (exactly n for
// an alloc), so that no owner's answer writes past it, and that each of its pages is
// one of the slab's; a lease that does not is given back and the call fails as the
// owner's breach of the protocol.
func (k *kvReplica) fits(ctx context.Context, l *replica.Lease, n int, exact bool) error {
	got := len(l.Pages())
	var err error
	switch pages := k.r.Geometry().Pages; {
	case got > n || exact && got < n:
		err = fmt.Errorf("%w: the owner leased %d pages for a request of %d", export.ErrProtocol, got, n)
	default:
		for _, p := range l.Pages() {
			if int64(p) >= int64(pages) {
				err = fmt.Errorf("%w: the owner leased page %d of a slab of %d", export.ErrProtocol, p, pages)
				break
			}
		}
	}
	if err == nil {
		return nil
	}
	return errors.Join(err, k.r.Release(ctx, l, 0))
}

// put keeps leases (new ones, or ones a failed call gave back).
func (k *kvReplica) put(ls ...*replica.Lease) {
	k.mu.Lock()
	for _, l := range ls {
		k.leases[l.ID()] = l
	}
	k.mu.Unlock()
}

// doneFd is the read end of a pipe whose write end is closed once the owner is gone.
func (k *kvReplica) doneFd() (int, error) {
	k.doneOnce.Do(func() {
		r, w, err := os.Pipe()
		if err != nil {
			k.doneErr = err
			return
		}
		k.doneR = r
		go func() {
			select {
			case <-k.r.Done():
			case <-k.closed:
			}
			_ = w.Close() // the signal: the descriptor is closed even when close reports an error
		}()
	})
	if k.doneErr != nil {
		return -1, k.doneErr
	}
	return int(k.doneR.Fd()), nil
}

// close closes the replica (cudapool_kv_close); a second close returns the
// replica's kv.ErrClosed and changes nothing.
func (k *kvReplica) close(ctx context.Context) error {
	err := k.r.Close(ctx)
	k.closeOnce.Do(func() {
		close(k.closed)
		k.doneOnce.Do(func() { k.doneErr = kv.ErrClosed }) // no pipe from now on
		if k.doneR != nil {
			_ = k.doneR.Close() // cleanup: nothing is left to do if closing fails
		}
	})
	return err
}

// forgetStream tells every replica C holds that stream s is about to be destroyed
// (cudapool_stream_destroy), so that none names it to the runtime again: their Close
// would record an event on it, which the driver does not survive on a destroyed
// stream ([replica.Replica.Forget]). A record that fails is logged: the stream goes
// all the same, and that replica's close no longer covers its work.
func forgetStream(s cudart.Stream) {
	for _, k := range kvReplicas.all() {
		if err := k.r.Forget(s); err != nil {
			logger.Warn("cudapool: a kv replica's last record on a stream being destroyed failed; its close does not cover that stream's work", "stream", uintptr(s), "err", err)
		}
	}
}

func kvGet(h C.uint64_t) (*kvReplica, error) { return kvReplicas.get(uint64(h)) }

// kvBegin is what every call to the owner checks first: the context for timeoutMs,
// the replica h names, and that its owner is not gone. The caller calls cancel when err
// is nil.
func kvBegin(h C.uint64_t, timeoutMs C.int64_t) (*kvReplica, context.Context, context.CancelFunc, error) {
	ctx, cancel, err := ctxFor(timeoutMs)
	if err != nil {
		return nil, nil, nil, err
	}
	k, err := kvGet(h)
	if err == nil {
		err = k.gone()
	}
	if err != nil {
		cancel()
		return nil, nil, nil, err
	}
	return k, ctx, cancel, nil
}

// kvHashes copies n hashes from C (the replica may keep them past the call).
func kvHashes(p *C.uint8_t, n C.size_t) ([]kv.Hash, error) {
	switch {
	case n > kv.MaxBatch:
		return nil, fmt.Errorf("%w: %d hashes, over %d per request", kv.ErrTooLarge, uint64(n), kv.MaxBatch)
	case n > 0 && p == nil:
		return nil, invalid("hashes is NULL with n %d", uint64(n))
	}
	hs := make([]kv.Hash, int(n))
	if n > 0 {
		copy(hs, unsafe.Slice((*kv.Hash)(unsafe.Pointer(p)), int(n)))
	}
	return hs, nil
}

// kvBeginHashes is kvBegin for a call that carries the n hashes at p: they are copied
// and checked first.
func kvBeginHashes(h C.uint64_t, timeoutMs C.int64_t, p *C.uint8_t, n C.size_t) (*kvReplica, context.Context, context.CancelFunc, []kv.Hash, error) {
	hs, err := kvHashes(p, n)
	if err != nil {
		return nil, nil, nil, nil, err
	}
	k, ctx, cancel, err := kvBegin(h, timeoutMs)
	return k, ctx, cancel, hs, err
}

// writePages copies a lease's pages to C.
func writePages(out *C.uint32_t, pages []uint32) {
	if len(pages) > 0 {
		copy(unsafe.Slice((*uint32)(unsafe.Pointer(out)), len(pages)), pages)
	}
}

//export cpgo_kv_dial
func cpgo_kv_dial(dir *C.char, device C.int, ns *C.char, nsLen C.size_t, flags C.int, timeoutMs C.int64_t, out *C.uint64_t) (rc C.int) {
	defer recoverTo(&rc)
	if out == nil {
		return fail(invalid("replica is NULL"))
	}
	switch {
	case nsLen > C.CUDAPOOL_KV_MAX_NAMESPACE:
		return fail(invalid("ns_len %d is over CUDAPOOL_KV_MAX_NAMESPACE (%d bytes)", uint64(nsLen), C.CUDAPOOL_KV_MAX_NAMESPACE))
	case nsLen > 0 && ns == nil:
		return fail(invalid("ns is NULL with ns_len %d", uint64(nsLen)))
	}
	if known := C.int(kvDialWaitForOwner | kvDialReconnect); flags&^known != 0 {
		return fail(invalid("unknown dial flags %#x", int(flags&^known)))
	}
	d, ctx, cancel, err := nameAndContext(dir, "dir", timeoutMs)
	if err != nil {
		return fail(err)
	}
	defer cancel()
	if d == "" {
		return fail(invalid("dir is empty"))
	}
	if device < 0 {
		return fail(invalid("device %d is negative", int(device)))
	}
	namespace := ""
	if nsLen > 0 {
		namespace = C.GoStringN(ns, C.int(nsLen))
	}
	rt, err := runtimeNow()
	if err != nil {
		return fail(err)
	}
	opts := []replica.Option{replica.WithNamespace(namespace)}
	if flags&kvDialWaitForOwner != 0 && !noWait(ctx) {
		opts = append(opts, replica.WaitForOwner())
	}
	if flags&kvDialReconnect != 0 {
		opts = append(opts, replica.WithReconnect())
	}
	r, err := replica.Dial(ctx, d, rt, int(device), opts...)
	if err != nil {
		return fail(err)
	}
	k := newKVReplica(r, namespace, int(device))
	k.reconnect = flags&kvDialReconnect != 0
	*out = C.uint64_t(kvReplicas.add(k))
	return statusOK
}

//export cpgo_kv_geometry
func cpgo_kv_geometry(h C.uint64_t, out *C.cudapool_kv_geometry) (rc C.int) {
	defer recoverTo(&rc)
	if out == nil {
		return fail(invalid("geometry is NULL"))
	}
	if out.size < C.size_t(unsafe.Sizeof(out.size)) {
		return fail(invalid("geometry size %d is too small: set it to sizeof(cudapool_kv_geometry)", uint64(out.size)))
	}
	k, err := kvGet(h)
	if err != nil {
		return fail(err)
	}
	g := k.r.Geometry()
	full := C.cudapool_kv_geometry{
		size:            out.size,
		layers:          C.int32_t(g.Layers),
		kv_heads:        C.int32_t(g.KVHeads),
		head_dim:        C.int32_t(g.HeadDim),
		tokens_per_page: C.int32_t(g.TokensPerPage),
		dtype:           kvDTypes[g.DType],
		dtype_size:      C.int32_t(g.DType.Size()),
		pages:           C.int32_t(g.Pages),
		device:          C.int32_t(k.device),
		page_bytes:      C.uint64_t(g.PageBytes()),
		slab_bytes:      C.uint64_t(g.SlabBytes()),
		region_bytes:    C.uint64_t(k.r.Layout().RegionBytes()),
		regions:         C.int32_t(k.r.Layout().Regions()),
		page_span_bytes: C.uint64_t(g.PageSpanBytes()),
	}
	n := min(uintptr(out.size), unsafe.Sizeof(full))
	copy(unsafe.Slice((*byte)(unsafe.Pointer(out)), n), unsafe.Slice((*byte)(unsafe.Pointer(&full)), n))
	return statusOK
}

//export cpgo_kv_slab
func cpgo_kv_slab(h C.uint64_t, base *C.uintptr_t, bytes *C.uint64_t) (rc C.int) {
	defer recoverTo(&rc)
	if base == nil && bytes == nil {
		return fail(invalid("base and bytes are NULL"))
	}
	k, err := kvGet(h)
	if err != nil {
		return fail(err)
	}
	return fail(fmt.Errorf("%w: the slab is %v, a range of addresses per tensor, not one: use cudapool_kv_layer_ptrs (or cudapool_kv_regions)", errNotSup, k.r.Layout()))
}

//export cpgo_kv_layer_ptrs
func cpgo_kv_layer_ptrs(h C.uint64_t, layer C.int32_t, kp, vp *C.uintptr_t) (rc C.int) {
	defer recoverTo(&rc)
	k, err := kvGet(h)
	if err != nil {
		return fail(err)
	}
	if n := k.r.Geometry().Layers; layer < 0 || int(layer) >= n {
		return fail(invalid("layer %d is outside [0, %d)", int(layer), n))
	}
	kb, vb := k.r.Layer(int(layer))
	if kp != nil {
		*kp = C.uintptr_t(kb)
	}
	if vp != nil {
		*vp = C.uintptr_t(vb)
	}
	return statusOK
}

//export cpgo_kv_regions
func cpgo_kv_regions(h C.uint64_t, ptrs *C.uintptr_t, bytes *C.uint64_t, capRegions C.size_t, n *C.size_t) (rc C.int) {
	defer recoverTo(&rc)
	if n == nil {
		return fail(invalid("n is NULL"))
	}
	k, err := kvGet(h)
	if err != nil {
		return fail(err)
	}
	l, addrs := k.r.Layout(), k.r.Regions()
	*n = C.size_t(len(addrs))
	if int(capRegions) < len(addrs) && (ptrs != nil || bytes != nil) {
		return fail(fmt.Errorf("%w: room for %d regions, the slab has %d", errRange, uint64(capRegions), len(addrs)))
	}
	if ptrs != nil {
		out := unsafe.Slice(ptrs, len(addrs))
		for i, a := range addrs {
			out[i] = C.uintptr_t(a)
		}
	}
	if bytes != nil {
		out := unsafe.Slice(bytes, len(addrs))
		for i := range out {
			out[i] = C.uint64_t(l.RegionBytes())
		}
	}
	return statusOK
}

//export cpgo_kv_hashes
func cpgo_kv_hashes(h C.uint64_t, tokens *C.int32_t, nTokens C.size_t, out *C.uint8_t, capHashes C.size_t, n *C.size_t) (rc C.int) {
	defer recoverTo(&rc)
	switch {
	case n == nil:
		return fail(invalid("n_hashes is NULL"))
	case nTokens > 0 && tokens == nil:
		return fail(invalid("tokens is NULL with n_tokens %d", uint64(nTokens)))
	case uint64(nTokens) > maxLen/4:
		return fail(invalid("n_tokens %d is more than the %d tokens the library takes", uint64(nTokens), maxLen/4))
	}
	k, err := kvGet(h)
	if err != nil {
		return fail(err)
	}
	need := int(nTokens) / k.r.Geometry().TokensPerPage
	*n = C.size_t(need)
	if need == 0 {
		return statusOK
	}
	if out == nil || uint64(capHashes) < uint64(need) {
		return fail(fmt.Errorf("%w: %d hashes needed, room for %d", errRange, need, uint64(capHashes)))
	}
	// The hashes go straight into the caller's buffer: it has room for them all.
	dst := unsafe.Slice((*kv.Hash)(unsafe.Pointer(out)), need)[:0]
	kv.AppendPrefixHashes(dst, k.ns, unsafe.Slice((*int32)(unsafe.Pointer(tokens)), int(nTokens)), k.r.Geometry().TokensPerPage)
	return statusOK
}

// maxPrefixNamespace bounds the namespace cudapool_kv_prefix_hashes takes, and
// maxPrefixTokens its tokens: lengths past them are refused, never cut.
const (
	maxPrefixNamespace = 1 << 16
	maxPrefixTokens    = 1 << 32
)

//export cpgo_kv_prefix_hashes
func cpgo_kv_prefix_hashes(ns *C.char, nsLen C.size_t, tokens *C.int32_t, nTokens C.size_t, tokensPerPage C.uint32_t, out *C.uint8_t, capHashes C.size_t, n *C.size_t) (rc C.int) {
	defer recoverTo(&rc)
	switch {
	case n == nil:
		return fail(invalid("n_hashes is NULL"))
	case nsLen > maxPrefixNamespace:
		return fail(invalid("a namespace of %d bytes, at most %d", uint64(nsLen), maxPrefixNamespace))
	case nsLen > 0 && ns == nil:
		return fail(invalid("namespace is NULL with ns_len %d", uint64(nsLen)))
	case nTokens > maxPrefixTokens:
		return fail(invalid("%d tokens, at most %d", uint64(nTokens), uint64(maxPrefixTokens)))
	case nTokens > 0 && tokens == nil:
		return fail(invalid("tokens is NULL with n_tokens %d", uint64(nTokens)))
	case tokensPerPage < 1:
		return fail(invalid("tokens_per_page is 0"))
	}
	need := int(nTokens) / int(tokensPerPage)
	*n = C.size_t(need)
	if need == 0 {
		return statusOK
	}
	if out == nil || int(capHashes) < need {
		return fail(fmt.Errorf("%w: %d hashes needed, room for %d", errRange, need, uint64(capHashes)))
	}
	namespace := ""
	if nsLen > 0 {
		namespace = C.GoStringN(ns, C.int(nsLen))
	}
	dst := unsafe.Slice((*kv.Hash)(unsafe.Pointer(out)), need)[:0]
	kv.AppendPrefixHashes(dst, namespace, unsafe.Slice((*int32)(unsafe.Pointer(tokens)), int(nTokens)), int(tokensPerPage))
	return statusOK
}

//export cpgo_kv_alloc
func cpgo_kv_alloc(h C.uint64_t, n C.uint32_t, timeoutMs C.int64_t, lease *C.uint64_t, pages *C.uint32_t) (rc C.int) {
	defer recoverTo(&rc)
	switch {
	case lease == nil:
		return fail(invalid("lease is NULL"))
	case pages == nil:
		return fail(invalid("pages is NULL"))
	case n > kv.MaxBatch:
		return fail(fmt.Errorf("%w: %d pages, over %d per request", kv.ErrTooLarge, uint32(n), kv.MaxBatch))
	}
	k, ctx, cancel, err := kvBegin(h, timeoutMs)
	if err != nil {
		return fail(err)
	}
	defer cancel()
	l, err := k.alloc(ctx, int(n))
	if err != nil {
		return fail(err)
	}
	writePages(pages, l.Pages())
	*lease = C.uint64_t(l.ID())
	return statusOK
}

// alloc leases n pages for writing and keeps the lease (cudapool_kv_alloc).
func (k *kvReplica) alloc(ctx context.Context, n int) (*replica.Lease, error) {
	l, err := k.r.Alloc(ctx, n)
	if err != nil {
		return nil, err
	}
	if err := k.fits(ctx, l, n, true); err != nil {
		return nil, err
	}
	k.put(l)
	return l, nil
}

// match leases the longest visible run of hs for reading and keeps the lease if it
// has pages (cudapool_kv_match).
func (k *kvReplica) match(ctx context.Context, hs []kv.Hash) (*replica.Lease, error) {
	l, err := k.r.Match(ctx, hs)
	if err != nil {
		return nil, err
	}
	if err := k.fits(ctx, l, len(hs), false); err != nil {
		return nil, err
	}
	if len(l.Pages()) > 0 {
		k.put(l)
	}
	return l, nil
}

//export cpgo_kv_seal
func cpgo_kv_seal(h C.uint64_t, id C.uint64_t, hashes *C.uint8_t, n C.size_t, s C.uintptr_t, wait C.int, timeoutMs C.int64_t, visible, duplicates *C.uint32_t) (rc C.int) {
	defer recoverTo(&rc)
	k, ctx, cancel, hs, err := kvBeginHashes(h, timeoutMs, hashes, n)
	if err != nil {
		return fail(err)
	}
	defer cancel()
	res, err := k.seal(ctx, uint64(id), hs, cudart.Stream(s), wait != 0)
	if err != nil {
		return fail(err)
	}
	if visible != nil {
		*visible = C.uint32_t(res.Visible)
	}
	if duplicates != nil {
		*duplicates = C.uint32_t(res.Duplicates)
	}
	return statusOK
}

// seal seals the write lease id under hs after s's work (cudapool_kv_seal).
func (k *kvReplica) seal(ctx context.Context, id uint64, hs []kv.Hash, s cudart.Stream, wait bool) (replica.SealResult, error) {
	ls, err := k.take([]uint64{id})
	if err != nil {
		return replica.SealResult{}, err
	}
	l := ls[0]
	if !l.Writable() {
		k.put(l)
		return replica.SealResult{}, invalid("lease %#x is a read lease (from a match): only a write lease is sealed", id)
	}
	if len(hs) > len(l.Pages()) {
		k.put(l)
		return replica.SealResult{}, fmt.Errorf("%w: %d hashes for a lease of %d pages", kv.ErrGeometry, len(hs), len(l.Pages()))
	}
	var opts []replica.SealOption
	if wait {
		opts = append(opts, replica.WaitVisible())
	}
	res, err := k.r.Seal(ctx, l, hs, s, opts...)
	if err != nil {
		k.afterFailure(err, s, l)
	}
	return res, err
}

//export cpgo_kv_match
func cpgo_kv_match(h C.uint64_t, hashes *C.uint8_t, n C.size_t, _ C.uintptr_t, timeoutMs C.int64_t, lease *C.uint64_t, pages *C.uint32_t, nPages *C.size_t) (rc C.int) {
	defer recoverTo(&rc)
	switch {
	case lease == nil:
		return fail(invalid("lease is NULL"))
	case nPages == nil:
		return fail(invalid("n_pages is NULL"))
	case n > 0 && pages == nil:
		return fail(invalid("pages is NULL"))
	}
	k, ctx, cancel, hs, err := kvBeginHashes(h, timeoutMs, hashes, n)
	if err != nil {
		return fail(err)
	}
	defer cancel()
	l, err := k.match(ctx, hs)
	if err != nil {
		return fail(err)
	}
	*lease, *nPages = 0, 0
	if got := l.Pages(); len(got) > 0 {
		writePages(pages, got)
		*lease, *nPages = C.uint64_t(l.ID()), C.size_t(len(got))
	}
	return statusOK
}

//export cpgo_kv_release
func cpgo_kv_release(h C.uint64_t, leases *C.uint64_t, n C.size_t, s C.uintptr_t, timeoutMs C.int64_t) (rc C.int) {
	defer recoverTo(&rc)
	switch {
	case n > kv.MaxBatch:
		return fail(fmt.Errorf("%w: %d leases, over %d per request", kv.ErrTooLarge, uint64(n), kv.MaxBatch))
	case n > 0 && leases == nil:
		return fail(invalid("leases is NULL with n %d", uint64(n)))
	case n == 0:
		return statusOK
	}
	k, ctx, cancel, err := kvBegin(h, timeoutMs)
	if err != nil {
		return fail(err)
	}
	defer cancel()
	return result(k.release(ctx, unsafe.Slice((*uint64)(unsafe.Pointer(leases)), int(n)), cudart.Stream(s)))
}

// release gives back the leases ids names after s's work (cudapool_kv_release).
func (k *kvReplica) release(ctx context.Context, ids []uint64, s cudart.Stream) error {
	ls, err := k.take(ids)
	if err != nil {
		return err
	}
	err = k.r.ReleaseAll(ctx, ls, s)
	if err != nil {
		k.afterFailure(err, s, ls...)
	}
	return err
}

// afterFailure settles the leases of a seal or release that failed with err:
//   - the owner is gone and the replica reconnects (CUDAPOOL_KV_RECONNECT): they are
//     kept, to be re-declared to the restarted owner and made again;
//   - the owner is gone or the replica closed, or a restart lost them: they are gone;
//   - the call ran out of time: it may have reached the owner, which then ended them,
//     or not. The C call holds nothing either way (CUDAPOOL_ETIMEOUT's promise), so
//     the table forgets them and they are released again after s, with a bound of
//     their own: the owner ends those it still holds and refuses the rest as stale,
//     an answer no one needs;
//   - else (the seal's event could not be recorded, a release refused whole for one
//     stale lease among them) the owner ended none: they are kept.
func (k *kvReplica) afterFailure(err error, s cudart.Stream, ls ...*replica.Lease) {
	switch {
	case k.keepsLeasesWhenGone(err):
		k.put(ls...) // still held, to be re-declared to the restarted owner
	case errors.Is(err, kv.ErrOwnerGone) || errors.Is(err, kv.ErrClosed) || errors.Is(err, kv.ErrLeaseLost):
	case errors.Is(err, context.DeadlineExceeded) || errors.Is(err, context.Canceled):
		ctx, cancel := context.WithTimeout(context.Background(), giveBackTimeout)
		defer cancel()
		_ = k.r.ReleaseAll(ctx, ls, s) // the usual answer is stale: the owner had ended them
	default:
		k.put(ls...)
	}
}

// giveBackTimeout bounds the release that follows a seal or release that ran out of
// time: its answer is waited for no longer (it is read and dropped later).
const giveBackTimeout = 100 * time.Millisecond

//export cpgo_kv_done_fd
func cpgo_kv_done_fd(h C.uint64_t, fd *C.int) (rc C.int) {
	defer recoverTo(&rc)
	if fd == nil {
		return fail(invalid("fd is NULL"))
	}
	k, err := kvGet(h)
	if err != nil {
		return fail(err)
	}
	f, err := k.doneFd()
	if err != nil {
		return fail(err)
	}
	*fd = C.int(f)
	return statusOK
}

//export cpgo_kv_alive
func cpgo_kv_alive(h C.uint64_t, alive *C.int) (rc C.int) {
	defer recoverTo(&rc)
	if alive == nil {
		return fail(invalid("alive is NULL"))
	}
	k, err := kvGet(h)
	if err != nil {
		return fail(err)
	}
	*alive = 1
	if k.gone() != nil {
		*alive = 0
	}
	return statusOK
}

//export cpgo_kv_error
func cpgo_kv_error(h C.uint64_t, buf *C.char, capacity C.size_t, n *C.size_t) (rc C.int) {
	defer recoverTo(&rc)
	k, err := kvGet(h)
	if err != nil {
		return fail(err)
	}
	msg := ""
	if err := k.gone(); err != nil {
		msg = err.Error()
	}
	return result(writeOut(unsafe.Pointer(buf), capacity, n, []byte(msg), true))
}

//export cpgo_kv_close
func cpgo_kv_close(h C.uint64_t, timeoutMs C.int64_t) (rc C.int) {
	defer recoverTo(&rc)
	ctx, cancel, err := ctxFor(timeoutMs)
	if err != nil {
		return fail(err)
	}
	defer cancel()
	k, err := kvReplicas.remove(uint64(h))
	if err != nil {
		return fail(err)
	}
	return result(k.close(ctx))
}

//export cpgo_kv_stats
func cpgo_kv_stats(h C.uint64_t, timeoutMs C.int64_t, buf *C.char, capacity C.size_t, n *C.size_t) (rc C.int) {
	defer recoverTo(&rc)
	if n == nil {
		return fail(invalid("len is NULL"))
	}
	k, ctx, cancel, err := kvBegin(h, timeoutMs)
	if err != nil {
		return fail(err)
	}
	defer cancel()
	st, err := k.r.Stats(ctx)
	return writeStats(st, err, buf, capacity, n)
}

//export cpgo_kv_query_stats
func cpgo_kv_query_stats(dir *C.char, timeoutMs C.int64_t, buf *C.char, capacity C.size_t, n *C.size_t) (rc C.int) {
	defer recoverTo(&rc)
	if n == nil {
		return fail(invalid("len is NULL"))
	}
	d, ctx, cancel, err := nameAndContext(dir, "dir", timeoutMs)
	if err != nil {
		return fail(err)
	}
	defer cancel()
	if d == "" {
		return fail(invalid("dir is empty"))
	}
	st, err := replica.QueryStats(ctx, d)
	return writeStats(st, err, buf, capacity, n)
}

// writeStats writes st as JSON into (buf, capacity, n), or fails with err.
func writeStats(st kv.Stats, err error, buf *C.char, capacity C.size_t, n *C.size_t) C.int {
	if err != nil {
		return fail(err)
	}
	b, err := json.Marshal(st)
	if err != nil {
		return fail(err)
	}
	return result(writeOut(unsafe.Pointer(buf), capacity, n, b, true))
}
