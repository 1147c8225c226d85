package keep_test

import (
	"context"
	"fmt"
	"net"
	"path/filepath"
	"sync"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"golang.org/x/sys/unix"

	"github.com/cudapool/cudapool/internal/testwait"
	"github.com/cudapool/cudapool/internal/unixfd"
	"github.com/cudapool/cudapool/kv/internal/keep"
	"github.com/cudapool/cudapool/kv/internal/kvwire"
)

// Calls from many goroutines on one Client each get their own answer.
func TestClientServesConcurrentCalls(t *testing.T) {
	k := serve(t)
	c := dial(t, k)
	ctx := bound(t)
	var wg sync.WaitGroup
	for g := range 8 {
		wg.Go(func() {
			fd := memfd(t, 4096*(g+1), fmt.Sprintf("g%d", g))
			defer unix.Close(fd)
			name := fmt.Sprintf("kv/chunk/%d", g)
			for i := range 20 {
				assert.NoError(t, c.Put(ctx, name, fd, uint64(i)))
				got, size, err := c.Take(ctx, name)
				if assert.NoError(t, err) {
					assert.Equal(t, uint64(i), size)
					assert.Equal(t, fmt.Sprintf("g%d", g), contents(t, got, 2))
				}
				_, err = c.List(ctx, name)
				assert.NoError(t, err)
			}
		})
	}
	wg.Wait()
	assert.Len(t, k.s.Kept(), 8)
}

// fakeKeeper accepts one connection on a socket of its own, welcomes it and hands each
// request it reads to the test: a keeper whose answers the test times.
func fakeKeeper(t *testing.T) (string, <-chan *net.UnixConn) {
	path := filepath.Join(t.TempDir(), keep.Socket)
	ln, err := net.ListenUnix("unix", &net.UnixAddr{Name: path, Net: "unix"})
	require.NoError(t, err)
	t.Cleanup(func() { ln.Close() })
	conns := make(chan *net.UnixConn, 1)
	go func() {
		nc, err := ln.AcceptUnix()
		if err != nil {
			return
		}
		t.Cleanup(func() { nc.Close() })
		rd := kvwire.NewReader()
		h, _, err := rd.Next(nc)
		if err != nil {
			return
		}
		b, _ := keep.Append(nil, keep.TypeWelcome, h.ID, keep.Welcome{Version: keep.Version, PID: 1})
		if _, err := nc.Write(b); err != nil {
			return
		}
		conns <- nc
	}()
	return path, conns
}

// An answer that comes after its caller gave up is dropped, and the descriptor it
// carried closed: nothing leaks, and the Client serves on.
func TestClientDropsAnAbandonedAnswer(t *testing.T) {
	path, conns := fakeKeeper(t)
	c, err := keep.Dial(bound(t), path, keep.RoleServer)
	require.NoError(t, err)
	defer c.Close()
	nc := testwait.Recv(t, conns, "the fake keeper's connection")
	rd := kvwire.NewReader()

	ctx, cancel := context.WithCancel(context.Background())
	taken := make(chan error, 1)
	go func() {
		_, _, err := c.Take(ctx, "kv/host/0")
		taken <- err
	}()
	h, _, err := rd.Next(nc) // the Take is on the wire
	require.NoError(t, err)
	cancel()
	require.ErrorIs(t, testwait.Recv(t, taken, "the abandoned Take"), context.Canceled)

	before := openMemfds(t)
	fd := memfd(t, 4096, "late")
	b, err := keep.Append(nil, keep.TypeTaken, h.ID, keep.Taken{Size: 4096})
	require.NoError(t, err)
	require.NoError(t, unixfd.Send(nc, b, fd))
	unix.Close(fd)

	// The next call's answer comes after the late one: once it is back, the late one
	// was read, and its descriptor closed.
	listed := make(chan error, 1)
	go func() {
		_, err := c.List(bound(t), "")
		listed <- err
	}()
	h, _, err = rd.Next(nc)
	require.NoError(t, err)
	b, err = keep.Append(nil, keep.TypeListed, h.ID, keep.Listed{})
	require.NoError(t, err)
	_, err = nc.Write(b)
	require.NoError(t, err)
	require.NoError(t, testwait.Recv(t, listed, "the List after the abandoned Take"))
	assert.Equal(t, before, openMemfds(t), "the late answer's descriptor leaked")
}

// A keeper that answers with a frame a client never gets (a request's type) ends the
// connection: Done closes, calls fail with ErrGone.
func TestClientEndsOnAMalformedAnswer(t *testing.T) {
	path, conns := fakeKeeper(t)
	c, err := keep.Dial(bound(t), path, keep.RoleServer)
	require.NoError(t, err)
	defer c.Close()
	nc := testwait.Recv(t, conns, "the fake keeper's connection")
	b, err := keep.Append(nil, keep.TypeTake, 9, keep.Name{Name: "x"})
	require.NoError(t, err)
	_, err = nc.Write(b)
	require.NoError(t, err)
	testwait.Recv(t, c.Done(), "the client's end")
	require.ErrorIs(t, c.Err(), keep.ErrGone)
	assert.ErrorIs(t, c.Err(), keep.ErrMalformed)
	assert.ErrorContains(t, c.Err(), "the keeper sent Take")
	assert.ErrorIs(t, c.Drop(bound(t), "x"), keep.ErrGone)
}
