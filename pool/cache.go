package pool

import (
	"errors"
	"math/bits"
	"slices"

	"github.com/cudapool/cudapool/cudart"
)

// The cache (WithCache) keeps freed buffers for the next Alloc of a fitting size on
// the stream they were freed on, which takes one without calling the driver. Stream
// order is what makes that safe without an event: the work queued on s before Free
// runs before the work queued on s after the Alloc that reuses the memory. An Alloc
// on another stream goes to the driver, which orders reuse across streams itself.
//
// A buffer that was shared is cached only after its importers' completions: Free
// makes its stream wait for them, and a deferred free, whose stream may be gone by the
// time the last lease ends, leaves an event that the taking stream waits for.

// cacheScan bounds how many buffers of a size class an Alloc looks at before it gives
// up and asks the driver.
const cacheScan = 4

// cached is a buffer's memory waiting in the cache.
type cached struct {
	ptr      cudart.DevicePtr
	reserved uint64
	// record is the buffer's export record, if it was exported: a recycled buffer is
	// not exported again.
	record *cudart.PtrExportData
	// ready is 0, or a pool event that the taking stream must wait for first.
	ready cudart.Event
	// retained is the memory's retentions, handed to the next buffer.
	retained *retainSet
}

// streamCache holds the buffers freed on one stream, a list per size class. A stream
// sees few sizes, so the lists are searched in a row.
type streamCache struct {
	s       cudart.Stream
	classes []classList
}

type classList struct {
	class   uint32
	entries []cached
}

// cache is the pool's cache, guarded by Pool.mu except limit, which New sets.
type cache struct {
	limit        uint64
	bytes        uint64 // cached, and claimed by frees on their way in
	buffers      int
	hits, misses uint64
	last         *streamCache // the stream used last, found without the map
	streams      map[cudart.Stream]*streamCache
}

// stream returns s's lists, making them if create is set, and nil otherwise.
func (c *cache) stream(s cudart.Stream, create bool) *streamCache {
	if c.last != nil && c.last.s == s {
		return c.last
	}
	sc := c.streams[s]
	if sc == nil {
		if !create {
			return nil
		}
		if c.streams == nil {
			c.streams = map[cudart.Stream]*streamCache{}
		}
		sc = &streamCache{s: s}
		c.streams[s] = sc
	}
	c.last = sc
	return sc
}

// list returns the list of a size class, making it if create is set, and nil
// otherwise. The pointer is good until the next list made.
func (sc *streamCache) list(class uint32, create bool) *classList {
	for i := range sc.classes {
		if sc.classes[i].class == class {
			return &sc.classes[i]
		}
	}
	if !create {
		return nil
	}
	sc.classes = append(sc.classes, classList{class: class})
	return &sc.classes[len(sc.classes)-1]
}

// sizeClass groups sizes four classes to a power of two, so that a cached buffer
// serves a request for less than a quarter below its size, and no smaller one.
func sizeClass(n uint64) uint32 {
	if n <= 4 {
		return uint32(n)
	}
	e := bits.Len64(n - 1) // 2^(e-1) < n <= 2^e, e >= 3
	return uint32(e)<<2 | uint32((n-1)>>(e-3)&3)
}

// take removes and returns the newest of the last few buffers that hold at least
// reserved bytes.
func (l *classList) take(reserved uint64) (cached, bool) {
	if n := len(l.entries); n > 0 && l.entries[n-1].reserved >= reserved {
		c := l.entries[n-1]
		l.entries[n-1] = cached{}
		l.entries = l.entries[:n-1]
		return c, true
	}
	for i := len(l.entries) - 2; i >= 0 && i >= len(l.entries)-cacheScan; i-- {
		if c := l.entries[i]; c.reserved >= reserved {
			l.entries = slices.Delete(l.entries, i, i+1)
			return c, true
		}
	}
	return cached{}, false
}

// perThreadStream is cudaStreamPerThread: the default stream of whichever OS thread
// makes the call, so two calls with it, which a goroutine may make from two threads,
// are not ordered. The cache leaves its buffers to the driver.
const perThreadStream cudart.Stream = 2

// claimCacheLocked counts n bytes freed on s into the cache if they fit under its
// limit. Call with pool.mu held.
func (p *Pool) claimCacheLocked(s cudart.Stream, n uint64) bool {
	if p.cache.limit == 0 || s == perThreadStream || n > p.cache.limit-p.cache.bytes {
		return false
	}
	p.cache.bytes += n
	return true
}

