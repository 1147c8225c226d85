package cudarttest

import (
	"bytes"
	"testing"

	"golang.org/x/sys/unix"

	"github.com/cudapool/cudapool/cudart"
)

func TestChildImportsReadsAndWrites(t *testing.T) {
	exp := newFx(t)
	child := startRemote(t)
	p, fd := exp.exported()
	defer unix.Close(fd)
	ptr := exp.alloc(p, 4096)
	exp.write(ptr, []byte("parent wrote this"))
	e, err := exp.EventCreate(0, cudart.EventIPC)
	ok(t, err)
	h, err := exp.IpcGetEventHandle(0, e)
	ok(t, err)
	ok(t, exp.EventRecord(0, e, 0))

	child.do(request{Op: "import-pool"}, fd)
	child.do(request{Op: "open-event", Data: h[:]})
	data := exp.exportPtr(ptr)
	if got := child.do(request{Op: "import-ptr", Data: data[:]}).Ptr; got != uint64(ptr) {
		t.Fatalf("child imported at %#x, parent allocated at %#x", got, uint64(ptr))
	}
	child.do(request{Op: "wait"})
	if got := child.do(request{Op: "read", Ptr: uint64(ptr), N: 17}).Data; !bytes.Equal(got, []byte("parent wrote this")) {
		t.Fatalf("child read %q", got)
	}
	child.do(request{Op: "write", Ptr: uint64(ptr) + 1000, Data: []byte("child wrote this")})
	child.do(request{Op: "free", Ptr: uint64(ptr)})
	child.do(request{Op: "record"})
	ok(t, exp.StreamWaitEvent(0, 0, e))
	exp.wantBytes(ptr+1000, []byte("child wrote this"))
	ok(t, exp.FreeAsync(0, ptr, 0))
	if kinds := child.do(request{Op: "violations"}).Kinds; len(kinds) != 0 {
		t.Fatalf("child saw violations %v", kinds)
	}
	child.exit()
	ok(t, exp.Err())
}
