// Package kvtest owns scripted owners of a KV page pool, for tests of replicas (Go's
// kv/replica, and C's and Python's through capi): an owner's page socket that answers
// by rule, with a slab of its own on the VMM route, and fails on cue.
package kvtest

import (
	"fmt"
	"maps"
	"net"
	"os"
	"path/filepath"
	"slices"
	"sync"
	"testing"

	"golang.org/x/sys/unix"

	"github.com/cudapool/cudapool/cudart"
	"github.com/cudapool/cudapool/internal/unixfd"
	"github.com/cudapool/cudapool/kv"
	"github.com/cudapool/cudapool/kv/internal/kvwire"
	"github.com/cudapool/cudapool/vmm"
)

// Echo serves a directory whose page socket answers as an owner of a slab of its own
// (every chunk mapped, the same slab for every connection) under which every page is
// visible: a Match leases, under a
// fresh lease id, page Page(h) for each hash h asked, so that a reply names the request
// it answers; a Release ends the leases it names if the owner holds them all, and is
// refused with kv.ErrStaleLease otherwise; a Reattach is kept; anything else is
// refused. Each connection stands for an owner of its own, as after a restart: it
// holds the leases it granted and those re-declared to it. Its methods are safe for
// concurrent use.
type Echo struct {
	dir    string
	geo    kv.Geometry
	chunk  uint64
	fds    []int // the slab's chunks
	listed chan struct{}

	mu    sync.Mutex
	lease uint64          // the last lease id granted
	held  map[uint64]bool // the leases the latest connection's owner holds
	die   bool            // the next Release ends its connection unanswered
	gate  chan struct{}   // while not nil, replies wait for it to close (HoldReplies)
	gated chan struct{}   // told that a reply waits at the gate
}

// NewEcho serves a new directory with a slab of geometry g made on device 0 of rt (its
// chunks' descriptors alone: Echo maps nothing). It stops at t's end.
func NewEcho(t testing.TB, rt cudart.Runtime, g kv.Geometry) *Echo {
	t.Helper()
	dir, err := os.MkdirTemp("", "kvecho") // short: a socket's path has at most 107 bytes
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = os.RemoveAll(dir) }) // the test's end
	gran, err := vmm.Granularity(rt, 0, cudart.HandleTypePosixFD)
	if err != nil {
		t.Fatal(err)
	}
	e := &Echo{dir: dir, geo: g, chunk: kv.DefaultChunkBytes(g, gran), listed: make(chan struct{}, 1), held: map[uint64]bool{}}
	l, err := g.SlabLayout(e.chunk)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		for _, fd := range e.fds {
			_ = unix.Close(fd) // the test's end
		}
	})
	for range l.Chunks() {
		c, err := vmm.NewChunk(rt, 0, e.chunk)
		if err != nil {
			t.Fatal(err)
		}
		fd, err := c.Export()
		_ = c.Close() // the descriptor keeps the memory
		if err != nil {
			t.Fatal(err)
		}
		e.fds = append(e.fds, fd)
	}
	ln, err := net.Listen("unix", filepath.Join(dir, kvwire.PageSocket))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = ln.Close() }) // the test's end
	go func() {
		for {
			nc, err := ln.Accept()
			if err != nil {
				return
			}
			go e.serve(nc)
		}
	}()
	return e
}

// Dir is the directory Echo serves, for a replica to dial.
func (e *Echo) Dir() string { return e.dir }

// Pages are the pages Echo leases for hashes: each one's first byte, modulo the slab's
// pages.
func (e *Echo) Pages(hashes []kv.Hash) []uint32 {
	pages := make([]uint32, len(hashes))
	for i, h := range hashes {
		pages[i] = uint32(int(h[0]) % e.geo.Pages)
	}
	return pages
}

// Leases are the lease ids the latest connection's owner holds, in order.
func (e *Echo) Leases() []uint64 {
	e.mu.Lock()
	defer e.mu.Unlock()
	return slices.Sorted(maps.Keys(e.held))
}

// Listed receives as a connection's re-declaration of leases ends (it holds one
// such news, and drops the others while it does).
func (e *Echo) Listed() <-chan struct{} { return e.listed }

// DieAtNextRelease makes the next Release end its connection unanswered, ending
// none of the leases it names, as an owner killed as the request came.
func (e *Echo) DieAtNextRelease() {
	e.mu.Lock()
	e.die = true
	e.mu.Unlock()
}

