package unixfd

import (
	"errors"
	"net"
	"os"
	"testing"

	"golang.org/x/sys/unix"
)

func pair(t *testing.T) (*net.UnixConn, *net.UnixConn) {
	t.Helper()
	fds, err := unix.Socketpair(unix.AF_UNIX, unix.SOCK_STREAM|unix.SOCK_CLOEXEC, 0)
	if err != nil {
		t.Fatal(err)
	}
	conn := func(fd int) *net.UnixConn {
		f := os.NewFile(uintptr(fd), "sock")
		defer f.Close()
		c, err := net.FileConn(f)
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { c.Close() })
		return c.(*net.UnixConn)
	}
	return conn(fds[0]), conn(fds[1])
}

func pipeFD(t *testing.T) (r *os.File, w *os.File) {
	t.Helper()
	r, w, err := os.Pipe()
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { r.Close(); w.Close() })
	return r, w
}

func TestSendRecvPassesWorkingDescriptor(t *testing.T) {
	a, b := pair(t)
	r, w := pipeFD(t)
	if err := Send(a, []byte("hello"), int(w.Fd())); err != nil {
		t.Fatal(err)
	}
	buf := make([]byte, 16)
	n, fds, err := Recv(b, buf, 1)
	if err != nil || n != 5 || string(buf[:n]) != "hello" || len(fds) != 1 {
		t.Fatalf("Recv = %d %q %v %v", n, buf[:n], fds, err)
	}
	flags, err := unix.FcntlInt(uintptr(fds[0]), unix.F_GETFD, 0)
	if err != nil || flags&unix.FD_CLOEXEC == 0 {
		t.Fatalf("received fd not close-on-exec: flags %#x err %v", flags, err)
	}
	got := os.NewFile(uintptr(fds[0]), "w")
	defer got.Close()
	if _, err := got.Write([]byte("x")); err != nil {
		t.Fatal(err)
	}
	one := make([]byte, 1)
	if _, err := r.Read(one); err != nil || one[0] != 'x' {
		t.Fatalf("read through passed fd: %q %v", one, err)
	}
}

func TestRecvClosesUnexpectedDescriptors(t *testing.T) {
	a, b := pair(t)
	_, w1 := pipeFD(t)
	_, w2 := pipeFD(t)
	if err := Send(a, []byte("x"), int(w1.Fd()), int(w2.Fd())); err != nil {
		t.Fatal(err)
	}
	before := openFDs(t)
	n, fds, err := Recv(b, make([]byte, 4), 1)
	if !errors.Is(err, ErrUnexpectedFDs) || fds != nil || n != 1 {
		t.Fatalf("Recv = %d %v %v, want ErrUnexpectedFDs", n, fds, err)
	}
	if after := openFDs(t); after != before {
		t.Fatalf("open descriptors %d before Recv, %d after: unexpected ones leaked", before, after)
	}
}

func TestRecvWithoutDescriptors(t *testing.T) {
	a, b := pair(t)
	if err := Send(a, []byte("plain")); err != nil {
		t.Fatal(err)
	}
	n, fds, err := Recv(b, make([]byte, 8), 1)
	if err != nil || n != 5 || len(fds) != 0 {
		t.Fatalf("Recv = %d %v %v", n, fds, err)
	}
	if err := Send(a, nil); err == nil {
		t.Fatal("Send of no bytes succeeded")
	}
}

func openFDs(t *testing.T) int {
	t.Helper()
	ents, err := os.ReadDir("/proc/self/fd")
	if err != nil {
		t.Skip("no /proc/self/fd")
	}
	return len(ents)
}

// One Receiver, reused across messages with and without descriptors, too many of them
// among them, keeps Recv's guarantees for each message.
func TestReceiverReusedKeepsGuarantees(t *testing.T) {
	a, b := pair(t)
	_, w1 := pipeFD(t)
	_, w2 := pipeFD(t)
	var r Receiver
	buf := make([]byte, 8)
	before := openFDs(t)
	steps := []struct {
		fds     []int
		maxFDs  int
		wantFDs int
		wantErr bool
	}{
		{[]int{int(w1.Fd()), int(w2.Fd())}, 2, 2, false}, // grows the buffer
		{[]int{int(w1.Fd()), int(w2.Fd())}, 1, 0, true},  // the larger buffer must not let both in
		{nil, 1, 0, false},
		{[]int{int(w1.Fd())}, 0, 0, true},
		{[]int{int(w1.Fd())}, 1, 1, false},
	}
	for i, s := range steps {
		if err := Send(a, []byte("m"), s.fds...); err != nil {
			t.Fatal(err)
		}
		n, fds, err := r.Recv(b, buf, s.maxFDs)
		if n != 1 || len(fds) != s.wantFDs || (err != nil) != s.wantErr || s.wantErr && !errors.Is(err, ErrUnexpectedFDs) {
			t.Fatalf("step %d: Recv = %d %v %v, want %d descriptors, error %v", i, n, fds, err, s.wantFDs, s.wantErr)
		}
		for _, fd := range fds {
			flags, err := unix.FcntlInt(uintptr(fd), unix.F_GETFD, 0)
			if err != nil || flags&unix.FD_CLOEXEC == 0 {
				t.Fatalf("step %d: received fd not close-on-exec: flags %#x err %v", i, flags, err)
			}
			unix.Close(fd)
		}
	}
	if after := openFDs(t); after != before {
		t.Fatalf("open descriptors %d before, %d after: some leaked", before, after)
	}
}

func TestReceiverAllocatesNothingForPlainMessages(t *testing.T) {
	if raceEnabled {
		t.Skip("the race detector allocates on its own")
	}
	a, b := pair(t)
	var r Receiver
	buf := make([]byte, 8)
	msg := []byte("m")
	if n := testing.AllocsPerRun(100, func() {
		if _, err := a.Write(msg); err != nil {
			t.Fatal(err)
		}
		if _, _, err := r.Recv(b, buf, 1); err != nil {
			t.Fatal(err)
		}
	}); n != 0 {
		t.Fatalf("%v allocations per plain message", n)
	}
}
