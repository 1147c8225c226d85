//go:build linux

package cudarttest

import (
	"encoding/json"
	"errors"
	"fmt"
	"net"
	"os"
	"strings"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/cudapool/cudapool/cudart"
	"github.com/cudapool/cudapool/internal/proctest"
	"github.com/cudapool/cudapool/internal/unixfd"
	"github.com/stretchr/testify/require"
)

func TestMain(m *testing.M) {
	proctest.Main(m, map[string]func([]string) int{"remote": serveRemote})
}

// A remote is a Device in a child process that the test drives call by call over a
// SOCK_SEQPACKET socket (one message per call, descriptors riding along), so pools,
// records and event handles cross a real process boundary.
type remote struct {
	t    testing.TB
	conn *net.UnixConn
	cmd  interface {
		Wait() error
	}
	pid int
}

// request and reply are the messages of the remote protocol.
type request struct {
	Op   string
	Ptr  uint64
	N    int
	Data []byte
}

type reply struct {
	Err   string
	Kinds []ViolationKind // violations the call reported
	Ptr   uint64
	Data  []byte
}

func startRemote(t testing.TB) *remote {
	t.Helper()
	fds, err := unix.Socketpair(unix.AF_UNIX, unix.SOCK_SEQPACKET|unix.SOCK_CLOEXEC, 0)
	require.NoError(t, err)
	mine, theirs := os.NewFile(uintptr(fds[0]), "parent"), os.NewFile(uintptr(fds[1]), "child")
	defer func() { _ = theirs.Close() }() // test cleanup
	conn := fileConn(t, mine)
	t.Cleanup(func() { _ = conn.Close() }) // test cleanup
	cmd := proctest.Command(t, "remote")
	cmd.ExtraFiles = []*os.File{theirs}
	// Under -race a process lingers a second at exit to let reports settle; a child
	// that exits cleanly has nothing to report late.
	cmd.Env = append(cmd.Env, "GORACE="+strings.TrimSpace(os.Getenv("GORACE")+" atexit_sleep_ms=0"))
	require.NoError(t, cmd.Start())
	return &remote{t: t, conn: conn, cmd: cmd, pid: cmd.Process.Pid}
}

func fileConn(t testing.TB, f *os.File) *net.UnixConn {
	defer func() { _ = f.Close() }() // test cleanup
	c, err := net.FileConn(f)
	require.NoError(t, err)
	return c.(*net.UnixConn)
}

// call sends one request (and fds) and returns the reply and the descriptors it
// carried, which the caller owns.
func (r *remote) call(req request, fds ...int) (reply, []int) {
	r.t.Helper()
	msg, err := json.Marshal(req)
	require.NoError(r.t, err)
	require.NoError(r.t, r.conn.SetDeadline(time.Now().Add(time.Minute))) // a child that never answers fails the test
	require.NoError(r.t, unixfd.Send(r.conn, msg, fds...))
	buf := make([]byte, 1<<16)
	n, got, err := unixfd.Recv(r.conn, buf, 1)
	require.NoError(r.t, err)
	var rep reply
	require.NoError(r.t, json.Unmarshal(buf[:n], &rep))
	return rep, got
}

// do is call for a request that must succeed.
func (r *remote) do(req request, fds ...int) reply {
	r.t.Helper()
	rep, got := r.call(req, fds...)
	for _, fd := range got {
		_ = unix.Close(fd) // test cleanup
	}
	require.Empty(r.t, rep.Err, "remote %s", req.Op)
	return rep
}

// exit asks the child to close its Device and exit, and waits for it.
func (r *remote) exit() {
	r.t.Helper()
	r.do(request{Op: "exit"})
	require.NoError(r.t, r.cmd.Wait())
}

// serveRemote is the child: one Device, one pool, one IPC event, driven by requests
// on fd 3 until "exit" or the socket closes.
func serveRemote([]string) int {
	conn, err := net.FileConn(os.NewFile(3, "sock"))
	if err != nil {
		fmt.Fprintln(os.Stderr, "remote:", err)
		return 1
	}
	s := &server{d: New()}
	buf := make([]byte, 1<<16)
	for {
		n, fds, err := unixfd.Recv(conn.(*net.UnixConn), buf, 1)
		if err != nil || n == 0 {
			return 0 // the test ended
		}
		var req request
		if err := json.Unmarshal(buf[:n], &req); err != nil {
			fmt.Fprintln(os.Stderr, "remote:", err)
			return 1
		}
		rep, out := s.serve(req, fds)
		for _, fd := range fds {
			_ = unix.Close(fd) // test cleanup
		}
		msg, _ := json.Marshal(rep)
		var send []int
		if out >= 0 {
			send = []int{out}
		}
		if err := unixfd.Send(conn.(*net.UnixConn), msg, send...); err != nil {
			fmt.Fprintln(os.Stderr, "remote:", err)
			return 1
		}
		if out >= 0 {
			_ = unix.Close(out) // test cleanup
		}
		if req.Op == "exit" {
			_ = s.d.Close() // test cleanup
			return 0
		}
	}
}