// HoldReplies makes every reply wait, after its request has been acted on, until
// resume is called; waiting receives as a reply starts to wait.
func (e *Echo) HoldReplies() (waiting <-chan struct{}, resume func()) {
	gate, gated := make(chan struct{}), make(chan struct{}, 1)
	e.mu.Lock()
	e.gate, e.gated = gate, gated
	e.mu.Unlock()
	return gated, func() {
		e.mu.Lock()
		e.gate = nil
		e.mu.Unlock()
		close(gate)
	}
}

// serve answers one connection, a new owner's: Hello with Welcome, then each request,
// until Bye or the end of the connection.
func (e *Echo) serve(nc net.Conn) {
	defer func() { _ = nc.Close() }() // the connection ends: nothing is left to do if closing fails
	held := map[uint64]bool{}
	e.mu.Lock()
	e.held = held
	e.mu.Unlock()
	rd := kvwire.NewReader()
	if _, _, err := rd.Next(nc); err != nil {
		return
	}
	welcome, err := kvwire.AppendWelcome(nil, 0, kvwire.Welcome{Geometry: e.geo, ChunkBytes: e.chunk, Chunks: uint32(len(e.fds)), Slab: kvwire.SlabName(0, 1)})
	if err != nil {
		return // the replica's Dial fails, and its test says so
	}
	if _, err := nc.Write(welcome); err != nil {
		return
	}
	for i, fd := range e.fds {
		b, err := kvwire.AppendGrow(nil, kvwire.Grow{Chunk: uint32(i)})
		if err != nil || unixfd.Send(nc.(*net.UnixConn), b, fd) != nil {
			return
		}
	}
	for {
		h, p, err := rd.Next(nc)
		if err != nil || h.Type == kvwire.TypeBye {
			return
		}
		b, ok := e.answer(held, h, p)
		if !ok {
			return
		}
		e.mu.Lock()
		gate, gated := e.gate, e.gated
		e.mu.Unlock()
		if gate != nil {
			select {
			case gated <- struct{}{}:
			default:
			}
			<-gate
		}
		if _, err := nc.Write(b); err != nil {
			return
		}
	}
}

// answer is the reply to request h (payload p) of the owner holding held; false where
// the owner dies unanswering.
func (e *Echo) answer(held map[uint64]bool, h kvwire.Header, p []byte) ([]byte, bool) {
	e.mu.Lock()
	defer e.mu.Unlock()
	var b []byte
	switch h.Type {
	case kvwire.TypeMatch:
		m, err := kvwire.DecodeMatch(p)
		if err != nil {
			b, _ = kvwire.AppendError(nil, kvwire.TypeError, h.ID, kvwire.Code(err), err.Error())
			return b, true
		}
		e.lease++
		held[e.lease] = true
		b, _ = kvwire.AppendLease(nil, kvwire.TypeMatched, h.ID, e.lease, e.Pages(m.Hashes))
	case kvwire.TypeRelease:
		if e.die {
			e.die = false
			return nil, false
		}
		m, err := kvwire.DecodeRelease(p, nil)
		if err != nil {
			b, _ = kvwire.AppendError(nil, kvwire.TypeError, h.ID, kvwire.Code(err), err.Error())
			return b, true
		}
		for _, id := range m.Leases {
			if !held[id] {
				b, _ = kvwire.AppendError(nil, kvwire.TypeError, h.ID, kvwire.Code(kv.ErrStaleLease), fmt.Sprintf("lease %d is not held", id))
				return b, true
			}
		}
		for _, id := range m.Leases {
			delete(held, id)
		}
		b, _ = kvwire.AppendU32(nil, kvwire.TypeReleased, h.ID, uint32(len(m.Leases)))
	case kvwire.TypeReattach:
		m, err := kvwire.ParseReattach(p, nil)
		switch {
		case err != nil:
			b, _ = kvwire.AppendError(nil, kvwire.TypeError, h.ID, kvwire.Code(err), err.Error())
			return b, true
		case m.Lease != 0:
			held[m.Lease] = true
		default:
			select {
			case e.listed <- struct{}{}:
			default:
			}
		}
		b, _ = kvwire.AppendReattached(nil, h.ID, kvwire.ReattachKept, "")
	default:
		b, _ = kvwire.AppendError(nil, kvwire.TypeError, h.ID, kvwire.Code(kv.ErrRefused), "not served: "+h.Type.String())
	}
	return b, true
}
