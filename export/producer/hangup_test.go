package producer_test

import (
	"context"
	"net"
	"os"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"golang.org/x/sys/unix"

	"github.com/cudapool/cudapool/export"
	"github.com/cudapool/cudapool/export/internal/exporttest"
	"github.com/cudapool/cudapool/export/internal/wire"
)

// A request whose send fails because the exporter's end is closed says
// export.ErrExporterGone even before the reader has seen the end (Release relies on it to
// succeed once the exporter is gone): the exporter's end is closed here and no reader
// runs, as when the send wins the race with the reader.
func TestSendToAClosedExporterSaysGone(t *testing.T) {
	fds, err := unix.Socketpair(unix.AF_UNIX, unix.SOCK_STREAM|unix.SOCK_CLOEXEC, 0)
	require.NoError(t, err)
	mine := os.NewFile(uintptr(fds[0]), "importer")
	nc, err := net.FileConn(mine)
	mine.Close()
	require.NoError(t, err)
	defer nc.Close()
	require.NoError(t, unix.Close(fds[1]), "the exporter's end")
	cl := wire.NewClient(wire.NewConn(nc, true), exporttest.DiscardLogger, 1)
	_, err = cl.Request(context.Background(), func(id uint64) wire.Message {
		return &wire.ReleaseMsg{ReqID: id, LeaseID: 1, Count: 1}
	}, false)
	require.ErrorIs(t, err, export.ErrExporterGone)
	assert.ErrorIs(t, err, unix.EPIPE, "and says why")
}
