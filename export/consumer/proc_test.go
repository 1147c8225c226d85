package consumer_test

import (
	"net"
	"os"
	"testing"

	"github.com/stretchr/testify/require"
	"golang.org/x/sys/unix"

	"github.com/cudapool/cudapool/export/consumer"
	"github.com/cudapool/cudapool/export/internal/exporttest"
	"github.com/cudapool/cudapool/internal/proctest"
	"github.com/cudapool/cudapool/internal/unixfd"
)

// A connection whose process is gone before its handshake (it passed the socket on and
// exited) cannot be watched: its leases end when it closes, and the log says why.
func TestProcessGoneBeforeHandshake(t *testing.T) {
	pr := exporttest.NewProducer(t, nil, nil)
	before, _ := pr.Pool.Stats()
	b := pr.Publish(t, "a", 1<<20, 0x0a)
	nc := connectionOfAReapedChild(t, pr.Path)
	s := exporttest.NewSide(t, 0)
	ctx := exporttest.Ctx(t)
	imp, err := consumer.DialConn(ctx, nc, s.Dev, 0, consumer.WithLogger(exporttest.DiscardLogger))
	require.NoError(t, err)
	_, err = imp.Open(ctx, "a", s.Stream)
	require.NoError(t, err)
	require.NoError(t, b.Free(pr.Stream))
	// This side dies too: the driver drops its imports, the kernel closes its socket.
	s.Dev.Close()
	consumer.Client(imp).C.Close()
	exporttest.WaitFor(t, "the lease to end", func() bool { return len(pr.Ex.Peers()) == 0 })
	log := pr.Log.String()
	require.Contains(t, log, "cannot watch the process", "the log does not say why the leases ended at once:\n%s", log)
	require.Contains(t, log, "no such process", "the log does not say why the leases ended at once:\n%s", log)
	pr.PoolBackTo(t, before)
	pr.CheckClean(t)
}

// connectionOfAReapedChild returns a connection to the socket at path that a child
// process made, passed to this one, and exited; the child is reaped.
func connectionOfAReapedChild(t *testing.T, path string) net.Conn {
	t.Helper()
	fds, err := unix.Socketpair(unix.AF_UNIX, unix.SOCK_STREAM|unix.SOCK_CLOEXEC, 0)
	require.NoError(t, err)
	mine, theirs := os.NewFile(uintptr(fds[0]), "mine"), os.NewFile(uintptr(fds[1]), "theirs")
	defer mine.Close()
	cmd := proctest.Command(t, "connector", path)
	cmd.ExtraFiles = []*os.File{theirs}
	err = cmd.Run()
	theirs.Close()
	require.NoError(t, err, "connector: %v", err)
	via, err := net.FileConn(mine)
	require.NoError(t, err)
	defer via.Close()
	_, got, err := unixfd.Recv(via.(*net.UnixConn), make([]byte, 1), 1)
	require.NoError(t, err, "receiving the child's connection: %d descriptors, %v", len(got), err)
	require.Len(t, got, 1, "receiving the child's connection: %d descriptors, %v", len(got), err)
	f := os.NewFile(uintptr(got[0]), "conn")
	defer f.Close()
	nc, err := net.FileConn(f)
	require.NoError(t, err)
	return nc
}
