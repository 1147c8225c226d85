package consumer_test

import (
	"context"
	"os"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/cudapool/cudapool/cudart"
	"github.com/cudapool/cudapool/export"
	"github.com/cudapool/cudapool/export/consumer"
	"github.com/cudapool/cudapool/export/internal/exporttest"
	"github.com/cudapool/cudapool/export/internal/wire"
	"github.com/cudapool/cudapool/internal/testwait"
	"github.com/cudapool/cudapool/internal/unixfd"
)

// welcomeThen is a fake exporter that admits the importer and then runs next.
func welcomeThen(next func(c *wire.Conn)) func(c *wire.Conn) {
	return func(c *wire.Conn) {
		if _, _, err := c.Recv(); err != nil {
			return
		}
		c.Send(context.Background(), &wire.WelcomeMsg{Version: export.ProtocolVersion, PID: 1}, -1)
		next(c)
	}
}

// An exporter that breaks the protocol loses its importer: the reason is logged,
// opens fail with export.ErrExporterGone, and Close completes.
func TestMalformedExporterInput(t *testing.T) {
	cases := []struct {
		name   string
		send   func(c *wire.Conn)
		logged string
	}{
		{"pool handle without descriptor", func(c *wire.Conn) {
			c.Send(context.Background(), &wire.PoolHandleMsg{PoolID: 1, HandleType: cudart.HandleTypePosixFD}, -1)
		}, "arrived with 0 descriptors, want 1"},
		{"chunk handle without descriptor", func(c *wire.Conn) {
			c.Send(context.Background(), &wire.ChunkHandleMsg{AllocID: 1, Size: 2 << 20, Count: 1, HandleType: cudart.HandleTypePosixFD}, -1)
		}, "POSIX fd ChunkHandle arrived with 0 descriptors, want 1"},
		{"descriptor on another frame", func(c *wire.Conn) {
			pr, pw, _ := os.Pipe()
			defer pr.Close()
			defer pw.Close()
			unixfd.Send(c.Uc, wire.AppendFrame(nil, &wire.ByeMsg{}), int(pw.Fd()))
		}, "Bye arrived with 1 unexpected descriptors"},
		{"two descriptors", func(c *wire.Conn) {
			pr, pw, _ := os.Pipe()
			defer pr.Close()
			defer pw.Close()
			unixfd.Send(c.Uc, wire.AppendFrame(nil, &wire.PoolHandleMsg{PoolID: 1, HandleType: cudart.HandleTypePosixFD}), int(pr.Fd()), int(pw.Fd()))
		}, "unexpected file descriptors"},
		{"unknown type", func(c *wire.Conn) { c.Nc.Write(exporttest.Frame(0, 99, nil)) }, "unknown message type 99"},
		{"garbage", func(c *wire.Conn) { c.Nc.Write([]byte("\x05\x00\x00\x00\x06garbage")) }, "Lease payload is 5 bytes"},
		{"importer's message", func(c *wire.Conn) { c.Send(context.Background(), &wire.OpenMsg{ReqID: 1, Name: "x"}, -1) }, "unexpected Open from an exporter"},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			sent := make(chan struct{})
			path, hungUp := exporttest.FakeExporterDone(t, welcomeThen(func(c *wire.Conn) {
				tc.send(c)
				close(sent)
				c.Recv() // until the importer hangs up
			}))
			s := exporttest.NewSide(t, 0)
			exporttest.WarmEventArena(t, s)
			lb := &exporttest.LogBuffer{}
			before := exporttest.OpenFDs(t)
			imp, err := consumer.Dial(exporttest.Ctx(t), path, s.Dev, 0, consumer.WithLogger(lb.Logger()))
			require.NoError(t, err)
			testwait.Recv(t, sent, "the malformed frame to go out")
			testwait.Recv(t, consumer.Client(imp).ReaderDone(), "the importer to drop the connection")
			_, err = imp.Open(exporttest.Ctx(t), "x", s.Stream)
			require.ErrorIs(t, err, export.ErrExporterGone, "Open = %v, want export.ErrExporterGone with the violation", err)
			require.ErrorIs(t, err, export.ErrProtocol, "Open = %v, want export.ErrExporterGone with the violation", err)
			require.Contains(t, lb.String(), tc.logged, "log does not say %q:\n%s", tc.logged, lb.String())
			require.NoError(t, imp.Close(exporttest.Ctx(t)), "Close =")
			testwait.Recv(t, hungUp, "the fake exporter to see the hang-up")
			after := exporttest.OpenFDs(t)
			require.LessOrEqual(t, after, before, "%d descriptors open, %d before", after, before)
			s.CheckClean(t)
		})
	}
}