type server struct {
	d      *Device
	pool   cudart.MemPool
	event  cudart.Event
	resume func() // of the stall on the default stream, if any
}

// serve runs one request; out is a descriptor to send back, or -1.
func (s *server) serve(req request, fds []int) (rep reply, out int) {
	out = -1
	var err error
	d := s.d
	switch req.Op {
	case "export-pool": // create an IPC pool on device 0 and send its descriptor
		if s.pool, err = d.MemPoolCreate(ipcProps(0)); err == nil {
			var h cudart.ShareableHandle
			h, err = d.MemPoolExportToShareableHandle(0, s.pool, cudart.HandleTypePosixFD)
			out = h.FD
		}
	case "import-pool":
		if len(fds) != 1 {
			err = errors.New("import-pool needs one descriptor")
			break
		}
		s.pool, err = d.MemPoolImportFromShareableHandle(0, cudart.ShareableHandle{Type: cudart.HandleTypePosixFD, FD: fds[0]})
	case "destroy-pool":
		err = d.MemPoolDestroy(0, s.pool)
	case "alloc":
		var ptr cudart.DevicePtr
		ptr, err = d.MallocFromPoolAsync(0, uint64(req.N), s.pool, 0)
		rep.Ptr = uint64(ptr)
	case "export-ptr":
		var data cudart.PtrExportData
		data, err = d.MemPoolExportPointer(0, cudart.DevicePtr(req.Ptr))
		rep.Data = data[:]
	case "import-ptr":
		var ptr cudart.DevicePtr
		ptr, err = d.MemPoolImportPointer(0, s.pool, cudart.PtrExportData(req.Data))
		rep.Ptr = uint64(ptr)
	case "free":
		err = d.FreeAsync(0, cudart.DevicePtr(req.Ptr), 0)
	case "create-event": // an IPC event of this Device; replies with its handle
		if s.event, err = d.EventCreate(0, cudart.EventIPC); err == nil {
			var h cudart.IpcEventHandle
			h, err = d.IpcGetEventHandle(0, s.event)
			rep.Data = h[:]
		}
	case "open-event":
		s.event, err = d.IpcOpenEventHandle(0, cudart.IpcEventHandle(req.Data))
	case "record":
		err = d.EventRecord(0, s.event, 0)
	case "wait":
		err = d.StreamWaitEvent(0, 0, s.event)
	case "read":
		rep.Data = make([]byte, req.N)
		err = d.MemcpyDtoHAsync(0, rep.Data, cudart.DevicePtr(req.Ptr), 0)
	case "write":
		err = d.MemcpyHtoDAsync(0, cudart.DevicePtr(req.Ptr), req.Data, 0)
	case "stall": // hold the default stream until "resume"
		s.resume, err = d.Stall(0, 0)
	case "resume":
		if s.resume != nil {
			s.resume()
		}
	case "sync":
		err = d.StreamSynchronize(0, 0)
	case "violations":
		for _, v := range d.Violations() {
			rep.Kinds = append(rep.Kinds, v.Kind)
		}
	case "exit":
	default:
		err = fmt.Errorf("unknown op %q", req.Op)
	}
	if err != nil {
		rep.Err = err.Error()
		rep.Kinds = kindsOf(err)
	}
	return rep, out
}

// kindsOf lists the kinds of the violations err reports.
func kindsOf(err error) []ViolationKind {
	var kinds []ViolationKind
	var walk func(error)
	walk = func(err error) {
		switch e := err.(type) {
		case Violation:
			kinds = append(kinds, e.Kind)
		case interface{ Unwrap() []error }:
			for _, inner := range e.Unwrap() {
				walk(inner)
			}
		case interface{ Unwrap() error }:
			walk(e.Unwrap())
		}
	}
	walk(err)
	return kinds
}