// cacheLocked puts b, freed on s and already claimed, in the cache, and takes it out
// of the pool's live buffers. Call with pool.mu held.
func (p *Pool) cacheLocked(b *Buffer, s cudart.Stream, ready cudart.Event) {
	b.state = bufFreed
	p.forget(b)
	p.pushLocked(s, cached{ptr: b.ptr, reserved: b.reserved, record: b.record.Load(), ready: ready, retained: b.retained})
	p.freedLocked()
}

func (p *Pool) pushLocked(s cudart.Stream, c cached) {
	l := p.cache.stream(s, true).list(sizeClass(c.reserved), true)
	l.entries = append(l.entries, c)
	p.cache.buffers++
}

// allocCached fills b with a cached buffer freed on s that fits, and reports whether
// it found one. Call inside the gate.
func (p *Pool) allocCached(b *Buffer, s cudart.Stream) (bool, error) {
	class := sizeClass(b.reserved)
	p.mu.Lock()
	var c cached
	ok := false
	if sc := p.cache.stream(s, false); sc != nil {
		if l := sc.list(class, false); l != nil {
			c, ok = l.take(b.reserved)
		}
	}
	if !ok {
		p.mu.Unlock()
		return false, nil // the driver's Alloc counts the miss
	}
	// Counted now, so that Stats never shows the cache short of a buffer without a
	// hit to account for it; a failed wait below takes it back.
	p.cache.hits++
	p.cache.buffers--
	p.cache.bytes -= c.reserved
	b.ptr, b.reserved, b.retained = c.ptr, c.reserved, c.retained
	b.record.Store(c.record)
	if c.ready == 0 {
		p.remember(b)
		p.mu.Unlock()
		return true, nil
	}
	p.counts.bytesPending += c.reserved // still held while s is made to wait
	p.mu.Unlock()
	err := p.rt.StreamWaitEvent(p.dev, s, c.ready)
	p.mu.Lock()
	p.counts.bytesPending -= c.reserved
	if err != nil {
		p.cache.hits--
		p.cache.bytes += c.reserved
		p.pushLocked(s, c)
		p.mu.Unlock()
		return true, p.errorf("alloc %s: stream %#x waiting for a cached buffer's importers: %w", human(b.size), uintptr(s), err)
	}
	p.remember(b)
	p.mu.Unlock()
	p.putEvent(c.ready)
	return true, nil
}

// cacheShared caches b, which was shared and has no live leases, for reuse on s once
// the release stream's work so far (the importers' completions it waited for) has
// completed. With now, s is the stream Free was given, and waits for that at once, so
// that a hit costs no call; otherwise the cached buffer keeps an event for the taking
// stream to wait for. It reports false, changing nothing, if the cache has no room or
// CUDA fails. Call inside the gate with b.state bufFreeing.
func (p *Pool) cacheShared(b *Buffer, s cudart.Stream, now bool) bool {
	p.mu.Lock()
	ok := p.claimCacheLocked(s, b.reserved)
	if ok && now && !b.ordered {
		// Its leases' completions were all settled on s (or known done): the
		// release stream holds nothing this buffer waits for.
		p.cacheLocked(b, s, 0)
		p.mu.Unlock()
		return true
	}
	p.mu.Unlock()
	if !ok {
		return false
	}
	rel, err := p.releaseStream()
	var ready cudart.Event
	if err == nil {
		ready, err = p.recordOn(rel)
	}
	if err == nil && now {
		err = p.rt.StreamWaitEvent(p.dev, s, ready)
		p.putEvent(ready)
		ready = 0
	}
	p.mu.Lock()
	defer p.mu.Unlock()
	if err != nil {
		p.cache.bytes -= b.reserved
		return false
	}
	p.cacheLocked(b, s, ready)
	return true
}

// Trim returns every cached buffer to the driver: one freed on a stream is freed on
// that stream, one that waits for importers on the release stream after them. A free
// that fails leaves its memory reserved; the failure wraps [ErrFreeFailed], and [Stats]
// counts it and Close reports it as it does a failed deferred free. It fails with
// [ErrClosed] after Close.
//
// A cached buffer is freed on its stream, so a stream that buffers were freed on must
// outlive their time in the cache: call TrimStream before destroying it. (CUDA may
// give a new stream the handle of a destroyed one, and an Alloc on it would then take
// memory that the old stream's last work may still be using.)
func (p *Pool) Trim() error {
	if !p.gate.enter() {
		return p.closedError("trim")
	}
	defer p.gate.leave()
	_, _, errs := p.trim(func(cudart.Stream) bool { return true }, false)
	return errors.Join(errs...)
}

