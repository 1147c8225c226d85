//go:build cgo

package main

import (
	"context"
	"encoding/binary"
	"io"
	"net"
	"os"
	"path/filepath"
	"slices"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/cudapool/cudapool/cudart"
	"github.com/cudapool/cudapool/cudart/cudarttest"
	"github.com/cudapool/cudapool/internal/session"
	"github.com/cudapool/cudapool/internal/testwait"
	"github.com/cudapool/cudapool/internal/unixfd"
	"github.com/cudapool/cudapool/kv"
	"github.com/cudapool/cudapool/kv/kvtest"
	"github.com/cudapool/cudapool/kv/owner"
	"github.com/cudapool/cudapool/kv/replica"
)

// kvSmall is a geometry of 64 KiB slabs.
var kvSmall = kv.Geometry{Layers: 2, KVHeads: 2, HeadDim: 8, TokensPerPage: 4, DType: kv.DTypeFP32, Pages: 64}

// kvOwner serves a new directory with an owner on a software device of its own (as a
// process of its own would) and returns the directory and the owner.
func kvOwner(t *testing.T) (string, *owner.Owner) {
	t.Helper()
	dir, err := os.MkdirTemp("", "capikv")
	require.NoError(t, err)
	t.Cleanup(func() { os.RemoveAll(dir) })
	dev := cudarttest.ForTest(t)
	o, err := owner.Listen(dir, dev, kvSmall, owner.WithDevices(0))
	require.NoError(t, err)
	t.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), testwait.Bound)
		defer cancel()
		_ = o.Close(ctx) // the test's end: what it checks is checked already
	})
	return dir, o
}

// kvDial is a replica of the owner at dir as C holds it, on the library's runtime.
func kvDial(t *testing.T, dir string, opts ...replica.Option) (*kvReplica, cudart.Stream) {
	t.Helper()
	rt, err := runtimeNow()
	require.NoError(t, err)
	ctx, cancel := context.WithTimeout(context.Background(), testwait.Bound)
	defer cancel()
	r, err := replica.Dial(ctx, dir, rt, 0, opts...)
	require.NoError(t, err)
	k := newKVReplica(r, "", 0)
	s, err := rt.StreamCreate(0, cudart.StreamNonBlocking)
	require.NoError(t, err)
	t.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), testwait.Bound)
		defer cancel()
		_ = k.close(ctx)           // the test's end
		_ = rt.StreamDestroy(0, s) // the test's end
	})
	return k, s
}

// ownerLeases is the number of leases the owner holds for its one replica.
func ownerLeases(o *owner.Owner) int {
	n := 0
	for _, r := range o.Stats().Replicas {
		n += r.Leases
	}
	return n
}

// TestTimedOutSealOrReleaseHoldsNothing: a seal or release whose time ran out may have
// reached the owner, which then ended the lease. capi kept the lease in its table, so
// every later batch naming it failed whole with StaleLease, and it stayed there
// forever. The call holds nothing, as CUDAPOOL_ETIMEOUT says: the table forgets the
// lease and the owner ends up holding none of it.
func TestTimedOutSealOrReleaseHoldsNothing(t *testing.T) {
	dir, o := kvOwner(t)
	k, s := kvDial(t, dir)
	ctx, cancel := context.WithTimeout(context.Background(), testwait.Bound)
	defer cancel()
	spent, stop := context.WithCancel(context.Background())
	stop() // a context that has run out: the request goes, its answer is not waited for

	for _, how := range []string{"seal", "release"} {
		l, err := k.r.Alloc(ctx, 2)
		require.NoError(t, err)
		k.put(l)
		keep, err := k.r.Alloc(ctx, 1)
		require.NoError(t, err)
		k.put(keep)
		if how == "seal" {
			_, err = k.seal(spent, l.ID(), kv.PrefixHashes("", []int32{1, 2, 3, 4, 5, 6, 7, 8}, 4), s, false)
		} else {
			err = k.release(spent, []uint64{l.ID()}, s)
		}
		if err != nil { // else the answer was there before the wait looked at the context
			require.ErrorIs(t, err, context.Canceled, how)
		}
		k.mu.Lock()
		_, kept := k.leases[l.ID()]
		k.mu.Unlock()
		assert.False(t, kept, "%s: the C table still holds the lease its timed-out call named", how)
		deadline := time.Now().Add(testwait.Bound)
		for ownerLeases(o) != 1 && time.Now().Before(deadline) {
			time.Sleep(time.Millisecond)
		}
		assert.Equal(t, 1, ownerLeases(o), "%s: the owner holds only the other lease", how)
		// A batch naming the other lease alone is released: nothing stale lingers.
		require.NoError(t, k.release(ctx, []uint64{keep.ID()}, s), how)
		require.Equal(t, 0, ownerLeases(o), how)
	}
}

