package e2e_test

import (
	"context"
	"net"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/cudapool/cudapool/export"
	"github.com/cudapool/cudapool/export/consumer"
	"github.com/cudapool/cudapool/export/internal/exporttest"
	"github.com/cudapool/cudapool/export/internal/wire"
)

// An accept that fails for want of descriptors (EMFILE) does not stop the exporter:
// it backs off and accepts again once descriptors are free. (It used to log the
// failure and accept nothing more, ever.)
func TestAcceptSurvivesDescriptorExhaustion(t *testing.T) {
	pr := exporttest.NewProducer(t, nil, nil)
	pr.Publish(t, "a", 1<<20, 7)
	exporttest.LowerFDLimit(t, 64)
	release := exporttest.ExhaustFDs(t, 1)
	// The one free descriptor goes to this client's socket; the exporter's accept of
	// it then finds none.
	nc, err := net.Dial("unix", pr.Path)
	require.NoError(t, err)
	defer nc.Close()
	require.Eventually(t, func() bool { return strings.Contains(pr.Log.String(), "too many open files") }, 5*time.Second, time.Millisecond,
		"the exporter's accept should fail with EMFILE")
	release()
	s := exporttest.NewSide(t, 0)
	ctx, cancel := context.WithTimeout(exporttest.Ctx(t), 5*time.Second)
	defer cancel()
	imp, err := consumer.Dial(ctx, pr.Path, s.Dev, 0, consumer.WithLogger(exporttest.DiscardLogger))
	require.NoError(t, err, "the exporter accepts again once descriptors are free")
	m, err := imp.Open(ctx, "a", s.Stream)
	require.NoError(t, err)
	require.NoError(t, m.Release(ctx, s.Stream))
	require.NoError(t, imp.Close(ctx))
}

// Importer.Close returns by its context even when the exporter pushed leases this
// Importer gives back and then stopped reading: the give-backs block on the full
// socket, and Close must not wait for them. (Close ignored its context there.)
func TestImporterCloseBoundedWhenGiveBacksAreStuck(t *testing.T) {
	path := filepath.Join(exporttest.ShortDir(t), "fake.sock")
	l, err := net.Listen("unix", path)
	require.NoError(t, err)
	defer l.Close()
	go func() {
		nc, err := l.Accept()
		if err != nil {
			return
		}
		defer nc.Close()
		c := wire.NewConn(nc, false)
		if _, _, err := c.Recv(); err != nil {
			return
		}
		ctx := context.Background()
		c.Send(ctx, &wire.WelcomeMsg{Version: export.ProtocolVersion, PID: uint32(os.Getpid())}, -1)
		for i := range 100000 { // each is given back; nobody reads the give-backs
			if c.Send(ctx, &wire.PushMsg{LeaseMsg: wire.LeaseMsg{PoolID: 1, LeaseID: uint64(i + 1), Size: 1, Length: 1}, Name: "p"}, -1) != nil {
				return
			}
		}
		time.Sleep(exporttest.HangGuard)
	}()
	s := exporttest.NewSide(t, 0)
	imp, err := consumer.Dial(exporttest.Ctx(t), path, s.Dev, 0, consumer.WithLogger(exporttest.DiscardLogger))
	require.NoError(t, err)
	time.Sleep(200 * time.Millisecond) // let the give-backs fill the socket
	ctx, cancel := context.WithTimeout(context.Background(), 100*time.Millisecond)
	defer cancel()
	closed := make(chan error, 1)
	go func() { closed <- imp.Close(ctx) }()
	select {
	case err := <-closed:
		assert.ErrorIs(t, err, context.DeadlineExceeded)
	case <-time.After(5 * time.Second):
		t.Fatal("Importer.Close ignored its context")
	}
}