// TrimStream is Trim for the buffers freed on s only.
func (p *Pool) TrimStream(s cudart.Stream) error {
	if !p.gate.enter() {
		return p.closedError("trim")
	}
	defer p.gate.leave()
	_, _, errs := p.trim(func(c cudart.Stream) bool { return c == s }, false)
	return errors.Join(errs...)
}

// trim frees the cached buffers of the streams that match, and returns what it freed.
// Memory that importers retain goes back once they let go (see retain); closing, it
// is abandoned instead, as there is no one left to wait for them. Call inside the
// gate, or from Close once no call can be inside.
func (p *Pool) trim(match func(cudart.Stream) bool, closing bool) (freed, abandoned cacheFigures, errs []error) {
	type entry struct {
		s cudart.Stream
		c cached
	}
	var out []entry
	p.mu.Lock()
	for s, sc := range p.cache.streams {
		if !match(s) {
			continue
		}
		for _, l := range sc.classes {
			for _, c := range l.entries {
				out = append(out, entry{s, c})
				p.cache.buffers--
				p.cache.bytes -= c.reserved
			}
		}
		delete(p.cache.streams, s)
		if p.cache.last == sc {
			p.cache.last = nil
		}
	}
	p.mu.Unlock()
	for _, e := range out {
		if e.c.retained != nil {
			if closing && p.retainedEntry(e.c) {
				abandoned.buffers++
				abandoned.bytes += e.c.reserved
				continue
			}
			if err := p.retireCached(e.s, e.c); err != nil {
				errs = append(errs, err)
			}
			continue
		}
		if err := p.freeCached(e.s, e.c); err != nil {
			err = p.errorf("%w: cached buffer (%s at %#x): %w", ErrFreeFailed, human(e.c.reserved), uintptr(e.c.ptr), err)
			errs = append(errs, err)
			p.mu.Lock()
			p.failed = append(p.failed, err)
			p.counts.failedFreeBytes += e.c.reserved
			p.mu.Unlock()
			continue
		}
		freed.buffers++
		freed.bytes += e.c.reserved
	}
	if freed.buffers > 0 {
		p.wakeWaiters()
	}
	return freed, abandoned, errs
}

func (p *Pool) retainedEntry(c cached) bool {
	p.mu.Lock()
	defer p.mu.Unlock()
	return c.retained.holds()
}

// retireCached returns cached memory that importers retain, or retained once, to the
// driver on the release stream (which waited for their completions) after the point
// its stream had reached, once they let go.
func (p *Pool) retireCached(s cudart.Stream, c cached) error {
	after := c.ready
	if after == 0 {
		ev, err := p.recordOn(s)
		if err != nil {
			// Without that point the memory cannot be ordered: it stays reserved.
			err = p.errorf("%w: cached buffer (%s at %#x): %w", ErrFreeFailed, human(c.reserved), uintptr(c.ptr), err)
			p.mu.Lock()
			p.failed = append(p.failed, err)
			p.counts.failedFreeBytes += c.reserved
			p.mu.Unlock()
			return err
		}
		after = ev
	}
	return p.retire(c.retained, c.ptr, c.reserved, after)
}

type cacheFigures struct {
	buffers int
	bytes   uint64
}

// freeCached returns one cached buffer to the driver.
func (p *Pool) freeCached(s cudart.Stream, c cached) error {
	if c.ready == 0 {
		return p.rt.FreeAsync(p.dev, c.ptr, s)
	}
	rel, err := p.releaseStream()
	if err == nil {
		err = p.rt.StreamWaitEvent(p.dev, rel, c.ready)
	}
	p.putEvent(c.ready)
	if err != nil {
		return err
	}
	return p.rt.FreeAsync(p.dev, c.ptr, rel)
}

// holdsCache reports whether the cache holds a buffer.
func (p *Pool) holdsCache() bool {
	if p.cache.limit == 0 {
		return false
	}
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.cache.buffers > 0
}