// The frames of kv.sock that the lying owner below rewrites (docs/PROTOCOL.md, package
// kv/internal/kvwire): u32 len | u8 type | u8 flags | u16 0 | u32 id | payload, and a
// Leased (5) or Matched (9) payload is u64 lease | u32 n | n x u32 page.
const (
	frameHeader  = 12
	frameLeased  = 5
	frameMatched = 9
)

// proxyFraming is the frames' framing, as the lying owner reads them; what it reads
// is the real owner's, which keeps the bounds.
var proxyFraming = session.Framing{
	HeaderLen: frameHeader,
	Len:       func(h []byte, _ int) (int, error) { return int(binary.LittleEndian.Uint32(h)) + 4, nil },
	Ended:     func([]byte, int) error { return io.ErrUnexpectedEOF },
	Refused:   func(err error) error { return err },
}

// lyingOwner serves a new directory whose slab.sock is the real owner's at dir and
// whose kv.sock passes every frame through, but for the lease replies, which lie
// rewrites (given the pages, it returns the pages to claim).
func lyingOwner(t *testing.T, dir string, lie func(pages []uint32) []uint32) string {
	t.Helper()
	fake, err := os.MkdirTemp("", "capilie")
	require.NoError(t, err)
	t.Cleanup(func() { os.RemoveAll(fake) })
	ln, err := net.Listen("unix", filepath.Join(fake, "kv.sock"))
	require.NoError(t, err)
	t.Cleanup(func() { _ = ln.Close() }) // the test's end
	go func() {
		for {
			in, err := ln.Accept()
			if err != nil {
				return
			}
			out, err := net.Dial("unix", filepath.Join(dir, "kv.sock"))
			if err != nil {
				_ = in.Close() // the replica sees the owner gone
				continue
			}
			go func() { _, _ = io.Copy(out, in); _ = out.Close() }() // requests as they are
			go func() {
				defer in.Close()
				// Frames come and go whole, each with the descriptor it carries (the
				// slab's chunks ride with Grow frames).
				src := session.NewFrameReader(proxyFraming, 1<<20, 1)
				defer src.Close()
				for {
					f, err := src.Next(out, true)
					if err != nil {
						return
					}
					fd := src.TakeFD()
					var h [frameHeader]byte
					copy(h[:], f)
					p := slices.Clone(f[frameHeader:])
					if (h[4] == frameLeased || h[4] == frameMatched) && len(p) >= 12 {
						pages := make([]uint32, binary.LittleEndian.Uint32(p[8:12]))
						for i := range pages {
							pages[i] = binary.LittleEndian.Uint32(p[12+4*i:])
						}
						if len(pages) > 0 {
							pages = lie(pages)
						}
						p = binary.LittleEndian.AppendUint32(p[:8], uint32(len(pages)))
						for _, pg := range pages {
							p = binary.LittleEndian.AppendUint32(p, pg)
						}
						binary.LittleEndian.PutUint32(h[:4], uint32(len(p)+frameHeader-4))
					}
					var fds []int
					if fd >= 0 {
						fds = []int{fd}
					}
					err = unixfd.Send(in.(*net.UnixConn), append(h[:], p...), fds...)
					if fd >= 0 {
						_ = syscall.Close(fd) // sent: the replica has its own
					}
					if err != nil {
						return
					}
				}
			}()
		}
	}()
	return fake
}

