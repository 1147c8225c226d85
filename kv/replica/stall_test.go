package replica_test

import (
	"context"
	"net"
	"os"
	"path/filepath"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/cudapool/cudapool/cudart/cudarttest"
	"github.com/cudapool/cudapool/internal/testwait"
	"github.com/cudapool/cudapool/kv"
	"github.com/cudapool/cudapool/kv/internal/kvwire"
	"github.com/cudapool/cudapool/kv/owner"
	"github.com/cudapool/cudapool/kv/replica"
)

// stalledOwner serves a directory whose slab socket is o's and whose page socket
// answers Hello and then reads nothing more, as an owner whose connection's goroutine
// is stuck would; hangUp closes that page connection.
func stalledOwner(t *testing.T, o *owner.Owner, realDir string) (dir string, hangUp func()) {
	return welcomingOwner(t, realDir, o.Geometry())
}

// welcomingOwner is stalledOwner with the geometry its Welcome says.
func welcomingOwner(t *testing.T, realDir string, g kv.Geometry) (dir string, hangUp func()) {
	dir = shortDir(t)
	accepted := make(chan net.Conn, 1)
	require.NoError(t, os.Symlink(filepath.Join(realDir, owner.SlabSocket), filepath.Join(dir, owner.SlabSocket)))
	ln, err := net.Listen("unix", filepath.Join(dir, owner.PageSocket))
	require.NoError(t, err)
	t.Cleanup(func() { ln.Close() })
	go func() {
		nc, err := ln.Accept()
		if err != nil {
			return
		}
		accepted <- nc
		if _, _, err := kvwire.NewReader().Next(nc); err != nil {
			return
		}
		b, _ := kvwire.AppendWelcome(nil, 0, kvwire.Welcome{Geometry: g, Slab: kvwire.SlabName(0)})
		nc.Write(b) // the test's Dial fails if it does not arrive
	}()
	return dir, func() { testwait.Recv(t, accepted, "the replica's page connection").Close() }
}

// A request the owner does not answer ends with its ctx: the read that waits for the
// answer is cut short.
func TestRequestToAStalledOwnerEndsWithItsContext(t *testing.T) {
	o, _, realDir := startOwner(t, small)
	dir, hangUp := stalledOwner(t, o, realDir)
	dev := cudarttest.ForTest(t)
	r, err := replica.Dial(bound(t), dir, dev, 0)
	require.NoError(t, err)
	t.Cleanup(func() {
		hangUp()
		r.Close(bound(t))
	})
	done := make(chan error, 1)
	go func() {
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Millisecond)
		defer cancel()
		_, err := r.Match(ctx, []kv.Hash{{1}}, 0)
		done <- err
	}()
	err = testwait.Recv(t, done, "a Match that its owner does not answer")
	require.ErrorIs(t, err, context.DeadlineExceeded)
}
