package main

import (
	"fmt"
	"maps"
	"slices"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/cudapool/cudapool/cudart"
)

// callCounter is a runtime that counts the calls a share makes on the host and the
// time they take there, so that a window's rate can be told apart into what each
// side did per share: a wait on another process's event that the host had to make,
// an import or a free, or a call that blocked. The windows print them:
//
//	calls IMPL OP ROUND SIDE CALL COUNT MS MAX_MS
//
// SIDE is producer (the exporter's process: its pool and exporter), consumers (all
// of them, summed), or recycling (the producer, retiring the last window's buffers and
// recycling them for this one, before the window). CALL is a runtime call, EventQuery/pending for the queries that
// found the work not done, or the consumer's own Open, Release, OpenAll and
// ReleaseAll (their whole time, round trip included).
type callCounter struct {
	cudart.Runtime
	mu      sync.Mutex
	tallies map[string]*tally
}

// tally is how often one call was made, and its time.
type tally struct {
	n          int
	total, max time.Duration
}

func newCallCounter(rt cudart.Runtime) *callCounter {
	return &callCounter{Runtime: rt, tallies: map[string]*tally{}}
}

// note counts one call of name that began at start.
func (c *callCounter) note(name string, start time.Time) {
	d := time.Since(start)
	c.mu.Lock()
	t := c.tallies[name]
	if t == nil {
		t = &tally{}
		c.tallies[name] = t
	}
	t.n++
	t.total += d
	t.max = max(t.max, d)
	c.mu.Unlock()
}

// take returns the tallies since the last take, and starts again.
func (c *callCounter) take() map[string]tally {
	c.mu.Lock()
	defer c.mu.Unlock()
	out := make(map[string]tally, len(c.tallies))
	for name, t := range c.tallies {
		out[name] = *t
	}
	clear(c.tallies)
	return out
}

// encode writes tallies as one line's fields: CALL COUNT NS MAX_NS, repeated.
func encode(ts map[string]tally) string {
	var b strings.Builder
	for _, name := range slices.Sorted(maps.Keys(ts)) {
		t := ts[name]
		fmt.Fprintf(&b, " %s %d %d %d", name, t.n, t.total.Nanoseconds(), t.max.Nanoseconds())
	}
	return b.String()
}

// decode adds the tallies encode wrote in fields to into.
func decode(fields []string, into map[string]tally) error {
	if len(fields)%4 != 0 {
		return fmt.Errorf("calls: %d fields, not groups of 4", len(fields))
	}
	for i := 0; i < len(fields); i += 4 {
		var v [3]int64
		for j := range v {
			x, err := strconv.ParseInt(fields[i+1+j], 10, 64)
			if err != nil {
				return fmt.Errorf("calls: %q: %w", fields[i+1+j], err)
			}
			v[j] = x
		}
		t := into[fields[i]]
		t.n += int(v[0])
		t.total += time.Duration(v[1])
		t.max = max(t.max, time.Duration(v[2]))
		into[fields[i]] = t
	}
	return nil
}

func (c *callCounter) StreamSynchronize(dev int, s cudart.Stream) error {
	defer c.note("StreamSynchronize", time.Now())
	return c.Runtime.StreamSynchronize(dev, s)
}

func (c *callCounter) StreamWaitEvent(dev int, s cudart.Stream, e cudart.Event) error {
	defer c.note("StreamWaitEvent", time.Now())
	return c.Runtime.StreamWaitEvent(dev, s, e)
}

func (c *callCounter) EventRecord(dev int, e cudart.Event, s cudart.Stream) error {
	defer c.note("EventRecord", time.Now())
	return c.Runtime.EventRecord(dev, e, s)
}

func (c *callCounter) EventSynchronize(dev int, e cudart.Event) error {
	defer c.note("EventSynchronize", time.Now())
	return c.Runtime.EventSynchronize(dev, e)
}

func (c *callCounter) EventQuery(dev int, e cudart.Event) (bool, error) {
	start := time.Now()
	done, err := c.Runtime.EventQuery(dev, e)
	c.note("EventQuery", start)
	if err == nil && !done {
		c.note("EventQuery/pending", start)
	}
	return done, err
}

func (c *callCounter) IpcOpenEventHandle(dev int, h cudart.IpcEventHandle) (cudart.Event, error) {
	defer c.note("IpcOpenEventHandle", time.Now())
	return c.Runtime.IpcOpenEventHandle(dev, h)
}

func (c *callCounter) MallocFromPoolAsync(dev int, size uint64, p cudart.MemPool, s cudart.Stream) (cudart.DevicePtr, error) {
	defer c.note("MallocFromPoolAsync", time.Now())
	return c.Runtime.MallocFromPoolAsync(dev, size, p, s)
}

func (c *callCounter) FreeAsync(dev int, ptr cudart.DevicePtr, s cudart.Stream) error {
	defer c.note("FreeAsync", time.Now())
	return c.Runtime.FreeAsync(dev, ptr, s)
}

func (c *callCounter) MemPoolExportPointer(dev int, ptr cudart.DevicePtr) (cudart.PtrExportData, error) {
	defer c.note("MemPoolExportPointer", time.Now())
	return c.Runtime.MemPoolExportPointer(dev, ptr)
}

func (c *callCounter) MemPoolImportPointer(dev int, p cudart.MemPool, data cudart.PtrExportData) (cudart.DevicePtr, error) {
	defer c.note("MemPoolImportPointer", time.Now())
	return c.Runtime.MemPoolImportPointer(dev, p, data)
}

func (c *callCounter) MemcpyDtoHAsync(dev int, dst []byte, src cudart.DevicePtr, s cudart.Stream) error {
	defer c.note("MemcpyDtoHAsync", time.Now())
	return c.Runtime.MemcpyDtoHAsync(dev, dst, src, s)
}