// TestOwnerRepliesBeyondTheRequestAreRefused: an owner's lease reply with more pages
// than were asked for (which would write past the caller's array), or with a page the
// slab does not have, fails the C call with EPROTOCOL; capi keeps no such lease and
// gives it back to the owner.
func TestOwnerRepliesBeyondTheRequestAreRefused(t *testing.T) {
	for _, c := range []struct {
		name string
		lie  func([]uint32) []uint32
	}{
		{"one page more", func(p []uint32) []uint32 { return append(p, p[0]) }},
		{"a page past the slab", func(p []uint32) []uint32 { p[len(p)-1] = uint32(kvSmall.Pages) + 5; return p }},
	} {
		t.Run(c.name, func(t *testing.T) {
			dir, o := kvOwner(t)
			var lying atomic.Bool
			fake := lyingOwner(t, dir, func(p []uint32) []uint32 {
				if lying.Load() {
					return c.lie(p)
				}
				return p
			})
			k, s := kvDial(t, fake)
			ctx, cancel := context.WithTimeout(context.Background(), testwait.Bound)
			defer cancel()
			hs := kv.PrefixHashes("", []int32{1, 2, 3, 4, 5, 6, 7, 8}, 4)
			w, err := k.alloc(ctx, 2) // the truth, to have pages to match
			require.NoError(t, err)
			_, err = k.seal(ctx, w.ID(), hs, s, true)
			require.NoError(t, err)

			lying.Store(true)
			_, err = k.alloc(ctx, 2)
			require.Error(t, err, "alloc")
			assert.Equal(t, statusProtocol, statusOf(err), "alloc: %v", err)
			_, err = k.match(ctx, hs)
			require.Error(t, err, "match")
			assert.Equal(t, statusProtocol, statusOf(err), "match: %v", err)
			k.mu.Lock()
			kept := len(k.leases)
			k.mu.Unlock()
			assert.Zero(t, kept, "capi keeps no lease of a lying reply")
			assert.Zero(t, ownerLeases(o), "and the owner got them back")
		})
	}
}

// TestCloseNamesNoDestroyedStream: a replica's close recorded its final event on every
// stream it had sealed or released on, also on one the caller had destroyed since
// (cudapool.Stream closed at the end of its with block): on the GPU the driver died of
// SIGSEGV inside cudapool_kv_close (issue 31). cudapool_stream_destroy makes every
// replica take its last record of the stream first, and close names it no more, yet
// still covers its work.
func TestCloseNamesNoDestroyedStream(t *testing.T) {
	dir, _ := kvOwner(t)
	k, _ := kvDial(t, dir)
	h := kvReplicas.add(k)
	t.Cleanup(func() { _, _ = kvReplicas.remove(h) }) // the test's end: kvDial closes it
	rt, err := runtimeNow()
	require.NoError(t, err)
	dev, ok := rt.(*cudarttest.Device)
	if !ok {
		t.Skip("the library's runtime is not the software device")
	}
	ctx, cancel := context.WithTimeout(context.Background(), testwait.Bound)
	defer cancel()
	s, err := rt.StreamCreate(0, cudart.StreamNonBlocking) // as cudapool_stream_create does
	require.NoError(t, err)
	l, err := k.r.Alloc(ctx, 2)
	require.NoError(t, err)
	k.put(l)
	require.NoError(t, k.release(ctx, []uint64{l.ID()}, s)) // s is a stream the replica used
	held, err := k.r.Alloc(ctx, 1)                          // held at close
	require.NoError(t, err)
	k.put(held)
	before := len(dev.Violations())
	require.NoError(t, destroyStream(0, s)) // cudapool_stream_destroy
	_, err = kvReplicas.remove(h)
	require.NoError(t, err)
	require.NoError(t, k.close(ctx))
	assert.Empty(t, dev.Violations()[before:], "the replica named a stream that was destroyed")
}

// Issue 31: with CUDAPOOL_KV_RECONNECT, a release cut short by the owner's death
// (CUDAPOOL_EGONE) keeps its lease in the C table, re-declared to the restarted owner,
// so that the release made again once attached ends it. If the table dropped it, that
// release failed with CUDAPOOL_ESTALE and the restarted owner held the pages until the
// process exited.
func TestReleaseCutShortByTheOwnersDeathIsMadeAgain(t *testing.T) {
	echo := kvtest.NewEcho(t, cudarttest.ForTest(t), kvSmall)
	k, s := kvDial(t, echo.Dir(), replica.WithReconnect())
	k.reconnect = true
	ctx, cancel := context.WithTimeout(context.Background(), testwait.Bound)
	defer cancel()
	l, err := k.match(ctx, kv.PrefixHashes("", []int32{1, 2, 3, 4, 5, 6, 7, 8}, 4))
	require.NoError(t, err)
	require.Equal(t, []uint64{l.ID()}, echo.Leases())

	echo.DieAtNextRelease()
	err = k.release(ctx, []uint64{l.ID()}, s)
	require.Equal(t, statusGone, statusOf(err), "the release the owner died under: %v", err)
	require.NoError(t, k.r.WaitAttached(ctx))
	require.Equal(t, []uint64{l.ID()}, echo.Leases(), "the lease is re-declared to the restarted owner")
	require.NoError(t, k.release(ctx, []uint64{l.ID()}, s), "the release made again once attached")
	require.Empty(t, echo.Leases(), "the leases the restarted owner holds")
}
